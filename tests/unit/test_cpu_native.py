"""The C++ CPU decoder (csrc/cpu_decoder.cpp, worker/cpu_native.py): bitwise the outputs of the
Python layers in every CPU weight format and attention plan (pool view or gather, cached prefix,
decode and prefill in one batch), and the Python layers wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
from model_support import PROMPT, Driver, Seq, save_hf, tiny_hf_model

from radix_runtime.config import ServerArgs
from radix_runtime.worker import cpu_native
from radix_runtime.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    cpu_native.load_extension() is None,
    reason="the _cpu_decoder extension is not built (python setup.py build_ext --inplace)",
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {
        "llama": save_hf(tiny_hf_model("llama"), root / "llama"),
        "qwen2": save_hf(tiny_hf_model("qwen2", bias_std=0.3), root / "qwen2"),  # q/k/v biases
        "mistral": save_hf(tiny_hf_model("mistral", sliding_window=8), root / "mistral"),
        "qwen3": save_hf(tiny_hf_model("qwen3"), root / "qwen3"),
    }


def runner(folder: str, **flags) -> ModelRunner:
    flags = {"page_size": 4, "max_total_tokens": 2048, "max_running_requests": 5, **flags}
    return ModelRunner(ServerArgs(model=folder, device="cpu", **flags))


def drive(driver: Driver) -> list[list[list[torch.Tensor | None]]]:
    """Prefill of two requests, a third request on the first one's cached prefix (its keys
    gathered) while both decode (a mixed batch), decode-only steps of three requests (gathered)
    and of one (a view of the pool), a request on scattered pages. Per step, per runner, each
    request's logits."""
    a, b, c = Seq(0), Seq(1), Seq(2)
    steps = [
        driver.step([driver.req(a, PROMPT[:21]), driver.req(b, PROMPT[5:30])]),
    ]
    driver.share_prefix(c, a, 20)
    steps.append(
        driver.step([driver.req(a, [7]), driver.req(c, PROMPT[20:33]), driver.req(b, [9])])
    )
    for i in range(3):
        steps.append(driver.step([driver.req(s, [11 + i]) for s in (a, b, c)]))
    lone = Seq(3)
    steps.append(driver.step([driver.req(lone, PROMPT[:9])]))
    for i in range(3):
        steps.append(driver.step([driver.req(lone, [20 + i])]))
    # keys on every other page: a prefill chunk and a lone decode that gather them
    scattered = Seq(4, pages=[300 + 2 * i for i in range(23)])
    steps.append(driver.step([driver.req(scattered, PROMPT * 2)]))
    steps.append(driver.step([driver.req(scattered, [5])]))
    return [[logits for _, logits in per_runner] for per_runner in steps]


@pytest.mark.parametrize(
    "arch,fmt",
    [
        ("llama", "float32"),
        ("llama", "bfloat16"),
        ("llama", "int8"),
        ("llama", "int4"),
        ("qwen2", "float32"),
        ("qwen2", "int4"),
    ],
)
def test_native_decoder_is_bitwise_the_python_layers(folders, arch, fmt):
    native = runner(folders[arch], cpu_weight_format=fmt)
    python = runner(folders[arch], cpu_weight_format=fmt, disable_cpu_native_decoder=True)
    assert native.model.cpu_decoder is not None and python.model.cpu_decoder is None
    calls = 0
    forward = native.model.cpu_decoder.forward

    def counted(*args):
        nonlocal calls
        calls += 1
        return forward(*args)

    native.model.cpu_decoder.forward = counted
    steps = drive(Driver([native, python]))
    assert calls == len(steps)  # every step ran the C++ layers
    for ours, theirs in steps:
        assert len(ours) == len(theirs)
        for x, y in zip(ours, theirs):
            assert torch.equal(x, y)


@pytest.mark.parametrize(
    "arch,flags",
    [
        ("mistral", {}),  # a sliding window: the backend plans per window
        ("qwen3", {}),  # q/k norms: layers of its own
        ("llama", {"kv_cache_dtype": "fp8_e4m3"}),
        ("llama", {"disable_cpu_native_decoder": True}),
    ],
)
def test_python_layers_run_where_the_native_decoder_does_not_apply(folders, arch, flags):
    r = runner(folders[arch], **flags)
    assert r.model.cpu_decoder is None
    reference = runner(folders[arch], **flags)  # the same model again: the outputs are defined
    for ours, theirs in drive(Driver([r, reference])):
        assert all(torch.equal(x, y) for x, y in zip(ours, theirs))


