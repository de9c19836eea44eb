"""Fork/join: explain two tips in parallel branches that share the conversation so far, then
join their answers into one summary.

    python examples/fork_join.py [--url http://127.0.0.1:30000] [--max-tokens 48]
"""

import argparse

import radix_runtime as rr

TIPS = ["Eat a balanced diet", "Exercise regularly"]


@rr.function
def tips(s, topic, max_tokens):
    s += rr.system("You are a helpful assistant.")
    s += rr.user(f"Give {len(TIPS)} short tips for {topic}.")
    s += rr.assistant("\n".join(f"{i + 1}. {tip}." for i, tip in enumerate(TIPS)))
    # every branch starts from the conversation above, which is sent to the server once
    branches = s.fork(len(TIPS))
    for tip, branch in zip(TIPS, branches):
        branch += rr.user(f"Why should I {tip.lower()}? Answer in one sentence.")
        branch += rr.assistant(rr.gen("detail", max_tokens=max_tokens, temperature=0))
    details = [branch["detail"] for branch in branches]  # join: waits for every branch
    s += rr.user("Summarize these reasons in one sentence:\n" + "\n".join(details))
    s += rr.assistant(rr.gen("summary", max_tokens=max_tokens, temperature=0))
    return details


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: launch one on the default model)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    with rr.RuntimeEndpoint(args.url) if args.url else rr.Runtime() as backend:
        state = tips.run(topic="staying healthy", max_tokens=args.max_tokens, backend=backend)
        for tip, detail in zip(TIPS, state.ret_value):
            print(f"{tip}: {detail}")
        print(f"Summary: {state['summary']}")


if __name__ == "__main__":
    main()
