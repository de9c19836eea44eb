"""Tool calling with the official OpenAI client: the model is offered a function, calls it (forced
with tool_choice="required", whose JSON schema the server enforces), the program runs it, and the
result goes back as a tool message for the final answer.

    bash scripts/serve.sh &
    python examples/tool_calling.py [--url http://127.0.0.1:30000]
"""

import argparse
import json

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 32},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    }
]


def get_weather(city: str, unit: str) -> str:
    return json.dumps(
        {"city": city, "temperature": 18 if unit == "celsius" else 64, "sky": "sunny"}
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url + "/v1", api_key="unused")
    model = client.models.list().data[0].id

    messages = [{"role": "user", "content": "What is the weather like in Paris?"}]
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the schema allows a list of exactly one
        temperature=0,
        max_tokens=64,
    )
    message = reply.choices[0].message
    print("finish_reason:", reply.choices[0].finish_reason)
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        args_ = json.loads(call.function.arguments)
        print(f"call: {call.function.name}({args_})")
        result = get_weather(**args_)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    final = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=args.max_tokens
    )
    print("answer:", final.choices[0].message.content)


if __name__ == "__main__":
    main()
