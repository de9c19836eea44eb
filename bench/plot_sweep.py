"""Plot a sweep of one server flag from several bench/multi_turn_chat.py results.

Each JSON is one run. The flag's value is what the run's cache-on server reported (the bench
records the scheduling settings), else what its `--server-args` set, else the
value given after the file name (`run.json@2048`: for older runs that left the flag at a default
which has changed since), else `--default`. Left: TTFT p50 with the cache on and off against the value
(every run a dot, the median of the runs at a value joined by a line). Right: the two ratios the
benchmark's goals are about, TTFT p50 off/on and output tok/s on/off.

    python bench/plot_sweep.py --flag chunked-prefill-size --default 1024 \
        run1.json run2.json old_run.json@2048 ... --out sweep.png

Runs whose server flags differ in anything but the swept flag and `--log-level` are left out
(named on stderr), so that the plot compares like with like.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

IGNORED_FLAGS = ("--log-level",)


def split_flags(server_args: str, flag: str) -> tuple[str | None, tuple[str, ...]]:
    """(the value of `flag`, the other flags but IGNORED_FLAGS) of a run's --server-args."""
    words = shlex.split(server_args)
    value, rest, i = None, [], 0
    while i < len(words):
        word = words[i]
        name, eq, inline = word.partition("=")
        takes_value = i + 1 < len(words) and not words[i + 1].startswith("--")
        if name == flag:
            value = inline if eq else words[i + 1]
            i += 1 if eq else 2
        elif name in IGNORED_FLAGS:
            i += 1 if eq or not takes_value else 2
        else:
            rest.append(word)
            i += 1
    return value, tuple(rest)


def load_runs(paths: list[str], flag: str, default: str) -> dict[float, list[dict]]:
    """value -> results, keeping only runs whose other flags match the first run's."""
    runs: dict[float, list[dict]] = defaultdict(list)
    base = None
    for arg in paths:
        path, _, stated = arg.partition("@")
        result = json.loads(Path(path).read_text())
        if result.get("cache_off") is None:
            print(f"skipped {path}: no cache-off run", file=sys.stderr)
            continue
        value, rest = split_flags(result["config"].get("server_args", ""), flag)
        base = rest if base is None else base
        if rest != base:
            print(f"skipped {path}: other flags {list(rest)} (want {list(base)})", file=sys.stderr)
            continue
        reported = (result["config"].get("cache_on_server") or {}).get(flag[2:].replace("-", "_"))
        for candidate in (reported, value, stated or None, default):
            if candidate is not None:
                runs[float(candidate)].append(result)
                break
    return dict(sorted(runs.items()))


def plot(runs: dict[float, list[dict]], flag: str, default: str, path: str) -> None:
    plt = common.pyplot()
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = list(runs)
    series = {
        "cache on": (ax_t, "tab:blue", lambda r: r["cache_on"]["ttft_p50_s"] * 1e3),
        "cache off": (ax_t, "tab:red", lambda r: r["cache_off"]["ttft_p50_s"] * 1e3),
        "TTFT p50 off/on": (ax_r, "tab:purple", lambda r: r["ratios"]["ttft_p50_off_over_on"]),
        "output tok/s on/off": (
            ax_r,
            "tab:green",
            lambda r: r["ratios"]["output_tok_s_on_over_off"],
        ),
    }
    for label, (ax, color, get) in series.items():
        for x in xs:
            ys = [get(r) for r in runs[x]]
            ax.plot([x] * len(ys), ys, "o", color=color, alpha=0.5)
        medians = [float(np.median([get(r) for r in runs[x]])) for x in xs]
        ax.plot(xs, medians, "-", color=color, label=label)
    name = flag.lstrip("-")
    for ax in (ax_t, ax_r):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x:g}" + (" (default)" if f"{x:g}" == default else "") for x in xs])
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    ax_t.set_ylabel("TTFT p50 (ms)")
    ax_t.set_yscale("log")
    ax_t.set_title("multi-turn chat: time to first token")
    ax_r.set_ylabel("ratio")
    ax_r.set_ylim(bottom=0)
    ax_r.set_title("the benchmark's ratios (dots: runs; lines: medians)")
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("results", nargs="+", help="bench/multi_turn_chat.py JSON files")
    p.add_argument("--flag", required=True, help="the swept server flag, e.g. chunked-prefill-size")
    p.add_argument("--default", required=True, help="its value in runs that did not set it")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    args.flag = "--" + args.flag.lstrip("-")
    runs = load_runs(args.results, args.flag, args.default)
    if not runs:
        print("no runs to plot", file=sys.stderr)
        return 1
    for x, results in runs.items():
        ratios = ", ".join(f"{r['ratios']['ttft_p50_off_over_on']:.2f}" for r in results)
        print(f"{args.flag} {x:g}: {len(results)} run(s), TTFT p50 off/on {ratios}")
    plot(runs, args.flag, args.default, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
