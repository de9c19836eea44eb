"""lm-evaluation-harness's `local-completions` model against the real server: a tiny
multiple-choice task from a local YAML + JSONL file, scored by log-likelihood through
/v1/completions with echo and logprobs (the tokenizer comes from the server's /tokenize). The
accuracy it reports must equal the one computed here from /generate's prompt logprobs directly.

lm_eval is an optional dependency (`pip install -e .[eval]`: about 4 minutes and ~0.5 GB with
datasets, pandas, pyarrow, scipy, scikit-learn, ...): without it this test is skipped (the
reason is printed). It takes about a minute, most of it importing lm_eval.
"""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.slow

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "banana", "seven"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["purple", "four", "Tuesday"], "answer": 1},
    {"question": "The sky on a clear day is", "choices": ["loud", "square", "blue"], "answer": 2},
    {
        "question": "Water freezes at zero degrees",
        "choices": ["Celsius", "cats", "up"],
        "answer": 0,
    },
    {"question": "A week has seven", "choices": ["apples", "days", "doors"], "answer": 1},
    {"question": "The opposite of hot is", "choices": ["cold", "green", "fast"], "answer": 0},
    # mislabelled on purpose: the model's choice is not the gold one, so the accuracy is not 1
    {"question": "The color of fresh grass is", "choices": ["green", "loud"], "answer": 1},
    {"question": "One plus one equals", "choices": ["two", "pencil"], "answer": 1},
]

TASK = """\
task: rr_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _loglikelihood(client, context: str, continuation: str) -> float:
    """log P(continuation | context) from /generate's prompt logprobs, tokenized as lm_eval does
    (the whole string, the context's tokens first; trailing spaces move to the continuation)."""
    while context.endswith(" "):
        context, continuation = context[:-1], " " + continuation

    def tokenize(text: str) -> list[int]:
        resp = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        return resp.json()["tokens"]

    whole, ctx = tokenize(context + continuation), tokenize(context)
    body = {
        "input_ids": whole,
        "return_logprob": True,
        "logprob_start_len": len(ctx),
        "sampling_params": {"max_new_tokens": 0},
    }
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    values = [lp for lp, _ in resp.json()["meta_info"]["input_token_logprobs"]]
    return float(sum(values))


def test_lm_eval_local_completions_accuracy_matches_generate(default_server, tmp_path, monkeypatch):
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        msg = f"lm_eval is not installed ({exc}); install the [eval] extra to run this test"
        print(msg)
        pytest.skip(msg)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "rr_tiny_mc.yaml").write_text(TASK.format(data=data))

    with default_server.client() as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        expected = []
        for doc in DOCS:
            scores = [_loglikelihood(c, doc["question"], " " + ch) for ch in doc["choices"]]
            expected.append((scores, int(max(range(len(scores)), key=scores.__getitem__))))
    reference_acc = sum(best == d["answer"] for (_, best), d in zip(expected, DOCS)) / len(DOCS)
    assert 0 < reference_acc < 1, expected  # a score both ways of computing it could get wrong

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{default_server.url}/v1/completions",
            "model": model,
            "tokenizer_backend": "remote",
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=["rr_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )
    acc = results["results"]["rr_tiny_mc"]["acc,none"]
    print(f"lm_eval acc {acc}, from /generate {reference_acc}")
    assert acc == pytest.approx(reference_acc)
    # and per choice, the log-likelihoods it read equal /generate's
    for sample in results["samples"]["rr_tiny_mc"]:
        want, _ = expected[sample["doc_id"]]
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(want, abs=1e-3), (sample["doc"], got, want)
        assert all(math.isfinite(v) for v in got)
