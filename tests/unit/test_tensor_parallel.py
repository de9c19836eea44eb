"""Tensor parallelism on the CPU (gloo): each rank's share of the model, and two real ranks
giving what one worker gives.

Two processes (tests/tp_support.py) each run a ModelRunner holding half of every layer, joined by
torch.distributed over gloo, through the overlap schedule's steps (prefill chunks, a chunk that
samples nothing, greedy / penalized / seeded sampling, logprobs, decodes fed from the device);
rank 0's results must equal --tp 1's token for token, and its logits must match to float32
rounding (the all-reduce sums partial products in another order). The models cover the split
KV heads with biases (o_proj's bias added once), KV heads replicated over the ranks (1 KV head,
--tp 2), and the dummy weights' fused tensors.
"""

from __future__ import annotations

import pytest
import torch
from model_support import save_hf, tiny_hf_model
from tp_support import run_ranks, run_steps, runner_args

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.worker.distributed import kv_heads_of, shard_checkpoint, shard_config
from radix_runtime.worker.model_config import UnsupportedModel, load_hf_config


def _hf_llama(folder, num_kv_heads: int, bias: bool) -> str:
    model = tiny_hf_model(seed=num_kv_heads, num_hidden_layers=2, num_key_value_heads=num_kv_heads,
                          head_dim=16, attention_bias=bias, tie_word_embeddings=False)  # fmt: skip
    return save_hf(model, folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    split = _hf_llama(tmp_path_factory.mktemp("kv2"), num_kv_heads=2, bias=True)
    replicated = _hf_llama(tmp_path_factory.mktemp("kv1"), num_kv_heads=1, bias=False)
    return [split, replicated, "dummy:tiny-llama"]


@pytest.fixture(scope="module")
def two_ranks(models, tmp_path_factory):
    """Rank 0's results from two gloo ranks, per model."""
    return run_ranks(models, str(tmp_path_factory.mktemp("tp")), env={"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.parametrize("which", [0, 1, 2], ids=["kv-split-bias", "kv-replicated", "dummy"])
def test_two_gloo_ranks_equal_one_worker(models, two_ranks, which):
    from radix_runtime.worker.model_runner import ModelRunner

    model = models[which]
    want = run_steps(ModelRunner(runner_args(model, "cpu", 1)))
    got = two_ranks[model]
    assert got["num_pages"] == want["num_pages"]
    assert got["kv_heads"] == max(1, want["kv_heads"] // 2)  # each rank's share of the pool
    for g, w in zip(got["results"], want["results"]):
        g, w = m.decode(g), m.decode(w)
        assert [r.next_id for r in g.results] == [r.next_id for r in w.results]
        assert [r.logprob for r in g.results] == pytest.approx(
            [r.logprob for r in w.results], abs=1e-4
        )
        assert [m.unpack_ids(r.top_ids).tolist() for r in g.results] == [
            m.unpack_ids(r.top_ids).tolist() for r in w.results
        ]
    assert [x is None for x in got["logits"]] == [x is None for x in want["logits"]]
    for g, w in zip(got["logits"], want["logits"]):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# each rank's share


def test_shard_config_splits_heads_and_columns(models):
    full = load_hf_config(models[0])  # 4 q heads, 2 KV heads, intermediate 96
    local = shard_config(full, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.tp_size) == (
        2, 1, 48, 2,
    )  # fmt: skip
    assert (local.hidden_size, local.vocab_size, local.head_dim) == (64, 128, 16)
    assert shard_config(full, 1) is full
    assert [kv_heads_of(full, r, 2) for r in (0, 1)] == [range(0, 1), range(1, 2)]


def test_kv_heads_replicate_when_tp_is_a_multiple(models):
    full = load_hf_config(models[1])  # 4 q heads, 1 KV head
    assert shard_config(full, 4).num_kv_heads == 1
    assert [kv_heads_of(full, r, 4) for r in range(4)] == [range(0, 1)] * 4
    import dataclasses

    six_kv = dataclasses.replace(full, num_heads=12, num_kv_heads=6)
    with pytest.raises(UnsupportedModel, match="6 KV heads over --tp 4: neither divides"):
        shard_config(six_kv, 4)
    with pytest.raises(UnsupportedModel, match="4 attention heads do not divide over --tp 3"):
        shard_config(full, 3)


def test_shard_checkpoint_slices_hf_and_fused_names_alike(models):
    """q/k/v and gate/up given one by one (HF) or fused (GGUF cache, dummy weights) give the same
    rank slices; o_proj and down_proj are cut by columns; a row-parallel bias lives on rank 0."""
    full = load_hf_config(models[0])
    d, hid, inter = full.head_dim, full.hidden_size, full.intermediate_size
    q, k, v = (torch.randn(n * d, hid) for n in (4, 2, 2))
    gate, up = torch.randn(inter, hid), torch.randn(inter, hid)
    o, down, o_bias = torch.randn(hid, 4 * d), torch.randn(hid, inter), torch.randn(hid)
    p = "model.layers.0."
    hf = [(p + "self_attn.q_proj.weight", q), (p + "self_attn.k_proj.weight", k),
          (p + "self_attn.v_proj.weight", v), (p + "mlp.gate_proj.weight", gate),
          (p + "mlp.up_proj.weight", up), (p + "self_attn.o_proj.weight", o),
          (p + "mlp.down_proj.weight", down), (p + "self_attn.o_proj.bias", o_bias)]  # fmt: skip
    fused = [(p + "self_attn.qkv_proj.weight", torch.cat([q, k, v])),
             (p + "mlp.gate_up_proj.weight", torch.cat([gate, up]))]  # fmt: skip
    for rank in (0, 1):
        got = dict(shard_checkpoint(hf, full, rank, 2))
        qs, ks = slice(rank * 2 * d, (rank + 1) * 2 * d), slice(rank * d, (rank + 1) * d)
        i = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(got[p + "self_attn.q_proj.weight"], q[qs])
        assert torch.equal(got[p + "self_attn.k_proj.weight"], k[ks])
        assert torch.equal(got[p + "mlp.up_proj.weight"], up[i])
        assert torch.equal(got[p + "self_attn.o_proj.weight"], o[:, qs])
        assert torch.equal(got[p + "mlp.down_proj.weight"], down[:, i])
        assert torch.equal(got[p + "self_attn.o_proj.bias"], o_bias if rank == 0 else 0 * o_bias)
        got_fused = dict(shard_checkpoint(fused, full, rank, 2))
        assert torch.equal(
            got_fused[p + "self_attn.qkv_proj.weight"], torch.cat([q[qs], k[ks], v[ks]])
        )
        assert torch.equal(got_fused[p + "mlp.gate_up_proj.weight"], torch.cat([gate[i], up[i]]))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tp": 0}, "--tp must be >= 1"),
        ({"tp": 3, "nnodes": 2, "dist_init_addr": "10.0.0.1:5000"}, "does not divide over"),
        ({"tp": 4, "nnodes": 2}, "needs --dist-init-addr"),
        ({"tp": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank must"),
        ({"tp": 2, "dist_init_addr": "no-port"}, "is not HOST:PORT"),
        ({"tp": 2, "dp": 2}, "--tp > 1 does not support --dp > 1"),
        ({"tp": 2, "quantization": "fp8"}, "does not support --quantization fp8"),
        ({"tp": 2, "enable_hierarchical_cache": True}, "--enable-hierarchical-cache"),
    ],
)
def test_tp_flags_are_validated(changes, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**changes).validate()


def test_tp_flags_parse_in_sglang_spelling():

    from radix_runtime.config import parse_server_args

    for flags in (["--tp", "2"], ["--tp-size", "2"], ["--tensor-parallel-size", "2"]):
        assert parse_server_args(flags).tp == 2
    assert parse_server_args([]).tp == 1
    multi = ["--tp", "16", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"]
    args = parse_server_args(multi)
    assert (args.tp, args.nnodes, args.node_rank, args.dist_init_addr) == (
        16,
        2,
        1,
        "10.0.0.1:5000",
    )


def test_rendezvous_and_inboxes(tmp_path):
    """One host: the ranks meet through a file in the private ipc dir (no port) and receive
    their steps on ipc paths they bind; across hosts: TCP at --dist-init-addr, and a remote
    rank's steps on PORT+1+rank, bound by the scheduler."""
    from radix_runtime.utils.tp import local_ranks, rank_inbox, rank_role
    from radix_runtime.worker.distributed import TPRank

    one = ServerArgs(tp=2)
    assert TPRank.for_worker(one, 1, str(tmp_path)) == TPRank(
        1, 2, 1, f"file://{tmp_path}/tp_rendezvous", True
    )
    assert [rank_inbox(one, str(tmp_path), r) for r in (0, 1)] == [
        (f"ipc://{tmp_path}/worker", True), (f"ipc://{tmp_path}/worker1", True),
    ]  # fmt: skip
    assert [rank_role(r) for r in (0, 1)] == ["worker", "worker_tp1"]
    assert not TPRank.for_worker(ServerArgs(), 0, str(tmp_path)).enabled

    node1 = ServerArgs(tp=4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert list(local_ranks(node1)) == [2, 3]
    rank3 = TPRank.for_worker(node1, 3, str(tmp_path))
    assert (rank3.local_rank, rank3.init_method, rank3.local_only) == (
        1,
        "tcp://10.0.0.1:5000",
        False,
    )
    assert rank_inbox(node1, str(tmp_path), 1) == (f"ipc://{tmp_path}/worker1", True)
    assert rank_inbox(node1, str(tmp_path), 3) == ("tcp://10.0.0.1:5004", False)
