"""bench/plot_sweep.py: which value of the swept flag each run had, and the plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench import plot_sweep  # noqa: E402

FLAG = "--chunked-prefill-size"


def test_split_flags():
    split = plot_sweep.split_flags
    assert split("--load-format dummy", FLAG) == (None, ("--load-format", "dummy"))
    assert split("--load-format dummy --chunked-prefill-size 512", FLAG) == (
        "512",
        ("--load-format", "dummy"),
    )
    assert split("--chunked-prefill-size=768 --enable-mixed-chunk", FLAG) == (
        "768",
        ("--enable-mixed-chunk",),
    )
    # --log-level never makes runs incomparable, with or without its value
    assert split("--log-level debug --load-format dummy", FLAG) == (
        None,
        ("--load-format", "dummy"),
    )


def run(tmp_path: Path, name: str, server_args: str, reported: int | None, ratio: float) -> str:
    server = {"chunked_prefill_size": reported} if reported is not None else {}
    result = {
        "config": {"server_args": server_args, "cache_on_server": server},
        "cache_on": {"ttft_p50_s": 0.1},
        "cache_off": {"ttft_p50_s": 0.1 * ratio},
        "ratios": {"ttft_p50_off_over_on": ratio, "output_tok_s_on_over_off": 2.5},
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(result))
    return str(path)


def test_value_of_each_run_and_incomparable_runs_left_out(tmp_path):
    paths = [
        run(tmp_path, "reported", "--load-format dummy", 1024, 9.0),  # the server said so
        run(tmp_path, "flag", "--load-format dummy --chunked-prefill-size 512", None, 7.5),
        run(tmp_path, "old_default", "--load-format dummy", None, 7.3) + "@2048",
        run(tmp_path, "default", "--load-format dummy", None, 9.5),
        run(tmp_path, "mixed", "--load-format dummy --enable-mixed-chunk", 1024, 3.0),
    ]
    runs = plot_sweep.load_runs(paths, FLAG, "1024")
    ratios = {x: [r["ratios"]["ttft_p50_off_over_on"] for r in rs] for x, rs in runs.items()}
    assert ratios == {512.0: [7.5], 1024.0: [9.0, 9.5], 2048.0: [7.3]}


def test_main_writes_the_plot(tmp_path, capsys):
    paths = [
        run(tmp_path, "a", "", 1024, 9.0),
        run(tmp_path, "b", "", 2048, 7.5),
        run(tmp_path, "c", "", 2048, 7.9),
    ]
    png = tmp_path / "sweep.png"
    assert plot_sweep.main([*paths, "--flag", "chunked-prefill-size", "--default", "1024",
                            "--out", str(png)]) == 0  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        "--chunked-prefill-size 2048: 2 run(s), TTFT p50 off/on 7.50, 7.90"
        in capsys.readouterr().out
    )
