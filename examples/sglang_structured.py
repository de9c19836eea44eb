"""Structured generation with SGLang's constructs: typed gens, a regex-shaped JSON record, and a
JSON schema; the server's grammar masks the model's choices so every output parses.

    bash scripts/serve.sh &
    python examples/sglang_structured.py [--url http://127.0.0.1:30000]
"""

import argparse
import json

import radix_runtime as sgl

CITY_REGEX = (
    r"""\{\n"""
    r"""  "name": "[\w\d\s]{1,16}",\n"""
    r"""  "country": "[\w\d\s]{1,16}",\n"""
    r"""  "population": [0-9]{1,9}\n"""
    r"""\}"""
)

BOOK_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "genres": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["title", "year", "genres"],
}


@sgl.function
def city_facts(s, city):
    s += sgl.user(f"Describe {city} as JSON.")
    s += sgl.assistant(sgl.gen("json", max_tokens=64, regex=CITY_REGEX))


@sgl.function
def book(s):
    s += sgl.user("Recommend a classic novel as JSON.")
    s += sgl.assistant(sgl.gen("book", max_tokens=96, json_schema=json.dumps(BOOK_SCHEMA)))


@sgl.function
def quiz(s):
    s += sgl.user("How many legs does a spider have? Answer with a number.")
    s += sgl.assistant(sgl.gen_int("legs", 4))
    s += sgl.user("Is the Earth round? Answer True or False.")
    s += sgl.assistant(sgl.gen("round", max_tokens=3, dtype=bool))
    s += sgl.user("What is pi to two decimals?")
    s += sgl.assistant(sgl.gen("pi", max_tokens=8, dtype=float))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))

    state = city_facts.run(city="Paris", temperature=0)
    print("city:", json.loads(state["json"]))
    state = book.run(temperature=0)
    print("book:", json.loads(state["book"]))
    state = quiz.run(temperature=0)
    print("legs:", int(state["legs"]), "round:", state["round"], "pi:", float(state["pi"]))


if __name__ == "__main__":
    main()
