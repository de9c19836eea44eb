"""Many questions over one long document: the document is sent once, and every question's
prompt finds it in the radix tree.

    python examples/long_document_qa.py [--url http://127.0.0.1:30000] [--document FILE]
"""

import argparse

import radix_runtime as rr

DOCUMENT = """\
The Lighthouse of Varn stands on a granite cliff at the northern tip of the island of Orsa.
It was built in 1847 by the engineer Mira Castell, who designed its tower of white limestone
to be 38 metres tall. Its lamp first burned whale oil, was converted to kerosene in 1893 and
to electricity in 1931. The light flashes twice every ten seconds and can be seen from 22
nautical miles away. The last keeper, Tomas Ekberg, left in 1978, when the light was automated.
Today the keeper's cottage is a small museum that shows the original lens, made in Paris by
the Henry-Lepaute company, and a logbook recording 112 shipwrecks in the waters around Orsa.
The museum is open from May to September, and visitors climb 164 steps to the lantern room.
"""

QUESTIONS = [
    "Who built the lighthouse?",
    "In which year was the lighthouse built?",
    "How tall is the tower?",
    "When was the light electrified?",
    "How far away can the light be seen?",
    "Who was the last keeper?",
    "Where was the lens made?",
    "How many steps lead to the lantern room?",
]


@rr.function
def answer(s, document, question, max_tokens):
    s += rr.system("Answer questions about the document in one short sentence.")
    s += rr.user(f"Document:\n{document}\nQuestion: {question}")
    s += rr.assistant(rr.gen("answer", max_tokens=max_tokens, temperature=0, stop="\n"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: launch one on the default model)")
    parser.add_argument("--document", help="a text file (default: a short built-in one)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    document = DOCUMENT
    if args.document:
        with open(args.document) as f:
            document = f.read()
    batch = [
        {"document": document, "question": q, "max_tokens": args.max_tokens} for q in QUESTIONS
    ]
    with rr.RuntimeEndpoint(args.url) if args.url else rr.Runtime() as backend:
        # run_batch sends the prompt all questions share (system turn + document) once first
        states = answer.run_batch(batch, backend=backend, progress_bar=True)
        for question, state in zip(QUESTIONS, states):
            meta = state.get_meta_info("answer")
            print(f"Q: {question}\nA: {state['answer']}")
            print(f"   ({meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens cached)")


if __name__ == "__main__":
    main()
