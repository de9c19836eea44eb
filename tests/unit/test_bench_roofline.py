"""bench/roofline.py's arithmetic on a model small enough to count by hand, and bench/serving.py's
roofline section built from it (the decode steps the server reports, the pool's ideal batches)."""

from __future__ import annotations

import pytest

from bench import roofline, serving
from bench.common import RequestResult

# 2 layers, hidden 4, MLP 8, 2 query heads and 1 KV head of dim 2, vocab 10, bf16 weights and KV
SHAPE = roofline.ModelShape(
    num_layers=2,
    hidden_size=4,
    intermediate_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    vocab_size=10,
    weight_bytes_per_param=2,
    kv_bytes_per_element=2,
)
CEILINGS = roofline.Ceilings(matmul_flops=100.0, bandwidth=10.0)


def test_the_shape_counts_weights_and_kv():
    # q 4x4, k and v 4x2 each, o 4x4, gate / up / down 4x8
    assert SHAPE.layer_params == 16 + 16 + 16 + 96
    # two layers and the LM head (10 x 4), 2 bytes each
    assert SHAPE.decode_weight_bytes == (2 * 144 + 40) * 2
    assert SHAPE.kv_bytes_per_token == 2 * (2 * 1 * 2 * 2)


def test_prefill_flops_count_weights_lm_head_and_causal_attention():
    # 2 new tokens after 1 cached: weights 2 * 2 * 288, LM head once 2 * 4 * 10, attention
    # 4 * heads * head_dim = 16 FLOPs a key, the queries at positions 1 and 2 see 2 + 3 keys in
    # each of the 2 layers
    assert roofline.prefill_flops(SHAPE, 2, 1) == 1152 + 80 + 16 * 10
    assert roofline.prefill_flops(SHAPE, 0, 5) == 0


def test_decode_reads_each_rows_whole_context():
    # a 3-token prompt, 3 outputs: rows 1 and 2 attend to 4 and 5 keys, 8 bytes a key a layer
    assert roofline.decode_kv_bytes(SHAPE, 3, 3) == 8 * 2 * (4 + 5)
    assert roofline.decode_kv_bytes(SHAPE, 3, 1) == 0  # the only token came from the prefill
    assert roofline.decode_flops(SHAPE, 3, 3) == 2 * 2 * 328 + 16 * 2 * (4 + 5)


def test_a_sliding_window_caps_the_keys_of_its_layer():
    windowed = roofline.ModelShape(**{**SHAPE.to_dict(), "layer_windows": (2, 0)})
    # layer 0 sees at most 2 keys: 2 + 2 (rows 1, 2); layer 1 sees 4 + 5
    assert roofline.decode_kv_bytes(windowed, 3, 3) == 8 * (4 + 9)
    # prefill of positions 0..3: window 2 gives 1 + 2 + 2 + 2, no window 1 + 2 + 3 + 4
    assert roofline.attention_flops(windowed, 0, 4) == 16 * (7 + 10)
    assert roofline.ModelShape.from_dict(windowed.to_dict()) == windowed


def test_workload_roofline_adds_prefill_and_decode_time():
    r = roofline.workload_roofline(SHAPE, CEILINGS, [(3, 1, 3)], decode_steps=2)
    assert r["prefill_s"] == pytest.approx(1392 / 100)
    # 144 KV bytes + 2 steps x 656 weight bytes at 10 B/s beats 1600 FLOPs at 100 FLOP/s
    assert r["decode_s"] == pytest.approx((144 + 2 * 656) / 10)
    assert r["decode_bound"] == "bandwidth"
    assert r["output_tok_s"] == pytest.approx(3 / (13.92 + 145.6))
    assert r["mean_decode_batch"] == 1
    fast_memory = roofline.Ceilings(matmul_flops=100.0, bandwidth=1e9)
    assert roofline.workload_roofline(SHAPE, fast_memory, [(3, 1, 3)], 2)["decode_s"] == 16
    assert roofline.fraction(1.5, 3.0) == 0.5
    assert roofline.fraction(None, 3.0) is None


