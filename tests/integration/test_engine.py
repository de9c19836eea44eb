"""The offline Engine: the same scheduler and worker processes, no HTTP."""

from __future__ import annotations

import psutil
import pytest

from radix_runtime import Engine

pytestmark = pytest.mark.slow


def test_engine_generate_batch_ids_errors_and_shutdown():
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. a shared server
    engine = Engine(max_total_tokens=4096, max_running_requests=8)
    children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    titles = {" ".join(c.cmdline()) for c in children}
    assert any("radix_runtime::scheduler" in t for t in titles), titles
    assert any("radix_runtime::worker" in t for t in titles), titles
    try:
        greedy = {"max_new_tokens": 6, "temperature": 0}
        one = engine.generate("The capital of France is", greedy)
        assert "Paris" in one["text"]
        batch = engine.generate(["The capital of France is", "The capital of France is"], greedy)
        assert [b["text"] for b in batch] == [one["text"]] * 2
        # the repeated prompt was served from the radix tree
        assert batch[1]["meta_info"]["cached_tokens"] >= one["meta_info"]["prompt_tokens"] - 1
        by_ids = engine.generate(input_ids=one["output_ids"][:2], sampling_params=greedy)
        assert by_ids["meta_info"]["prompt_tokens"] == 2
        with pytest.raises(ValueError, match="temperature"):
            engine.generate("hi", {"temperature": -1})
        cache = engine.server_info()["cache"]
        assert cache["free_pages"] + cache["evictable_pages"] == cache["total_pages"]
    finally:
        engine.shutdown()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
