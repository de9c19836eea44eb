"""The quantized CPU kernels (csrc/cpu_quant_kernels.cpp, worker/cpu_quant.py): each ISA path and
the torch twin against a plain-torch product of the dequantized weights; the paths bitwise equal
to each other; a row's result independent of the other rows and of the thread count."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from radix_runtime.worker import cpu_quant

EXT = cpu_quant.kernels()
needs_ext = pytest.mark.skipif(EXT is None, reason="the _cpu_decoder extension is not built")
ISAS = EXT.kernel_isas() if EXT is not None else []


def layer(kind: str, n: int, k: int, bias: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    lin = cpu_quant.Int4Linear(w, b, "asymmetric") if kind == "int4" else cpu_quant.Int8Linear(w, b)
    q, d, m = cpu_quant.unpack(lin.packed, lin.kind)
    weight = q.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    return lin, weight[:n, :k]


def inputs(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    """Rows with a few outlier channels (as a norm's output has)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, 3] *= 40
    x[:, k // 2] *= -25
    return x


@contextlib.contextmanager
def threads(n: int):
    """torch's intra-op threads (the kernels' at::parallel_for) set to `n` inside."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run(lin, x, isa=None, passes=None):
    args = (lin.packed, lin.kind, lin.out_features, lin.in_features, lin.bias, True)
    passes = lin.act_passes if passes is None else passes
    if isa == "torch":
        return cpu_quant.quant_linear_torch(x, *args, passes)
    EXT.set_kernel_isa(isa or ISAS[0])
    try:
        return EXT.quant_linear(x, *args, passes)
    finally:
        EXT.set_kernel_isa(ISAS[0])


# (kind, out_features, in_features): tiles and blocks with padding, the SmolLM2 shapes' kinds
SHAPES = [("int4", 96, 128), ("int4", 40, 64), ("int8", 100, 70), ("int8", 64, 576)]


@needs_ext
@pytest.mark.parametrize("kind,n,k", SHAPES)
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_matches_the_dequantized_product(kind, n, k, passes, dtype):
    lin, weight = layer(kind, n, k)
    x = inputs(5, k).to(dtype)
    ref = x.float() @ weight.T + lin.bias
    scale = ref.abs().max().item()
    outs = {isa: run(lin, x, isa, passes) for isa in [*ISAS, "torch"]}
    # one int8 pass rounds each value by up to 1/254 of its block's largest (an outlier channel's);
    # two passes by ~1/64516
    tol = 3e-2 if passes == 1 else 1e-4
    for isa, y in outs.items():
        assert y.dtype == torch.float32 and y.shape == (5, n)
        err = (y - ref).abs().max().item() / scale
        assert err < tol, (isa, err)
    first = outs[ISAS[0]]
    for isa in ISAS[1:]:
        assert torch.equal(outs[isa], first), isa  # the same bits on every ISA path
    torch.testing.assert_close(outs["torch"], first, rtol=1e-5, atol=1e-5 * scale)


@needs_ext
def test_two_passes_are_far_closer_than_one():
    lin, weight = layer("int4", 64, 256)
    x = inputs(3, 256)
    ref = x @ weight.T + lin.bias
    one = (run(lin, x, passes=1) - ref).abs().max()
    two = (run(lin, x, passes=2) - ref).abs().max()
    assert two < one / 20


@needs_ext
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_rows_result_does_not_depend_on_the_batch_or_threads(isa, kind):
    lin, _ = layer(kind, 160, 192)
    x = inputs(11, 192)
    together = run(lin, x, isa)
    alone = torch.cat([run(lin, x[i : i + 1], isa) for i in range(11)])
    assert torch.equal(together, alone)
    assert torch.equal(run(lin, x[3:9], isa), together[3:9])
    with threads(1):
        one = run(lin, x, isa)
    with threads(2):  # the output tiles split between two threads
        assert torch.equal(run(lin, x, isa), one)
    assert torch.equal(one, together)


@needs_ext
def test_the_module_output_dtype_and_strided_input():
    lin, _ = layer("int4", 48, 96)
    x = inputs(4, 96)
    assert lin(x).dtype == torch.float32
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    lin.float_out = True
    assert lin(x.bfloat16()).dtype == torch.float32
    wide = torch.zeros(4, 128)
    wide[:, :96] = x
    assert torch.equal(lin(wide[:, :96]), lin(x))
    with pytest.raises(RuntimeError, match="features"):
        lin(torch.zeros(2, 64))


def _in_subprocess(env: dict[str, str], code: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, **env}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_env_var_forces_the_torch_twin_or_a_path():
    code = (
        "import torch\nfrom radix_runtime.worker import cpu_quant as q\n"
        "lin = q.Int4Linear(torch.randn(32, 64), None, 'asymmetric')\n"
        "y = lin(torch.ones(2, 64))\n"
        "print(q.kernels() is None, tuple(y.shape))"
    )
    assert _in_subprocess({cpu_quant.KERNEL_ISA_ENV: "torch"}, code) == "True (2, 32)"
    if EXT is not None:
        code = "from radix_runtime.worker import cpu_quant as q; print(q.kernels().kernel_isa())"
        assert _in_subprocess({cpu_quant.KERNEL_ISA_ENV: "scalar"}, code) == "scalar"


@needs_ext
@pytest.mark.parametrize(
    "kind,n,k", [("int4", 96, 128), ("int8", 100, 70), ("int4", 40, 1536), ("int4", 88, 64)]
)
@pytest.mark.parametrize("rows", [4, 64, 257, 600])
def test_many_rows_match_single_rows_and_every_path(kind, n, k, rows):
    """The many-rows path (weights unpacked once per work item; passes of two tiles x 6 quantized
    rows, an odd last tile (n=100, n=40) one tile x 8; equal chunks of at most 1020 quantized
    rows: 600 rows are two of 600): the same bits as one row at a time, as the scalar path and as
    one thread. A two-pass float32 call's full pairs of tiles write y from the kernel; a pair with a
    partial tile (n=88: 16 + 8 columns), a one-pass call and bfloat16 output go through the emit."""
    lin, weight = layer(kind, n, k)
    x = inputs(rows, k)
    x[rows // 2] = 0  # every block's scale 0 (the reciprocal taken as 0)
    x[rows - 1, :32] = 0
    many = run(lin, x)
    alone = torch.cat([run(lin, x[i : i + 1]) for i in range(0, rows, 37)])
    assert torch.equal(many[::37], alone)
    one = run(lin, x, passes=1)
    assert torch.equal(
        one[::37], torch.cat([run(lin, x[i : i + 1], passes=1) for i in range(0, rows, 37)])
    )
    for isa in ISAS[1:]:
        assert torch.equal(run(lin, x, isa), many), isa
    for n in (1, 2):
        with threads(n):
            assert torch.equal(run(lin, x), many), n
    bf = x.bfloat16()
    assert torch.equal(run(lin, bf), torch.cat([run(lin, bf[i : i + 1]) for i in range(rows)]))
    ref = x @ weight.T + lin.bias
    assert (many - ref).abs().max() < 1e-4 * ref.abs().max()


@needs_ext
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_no_rows_give_an_empty_output(kind):
    """An LM head over a step that samples nothing gets no rows; the tile split's grain is then
    not computed (it divides by the row count: SIGFPE in a module built with OpenMP)."""
    lin, _ = layer(kind, 48, 96)
    for n in (1, 2):
        with threads(n):
            assert lin(torch.zeros(0, 96)).shape == (0, 48)
            assert lin(torch.zeros(2, 0, 96).bfloat16()).dtype == torch.bfloat16
            assert lin(torch.zeros(2, 0, 96)).shape == (2, 0, 48)


@needs_ext
@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and torch.backends.openmp.is_available()),
    reason="the module is built with OpenMP where torch runs its threads on it (setup.py)",
)
def test_the_kernels_run_on_every_intra_op_thread():
    """ATen's at::parallel_for is inline: it runs on torch's threads only in a module compiled with
    OpenMP (setup.py's -fopenmp); without it every kernel loop ran on one thread."""
    with threads(2):
        assert EXT.parallel_threads(8) == 2
    with threads(1):
        assert EXT.parallel_threads(8) == 1
