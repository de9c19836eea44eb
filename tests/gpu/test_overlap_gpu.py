"""launch / collect on the GPU (the overlap schedule's worker half): steps launched with
`from_last_sample` rows before the previous one is collected, through the decode and the
prefill/mixed CUDA graphs (which must read those ids from the device), equal synchronous
forwards. (tests/unit/test_overlap_runner.py checks the same logic on the CPU.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("flashinfer")

from gpu_support import cuda_runner  # noqa: E402
from overlap_steps import RELEASE, first_step, second_step, third_step, tokens_of  # noqa: E402


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_launch_ahead_equals_synchronous_forwards(graphs):
    runner = cuda_runner(page_size=4, disable_cuda_graph=not graphs)
    r1 = runner.forward(first_step())
    r2 = runner.forward(second_step(tokens_of(r1)))
    r3 = runner.forward(third_step(tokens_of(r2)))
    runner.forward(RELEASE)
    pending = [runner.launch(b) for b in (first_step(), second_step(None), third_step(None))]
    got = [runner.collect(p) for p in pending]
    runner.forward(RELEASE)
    for g, r in zip(got, (r1, r2, r3)):
        assert [x.next_id for x in g.results] == [x.next_id for x in r.results]
        for a, b in zip(g.results, r.results):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert a.top_ids == b.top_ids


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_launch_never_waits_for_the_device(graphs):
    """launch() must queue a step without a host-device sync (a blocking copy, an .item(), a
    pageable upload...), or the overlap schedule silently runs one step at a time again:
    CUDA's sync debug mode turns any such sync inside launch into an error."""
    runner = cuda_runner(page_size=4, disable_cuda_graph=not graphs)
    for watch in (False, True):  # the first round warms up (Triton compiles, allocations)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if watch else "default")
        try:
            pending = [
                runner.launch(b) for b in (first_step(), second_step(None), third_step(None))
            ]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for p in pending:
            runner.collect(p)
        runner.forward(RELEASE)
