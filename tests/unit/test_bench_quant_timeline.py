"""bench/quant.py's step timeline by kernel role (`timeline_by_role`): the matmul kernels of a
step take the layer's roles in turn (the last one is the LM head), the others their phase; a
kernel's marginal time is what it adds to the step's span (its overlap with the kernel before
it excluded), its gap negative when it started before that kernel ended."""

from __future__ import annotations

import pytest

from bench.quant import timeline_by_role

ROLES = ("qkv", "o", "gate_up", "down")


def _steps(steps: int, layers: int = 2) -> list[tuple[float, float, str]]:
    """(start, duration, name) of `steps` identical steps: per layer qkv 10 us, RoPE 2 (starting
    1 us before qkv ends), o 5 (2 us early), gate_up 20, down 8; then the head 50 and an argmax 3
    (1 us after the head)."""
    out, t = [], 0.0
    layer = [("_gemv_fused_kernel", 10, 0), ("_rotary_qk_kernel", 2, -1),
             ("_int4_gemv_kernel", 5, -2), ("_fp8_mma_gemv_kernel", 20, 0),
             ("_gemv_fused_kernel", 8, 0)]  # fmt: skip
    for _ in range(steps):
        for name, dur, shift in layer * layers + [("_gemv_fused_kernel", 50, 0), ("argmax", 3, 1)]:
            t += shift
            out.append((t, dur, name))
            t += dur
        t += 100
    return out


def test_roles_marginal_and_gaps():
    got = timeline_by_role(_steps(3)[::-1], 3, ROLES)  # (any order: sorted by start)
    assert got["kernels_per_step"] == 12
    roles = got["by_role"]
    assert roles["lm_head"] == {"dur_us": 50, "marginal_us": 50, "gap_us": 0, "kernels": 1}
    assert roles["gate_up"]["dur_us"] == 40 and roles["gate_up"]["kernels"] == 2
    assert roles["o"]["dur_us"] == 10 and roles["o"]["marginal_us"] == 6
    assert roles["o"]["gap_us"] == -4
    assert roles["rope"]["marginal_us"] == 2 and roles["rope"]["gap_us"] == -2
    assert roles["sampling"]["marginal_us"] == 4
    assert got["span_us"] == pytest.approx(sum(r["marginal_us"] for r in roles.values()))
    assert list(roles)[0] == "lm_head"  # largest marginal first


def test_uneven_steps_are_reported():
    assert "error" in timeline_by_role(_steps(2)[:-1], 2, ROLES)
