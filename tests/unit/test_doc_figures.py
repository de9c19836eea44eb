"""docs/ quote results files by key (bench/doc_figures.py); these tests keep the two in step and
check that every results file carries its provenance."""

from __future__ import annotations

import json
import re

import pytest

from bench import doc_figures
from bench.doc_figures import RESULTS, Figure, check, find_figures, lookup

PROVENANCE_KEYS = ("commit", "date", "machine", "command", "server_flags", "ceiling")


def test_every_quoted_figure_matches_its_results_file():
    figures = doc_figures.all_figures()
    assert len(figures) > 100  # the docs do quote their numbers
    problems = [f"{f.where}: {check(f)[1]}" for f in figures if check(f)[1]]
    assert not problems, "\n".join(problems)


def test_a_figure_that_disagrees_with_its_json_is_reported():
    mt = doc_figures.load_result("h200_multi_turn.json")
    ratio, ttft_ms = mt["ratios"]["ttft_p50_off_over_on"], mt["cache_on"]["ttft_p50_s"] * 1e3
    tok_s = mt["cache_on"]["output_tok_s"] + 40  # not what the file says
    text = (
        f"ratio {ratio:.2f}<!-- fig h200_multi_turn.json#ratios.ttft_p50_off_over_on --> and "
        f"{tok_s:,.0f}<!-- fig h200_multi_turn.json#cache_on.output_tok_s --> tok/s, "
        f"{ttft_ms:.0f}<!-- fig h200_multi_turn.json#cache_on.ttft_p50_s x1000 --> ms, "
        "174<!-- fig h200_gpu_worker.json#decode_bs1_tok_s --> tok/s, "
        "1.0<!-- fig h200_multi_turn.json#no_such_key -->, "
        "1<!-- fig no_such_file.json#x -->"
    )
    figures = find_figures(text)
    assert [f.quoted for f in figures] == [
        f"{ratio:.2f}",
        f"{tok_s:,.0f}",
        f"{ttft_ms:.0f}",
        "174",
        "1.0",
        "1",
    ]
    results = [check(f)[1] for f in figures]
    assert results[0] is None and results[2] is None
    assert f"quotes {tok_s:,.0f}" in results[1]
    assert "quotes 174" in results[3]  # the JSON says 241
    assert "no key" in results[4]
    assert "no docs/results/no_such_file.json" in results[5]


def test_rounding_follows_the_precision_written():
    def fig(quoted: str) -> Figure:
        return Figure("t", 1, quoted, "h200_gpu_worker.json", "decode_bs1_roofline_fraction", 1.0)

    value = lookup(doc_figures.load_result("h200_gpu_worker.json"), "decode_bs1_roofline_fraction")
    assert check(fig(f"{value:.3f}"))[1] is None
    assert check(fig(f"{value:.2f}"))[1] is None
    assert check(fig(f"{value + 0.001:.3f}"))[1] is not None
    assert check(fig(f"{value + 0.2:.1f}"))[1] is not None  # one decimal, 0.15+ off


def test_the_number_checked_is_the_last_one_before_its_marker():
    text = "4.15 ms = 241<!-- fig a.json#x --> tok/s, then 3.62<!-- fig a.json#y -->"
    assert [f.quoted for f in find_figures(text)] == ["241", "3.62"]
    assert find_figures("no number <!-- fig a.json#x -->")[0].quoted == ""


def test_lookup_walks_dicts_lists_and_selectors():
    data = {"rows": [{"op": "a", "tokens": 1, "v": 3}, {"op": "a", "tokens": 2, "v": 4}]}
    assert lookup(data, "rows.1.v") == 4
    assert lookup(data, "rows.op=a,tokens=2.v") == 4
    with pytest.raises(KeyError):
        lookup(data, "rows.op=a.v")  # two elements match: ambiguous
    with pytest.raises(KeyError):
        lookup(data, "cols")


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_results_file_records_its_provenance(path):
    provenance = json.loads(path.read_text()).get("provenance")
    assert isinstance(provenance, dict), f"{path.name} has no provenance block"
    missing = [k for k in PROVENANCE_KEYS if k not in provenance]
    assert not missing, f"{path.name}: provenance lacks {missing}"
    assert provenance["commit"] and provenance["date"] and provenance["command"]
    machine = provenance["machine"]
    assert "gpu" in machine and machine.get("cpu_model"), f"{path.name}: machine {machine}"
    if provenance.get("reconstructed"):
        assert "reconstructed" in provenance.get("provenance", "")


def test_every_results_file_is_cited_by_the_docs():
    docs = "".join(p.read_text() for p in doc_figures.doc_files())
    orphans = [p.name for p in sorted(RESULTS.iterdir()) if p.name not in docs]
    assert not orphans, f"results no doc cites (delete them; git keeps them): {orphans}"


# the order work was done in lives in git, not in the manual
CHRONOLOGY = re.compile(
    r"session [0-9]|(first|last|final) (gpu |h200 )call\b|(first|last|final) call of|"
    r"call [0-9]+ of|"
    r"\bwas [0-9][0-9,.]* until\b|\bwork period [0-9]",
    re.IGNORECASE,
)


def test_the_docs_tell_no_chronology():
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for path in doc_figures.doc_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if CHRONOLOGY.search(line)
    ]
    assert not hits, "\n".join(hits)
