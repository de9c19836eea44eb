"""Tensor-parallel ranks for the equivalence tests: `python tests/tp_support.py RANK SIZE INIT OUT
MODEL...` runs one rank (a real ModelRunner holding its share of each MODEL, joined to the other
ranks by torch.distributed) through the overlap-schedule steps of tests/overlap_steps.py, and
rank 0 saves what it returned (results and logits) to OUT; `run_steps` is the same with --tp 1 in
the test's own process (tests/unit/test_tensor_parallel.py on the CPU with gloo,
tests/gpu/test_tensor_parallel_gpu.py on 2 GPUs with NCCL and CUDA graphs).

MODEL is `dummy:<config name>` or an HF folder. The ranks' device and dtype come from
TP_TEST_DEVICE (cpu) and TP_TEST_DTYPE (auto).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from overlap_steps import RELEASE, first_step, second_step, third_step  # noqa: E402

from radix_runtime import messages as m  # noqa: E402
from radix_runtime.config import ServerArgs  # noqa: E402


def runner_args(model: str, device: str, tp: int, dtype: str = "auto") -> ServerArgs:
    common = dict(device=device, dtype=dtype, max_total_tokens=1024, max_running_requests=8,
                  page_size=4, tp=tp, cuda_graph_max_bs=8)  # fmt: skip
    if model.startswith("dummy:"):
        name = model.removeprefix("dummy:")
        return ServerArgs(model=name, load_format="dummy", model_config=name, **common)
    return ServerArgs(model=model, **common)


def run_steps(runner) -> dict:
    """Three steps launched ahead of their collection (the decodes feed the token sampled on
    the device), then the first again for its logits."""
    runner.forward(RELEASE)
    pending = [runner.launch(s) for s in (first_step(), second_step(None), third_step(None))]
    results = [runner.collect(p) for p in pending]
    runner.forward(RELEASE)
    _, logits = runner.forward_with_logits(first_step())
    runner.forward(RELEASE)
    return {
        "results": [m.encode(m.ForwardResult(step=r.step, results=r.results)) for r in results],
        "logits": [None if x is None else x.float().cpu() for x in logits],
        "num_pages": runner.kv_pool.num_pages,
        "kv_heads": runner.config.num_kv_heads,
        "cuda_graphs": runner.cuda_graphs is not None,
    }


def run_ranks(models: list[str], tmp_dir, size: int = 2, env: dict | None = None) -> dict:
    """Rank 0's `run_steps` per model, from `size` rank processes (killed if they hang)."""
    import subprocess

    out, init = os.path.join(tmp_dir, "rank0.pt"), f"file://{os.path.join(tmp_dir, 'rdzv')}"
    cmd = [sys.executable, os.path.abspath(__file__)]
    env = {**os.environ, **(env or {})}
    procs = [
        subprocess.Popen([*cmd, str(r), str(size), init, out, *models], env=env)
        for r in range(size)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * size, f"rank exit codes {codes}"
    return torch.load(out, weights_only=False)


def main() -> None:
    rank, size, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from radix_runtime.worker.distributed import TPRank
    from radix_runtime.worker.model_runner import ModelRunner

    device = os.environ.get("TP_TEST_DEVICE", "cpu")
    dtype = os.environ.get("TP_TEST_DTYPE", "auto")
    tp = TPRank(rank=rank, size=size, local_rank=rank, init_method=init)
    got = {}
    for model in sys.argv[5:]:
        args = runner_args(model, device, size, dtype)
        runner = ModelRunner(args, tp=tp)
        got[model] = run_steps(runner)
        del runner
        if device == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        torch.save(got, out)
    tp.leave()


if __name__ == "__main__":
    main()
