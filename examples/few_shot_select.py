"""Few-shot classification with `select`: the model scores each label after the same few-shot
prompt, which is computed once and shared by every label and every review.

    python examples/few_shot_select.py [--url http://127.0.0.1:30000]
"""

import argparse

import radix_runtime as rr

EXAMPLES = [
    ("The food was cold and the waiter was rude.", "negative"),
    ("Absolutely loved it, I will come back!", "positive"),
    ("Terrible sound, the screen broke after a week.", "negative"),
    ("A delightful film with a wonderful cast.", "positive"),
]
LABELS = ["positive", "negative"]


@rr.function
def classify(s, review):
    s += "Classify the sentiment of each review as positive or negative.\n\n"
    for text, label in EXAMPLES:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment: " + rr.select("label", choices=LABELS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: launch one on the default model)")
    parser.add_argument("--max-tokens", type=int, help="unused (select generates nothing)")
    args = parser.parse_args()

    reviews = [
        "The best pizza I have had in years.",
        "It stopped working after two days. Waste of money.",
        "Friendly staff and a great view.",
        "Boring plot and wooden acting.",
    ]
    with rr.RuntimeEndpoint(args.url) if args.url else rr.Runtime() as backend:
        states = classify.run_batch([{"review": r} for r in reviews], backend=backend)
        for review, state in zip(reviews, states):
            scores = state.get_meta_info("label")["normalized_logprobs"]
            shown = ", ".join(f"{c}={v:.2f}" for c, v in zip(LABELS, scores))
            print(f"{state['label']:>8}  {review}  ({shown})")


if __name__ == "__main__":
    main()