def test_the_serial_bound_runs_matmuls_and_attention_one_after_another():
    # 2 steps of 1 row: per step max(656 weight bytes / 10, 2 x 328 FLOPs / 100) = 65.6 s, then
    # attention: max(144 KV bytes / 10, 288 attention FLOPs / 100) = 14.4 s
    r = roofline.workload_roofline(SHAPE, CEILINGS, [(3, 1, 3)], decode_steps=2)
    assert r["decode_serial_s"] == pytest.approx(2 * 65.6 + 14.4)
    assert r["output_tok_s_serial"] == pytest.approx(3 / r["total_serial_s"])
    # 4 requests in 2 steps of 4 rows at 30 FLOP/s: a step's matmuls are compute-bound
    # (2 x 4 x 328 / 30 = 87.47 s > 65.6 s) while attention is bandwidth-bound (576 KV bytes /
    # 10 = 57.6 s > 1152 FLOPs / 30 = 38.4 s): one after another they take longer than the
    # overlapped bound, max(1888 bytes / 10, 6400 FLOPs / 30) = 213.3 s
    mixed = roofline.Ceilings(matmul_flops=30.0, bandwidth=10.0)
    r = roofline.workload_roofline(SHAPE, mixed, [(3, 1, 3)] * 4, decode_steps=2)
    assert r["decode_s"] == pytest.approx(6400 / 30)
    assert r["decode_serial_s"] == pytest.approx(2 * 2624 / 30 + 57.6)
    assert r["decode_serial_s"] > r["decode_s"]
    assert roofline.workload_roofline(SHAPE, CEILINGS, [(3, 1, 1)], 0)["decode_serial_s"] == 0


def test_ideal_decode_steps_use_the_batches_the_pool_holds():
    # 6 decode rows; the longest request needs 9 tokens = 3 pages of 4 = 12 tokens
    assert roofline.ideal_decode_steps([3, 5], [6, 9], pool_tokens=10, page_size=4) == 6
    # both fit: 3 steps of 2, but the 5-token request alone needs 4 steps
    assert roofline.ideal_decode_steps([3, 5], [6, 9], pool_tokens=24, page_size=4) == 4
    assert roofline.ideal_decode_steps([5, 5, 5, 5], [8] * 4, pool_tokens=16, page_size=1) == 8
    assert roofline.ideal_decode_steps([1, 1], [4, 4], pool_tokens=100) == 0


def test_serving_roofline_summary_uses_the_servers_decode_steps():
    def result(prompt: int, cached: int, output: int) -> RequestResult:
        return RequestResult(prompt_tokens=prompt, cached_tokens=cached, output_tokens=output)

    pairs = [(None, result(3, 1, 3)), (None, result(3, 1, 3)), (None, RequestResult(error="x"))]
    probe = {"shape": SHAPE.to_dict(), "matmul_TFLOPs": 100 / 1e12, "copy_TBps": 10 / 1e12}
    before = {"decode_steps": 10, "retractions": 1}
    after = {
        "decode_steps": 14,
        "retractions": 1,
        "max_total_tokens": 12,
        "max_running_requests": 8,
        "cache": {"page_size": 1},
    }
    out = serving.roofline_summary(pairs, probe, before, after, output_tok_s=0.01)
    # the server ran 4 decode steps (batches of 1); the pool (12 tokens) holds both 6-token
    # requests at once: 2 steps of 2
    assert out["roofline_run"]["decode_steps"] == 4
    assert out["roofline"]["decode_steps"] == 2
    two = [(3, 1, 3), (3, 1, 3)]
    ideal = roofline.workload_roofline(SHAPE, CEILINGS, two, 2)
    assert out["roofline"] == ideal
    assert out["roofline_fraction"] == pytest.approx(0.01 / ideal["output_tok_s"])
    ran = roofline.workload_roofline(SHAPE, CEILINGS, two, 4)
    assert out["roofline_run_fraction"] == pytest.approx(0.01 / ran["output_tok_s"])
    assert out["retractions"] == 0


def test_kernel_phases_name_the_kernels_of_a_decode_step():
    from bench.kernel_phases import kernel_phase, phase_breakdown

    assert kernel_phase("_gemv_fused_kernel") == "matmul"
    assert kernel_phase("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "matmul"
    assert kernel_phase("_decode_split_kernel") == "attention"
    # FlashInfer's FA3 kernels on Hopper (the name holds "fill", which is not a copy)
    fa3 = "void flashinfer::PrefillWithKVCacheKernel<flashinfer::SparseCollectiveMainloop<Paged"
    assert kernel_phase(fa3) == "attention"
    assert kernel_phase("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>") == "attention"
    assert kernel_phase("_store_kv_kernel") == "kv_store"
    assert kernel_phase("_rotary_qk_kernel") == "rope"
    assert kernel_phase("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>") == "norm_act"
    assert kernel_phase("void at::native::reduce_kernel<512, 1, ArgMaxOps<float>>") == "sampling"
    assert kernel_phase("void at::native::indexSelectSmallIndex<c10::BFloat16>") == "embedding"
    assert kernel_phase("something_else") == "other"
    rows = [
        {"name": "_gemv_fused_kernel", "us": 10.0},
        {"name": "_decode_split_kernel", "us": 3.0},
        {"name": "_decode_merge_kernel", "us": 1.0},
    ]
    assert list(phase_breakdown(rows).items()) == [("matmul", 10.0), ("attention", 4.0)]