def test_a_decoder_built_for_another_pool_is_not_used(folders):
    r = runner(folders["llama"])
    other = runner(folders["llama"])
    assert not r.model.cpu_decoder.serves(r.attn, other.kv_pool)
    assert not r.model.cpu_decoder.serves(other.attn, r.kv_pool)
    assert r.model.cpu_decoder.serves(r.attn, r.kv_pool)


@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_row_loops_are_bitwise_the_aten_calls(folders, fmt):
    """float32 steps run RMSNorm's tail, RoPE + the KV store and the residual adds as C++ loops
    over the rows (cpu_decoder.cpp); the same steps through the ATen calls give the same logits
    and the same pool bits, in every attention plan `drive` covers."""
    loops = runner(folders["llama"], cpu_weight_format=fmt)
    aten = runner(folders["llama"], cpu_weight_format=fmt)
    assert loops.model.cpu_decoder._impl.row_loops  # on by default
    aten.model.cpu_decoder._impl.row_loops = False
    for ours, theirs in drive(Driver([loops, aten])):
        assert all(torch.equal(x, y) for x, y in zip(ours, theirs))
    for i in range(loops.model.config.num_layers):
        assert torch.equal(loops.kv_pool.k_flat(i), aten.kv_pool.k_flat(i))
        assert torch.equal(loops.kv_pool.v_flat(i), aten.kv_pool.v_flat(i))


@pytest.mark.parametrize(
    "batch,length,heads,kv_heads", [(1, 1, 9, 3), (1, 77, 9, 3), (3, 40, 4, 4)]
)
def test_decode_attention_is_sdpa_of_one_query_row(batch, length, heads, kv_heads):
    """The C++ decode attention (one query row per request over all of its keys, on pool views
    with a head stride) against ATen's SDPA with grouped query heads."""
    ext = cpu_native.load_extension()
    g = torch.Generator().manual_seed(batch * 100 + length)
    pool_k = torch.randn(batch, length + 5, kv_heads, 64, generator=g) * 2
    pool_v = torch.randn(batch, length + 5, kv_heads, 64, generator=g)
    k, v = pool_k[:, 3 : 3 + length], pool_v[:, 3 : 3 + length]  # strided views, as of the pool
    q = torch.randn(batch, heads, 64, generator=g)
    ours = ext.decode_attention(q, k, v, 0.125)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), scale=0.125, enable_gqa=True
    ).squeeze(2)
    torch.testing.assert_close(ours, ref, atol=2e-6, rtol=2e-5)
    with pytest.raises(RuntimeError, match="float32"):
        ext.decode_attention(q.double(), k, v, 0.125)


