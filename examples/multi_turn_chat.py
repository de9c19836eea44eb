"""Multi-turn chat: every turn's prompt is the whole conversation so far, which the radix tree
already holds (prompt *and* answers), so only the new question is computed.

    python examples/multi_turn_chat.py [--url http://127.0.0.1:30000] [--max-tokens 48]
"""

import argparse

import radix_runtime as rr


@rr.function
def chat(s, questions, max_tokens):
    s += rr.system("You are a helpful assistant. Answer in one or two sentences.")
    for i, question in enumerate(questions):
        s += rr.user(question)
        s += rr.assistant(rr.gen(f"answer{i}", max_tokens=max_tokens, temperature=0))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: launch one on the default model)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    questions = [
        "What is the capital of France?",
        "What is a famous landmark there?",
        "How tall is it?",
    ]
    with rr.RuntimeEndpoint(args.url) if args.url else rr.Runtime() as backend:
        state = chat.run(questions=questions, max_tokens=args.max_tokens, backend=backend)
        for i, question in enumerate(questions):
            meta = state.get_meta_info(f"answer{i}")
            print(f"User: {question}")
            print(f"Assistant: {state[f'answer{i}']}")
            print(f"  ({meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens cached)")


if __name__ == "__main__":
    main()
