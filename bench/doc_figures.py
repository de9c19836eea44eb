"""Check that every figure docs/ quotes from a results file matches that file.

A figure in docs/*.md (or README.md) names its source with an HTML comment right after it:

    TTFT p50 102 ms<!-- fig h200_multi_turn.json#cache_on.ttft_p50_s x1000 -->

- ``FILE`` is a file in docs/results/;
- ``PATH`` walks the JSON with dots: a dict key, a list index (``cache_on.0.hit_rate``), or a
  list element chosen by its fields (``rows.op=store_kv,tokens=1,mode=graph.triton``);
- ``xSCALE`` (optional) multiplies the JSON value before the comparison (``x1000``: s -> ms).

The checked figure is the last number before the marker on its line (after the previous marker,
if any); thousands separators are allowed (``3,776``). It matches when the JSON value, scaled,
rounds to it at the figure's own precision (``0.859`` within 0.0005, ``241`` within 0.5). The
comment does not render, so the docs read as plain numbers.

    python bench/doc_figures.py            # check docs/ and README.md; exit 1 on a mismatch
    python bench/doc_figures.py --list     # every quoted figure with its JSON value
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "docs" / "results"

MARKER = re.compile(
    r"<!--\s*fig\s+(?P<file>[\w.+-]+\.json)#(?P<path>\S+?)(?:\s+x(?P<scale>[\d.eE+-]+))?\s*-->"
)
NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Figure:
    doc: str
    line: int
    quoted: str  # the number as written, '' when the line has none before the marker
    file: str
    path: str
    scale: float

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def find_figures(text: str, doc: str = "<text>") -> list[Figure]:
    """Every marker of `text` with the number it refers to."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        start = 0
        for m in MARKER.finditer(line):
            numbers = NUMBER.findall(line[start : m.start()])
            scale = float(m.group("scale")) if m.group("scale") else 1.0
            quoted = numbers[-1] if numbers else ""
            out.append(Figure(doc, lineno, quoted, m.group("file"), m.group("path"), scale))
            start = m.end()
    return out


@cache
def load_result(file: str) -> object:
    with open(RESULTS / file) as f:
        return json.load(f)


def lookup(data: object, path: str) -> object:
    """The value at a dotted `path` (see the module docstring); KeyError when there is none."""
    node = data
    for part in path.split("."):
        if isinstance(node, list):
            if "=" in part:
                conditions = dict(c.split("=", 1) for c in part.split(","))
                matches = [
                    e
                    for e in node
                    if isinstance(e, dict)
                    and all(str(e.get(k)) == v for k, v in conditions.items())
                ]
                if len(matches) != 1:
                    raise KeyError(f"{part!r} selects {len(matches)} elements, not one")
                node = matches[0]
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if part not in node:
                raise KeyError(f"no key {part!r}")
            node = node[part]
        else:
            raise KeyError(f"{part!r}: not a dict or list")
    return node


def matches(quoted: str, value: float) -> bool:
    """Whether `value` rounds to the figure as written, at the figure's precision."""
    digits = quoted.replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return abs(value - float(digits)) <= 0.5 * 10**-decimals * (1 + 1e-9) + 1e-12


def check(figure: Figure) -> tuple[float | None, str | None]:
    """(the scaled JSON value, None) when the figure matches, else (value or None, the problem)."""
    if not figure.quoted:
        return None, "no number before the marker"
    try:
        value = lookup(load_result(figure.file), figure.path)
    except FileNotFoundError:
        return None, f"no docs/results/{figure.file}"
    except (KeyError, IndexError, ValueError) as exc:
        return None, f"{figure.file}#{figure.path}: {exc}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, f"{figure.file}#{figure.path} is {value!r}, not a number"
    scaled = value * figure.scale
    if not matches(figure.quoted, scaled):
        return scaled, f"quotes {figure.quoted}, {figure.file}#{figure.path} gives {scaled:.6g}"
    return scaled, None


def doc_files(root: Path = REPO_ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def all_figures(root: Path = REPO_ROOT) -> list[Figure]:
    out = []
    for path in doc_files(root):
        out += find_figures(path.read_text(), str(path.relative_to(root)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print every figure, not only mismatches")
    args = p.parse_args()
    figures = all_figures()
    bad = 0
    for fig in figures:
        value, problem = check(fig)
        if problem:
            bad += 1
            print(f"{fig.where}: {problem}")
        elif args.list:
            print(f"{fig.where}: {fig.quoted} = {fig.file}#{fig.path} ({value:.6g})")
    print(f"{len(figures)} figures, {bad} mismatched", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
