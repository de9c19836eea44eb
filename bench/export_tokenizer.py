"""Write a tokenizer as a Hugging Face folder (tokenizer.json + tokenizer_config.json), so that a
machine without the embedded default model (the H200) can run dummy weights over a real
vocabulary: `--tokenizer DIR` on the server (bench/structured.py --server-args) and on
bench/grammar_host.py. Without it the dummy model's stand-in tokenizer has 259 tokens, which
makes a grammar's token mask trivially cheap.

    python bench/export_tokenizer.py [--source default] --out .bench_tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `radix_runtime` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def export(source: str, out: str) -> None:
    from radix_runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(source)
    os.makedirs(out, exist_ok=True)
    tokenizer.backend.save(os.path.join(out, "tokenizer.json"))
    config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--source", default="default", help="a tokenizer load_tokenizer reads")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    export(args.source, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