def _chunk_reference(q, k_all, v_all, locs, prefix, scale):
    """Query row j over keys 0..prefix+j, in float64 (repeated KV heads)."""
    group = q.shape[1] // k_all.shape[1]
    k = k_all[locs].double().repeat_interleave(group, 1)
    v = v_all[locs].double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    q_pos = torch.arange(q.shape[0])[:, None] + prefix
    scores = scores.masked_fill(torch.arange(len(locs))[None, :] > q_pos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize(
    "n,prefix,heads,kv_heads,dim", [(9, 900, 9, 3, 64), (1, 0, 4, 4, 64), (20, 37, 8, 2, 32),
                                    (5, 11, 6, 2, 48), (3, 16, 4, 1, 20)]
)  # fmt: skip
def test_chunk_attention_is_causal_attention_over_the_pool(n, prefix, heads, kv_heads, dim):
    """The C++ chunk attention (a small prefill chunk over its cached prefix, keys read through
    scattered pool locations) against a float64 reference, with SIMD (dims a multiple of 16) and
    without; and batch-invariant: each query row's output, bitwise, whether it is alone or one
    of the chunk's rows (the row's result depends on its query and keys only)."""
    ext = cpu_native.load_extension()
    g = torch.Generator().manual_seed(n * 1000 + prefix)
    pool = 4 * (prefix + n) + 8
    k_all = torch.randn(pool, kv_heads, dim, generator=g) * 2
    v_all = torch.randn(pool, kv_heads, dim, generator=g)
    locs = torch.randperm(pool, generator=g)[: prefix + n]
    q = torch.randn(n, heads, dim, generator=g)
    ref = _chunk_reference(q, k_all, v_all, locs, prefix, dim**-0.5)
    for simd in (True, False):
        ours = ext.chunk_attention(q, k_all, v_all, locs, prefix, dim**-0.5, simd=simd)
        torch.testing.assert_close(ours, ref, atol=2e-6, rtol=2e-5)
        for j in range(n):
            alone = ext.chunk_attention(
                q[j : j + 1], k_all, v_all, locs[: prefix + j + 1], prefix + j, dim**-0.5, simd
            )
            assert torch.equal(alone[0], ours[j])
    with pytest.raises(RuntimeError, match="locs"):
        ext.chunk_attention(q, k_all, v_all, locs[:-1], prefix, 0.1)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ext.chunk_attention(q, k_all, v_all, locs + pool, prefix, 0.1)


def test_chunk_attention_is_the_same_on_one_and_two_threads():
    """Scores split over (KV head, key block) items, values over (KV head, query row): no sum
    crosses an item, so the bits do not depend on the thread count."""
    ext = cpu_native.load_extension()
    g = torch.Generator().manual_seed(5)
    k_all, v_all = torch.randn(2000, 3, 64, generator=g), torch.randn(2000, 3, 64, generator=g)
    locs = torch.randperm(2000, generator=g)[:909]
    q = torch.randn(9, 9, 64, generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(ext.chunk_attention(q, k_all, v_all, locs, 900, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory):
    """A model wide enough that one step's loops split between two threads: prefill rows of 512
    values (RMSNorm, RoPE, residual rows), 32-48 tiles per projection, decode attention of a KV
    head over ~200 keys."""
    model = tiny_hf_model(
        "llama",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return save_hf(model, tmp_path_factory.mktemp("wide") / "llama")


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_one_and_two_threads_give_the_same_bits(wide_folder, fmt):
    """The C++ layers and the quantized kernels split rows, output tiles and KV heads between
    threads, never a sum: a step's logits and KV rows are bitwise the same on 1 and 2 threads, in
    a prefill of two requests, a chunk that samples nothing (an LM head of no rows), a batch-2
    decode and a lone decode. (float32's products are MKL's sgemm, whose blocking follows the
    thread count for some shapes: a 70-row chunk differs in the last bits, Python layers too.)"""
    ext = cpu_native.load_extension()
    if torch.backends.openmp.is_available() and ext.parallel_threads(8) == 1:
        pytest.fail("the extension's parallel_for runs on one thread (built without OpenMP?)")
    one, two = (runner(wide_folder, cpu_weight_format=fmt, page_size=16) for _ in range(2))
    for r, n in ((one, 1), (two, 2)):  # the runner sets torch's threads to these for each step
        r.threads = r.small_step_threads = n
    driver = Driver([one, two])
    a, b = Seq(0), Seq(1)
    ids = (PROMPT * 5)[:200]
    steps = [driver.step([driver.req(a, ids[:120]), driver.req(b, ids[3:130])])]
    steps.append(driver.step([driver.req(a, ids[120:190], sample=False, prompt_logprobs=False)]))
    steps.append(driver.step([driver.req(a, ids[190:]), driver.req(b, [5])]))
    steps += [driver.step([driver.req(a, [9 + i]), driver.req(b, [7])]) for i in range(2)]
    steps += [driver.step([driver.req(a, [30 + i])]) for i in range(2)]
    for (_, ours), (_, theirs) in steps:
        assert len(ours) == len(theirs)
        for x, y in zip(ours, theirs):
            assert (x is None and y is None) or torch.equal(x, y)
    for i in range(one.model.config.num_layers):
        assert torch.equal(one.kv_pool.k_flat(i), two.kv_pool.k_flat(i))
        assert torch.equal(one.kv_pool.v_flat(i), two.kv_pool.v_flat(i))
