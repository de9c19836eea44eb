"""An SGLang program, unchanged but for the import: role scopes, run-level sampling settings,
a batch, parallel branches joined back, and streaming.

    bash scripts/serve.sh &                     # the default model on http://127.0.0.1:30000
    python examples/sglang_style.py [--url http://127.0.0.1:30000] [--max-tokens 32]
"""

import argparse

import radix_runtime as sgl


@sgl.function
def multi_turn_question(s, question_1, question_2):
    with s.system():
        s += "You are a helpful assistant. Answer in one sentence."
    with s.user():
        s += question_1
    with s.assistant():
        s += sgl.gen("answer_1")
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2"))


@sgl.function
def tip_suggestion(s, topic):
    s += sgl.user(f"Give two short tips about {topic}.")
    with s.assistant():
        s += "Here are two tips:\n"
        forks = s.fork(2)  # both branches continue the open assistant turn, in parallel
        forks += lambda i: f"{i + 1}." + sgl.gen("tip", stop="\n") + "\n"
        forks.join(mode="concate_and_append")  # both tips become part of the answer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))
    sampling = {"temperature": 0, "max_new_tokens": args.max_tokens}

    state = multi_turn_question.run(
        question_1="What is the capital of France?",
        question_2="Name a famous museum there.",
        **sampling,
    )
    for m in state.messages():
        print(f"{m['role']}: {m['content']}")

    states = multi_turn_question.run_batch(
        [
            {"question_1": "What is 2 + 2?", "question_2": "And 3 + 3?"},
            {"question_1": "Who wrote Hamlet?", "question_2": "When?"},
        ],
        **sampling,
    )
    for s in states:
        print("batch:", s["answer_1"], "|", s["answer_2"])

    state = tip_suggestion.run(topic="sleep", **sampling)
    print("tips:", state.messages()[-1]["content"])

    print("streamed: ", end="")
    state = multi_turn_question(
        question_1="Say hello.", question_2="Say goodbye.", stream=True, **sampling
    )
    for piece in state.text_iter("answer_2"):
        print(piece, end="", flush=True)
    print()
    print("cache:", sgl.get_server_info()["cache"])


if __name__ == "__main__":
    main()
