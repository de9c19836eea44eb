"""The transport-neutral front: what a request means, independent of how it arrived.

    schemas.py     request bodies (msgspec Structs) and their decoding
    validation.py  checks against the model's limits -> normalized values or ApiError (a 400)
    builders.py    route -> inputs: a request becomes GenerateInputs + the renderer that answers
    contract.py    GenerateInput / GenerateChunk / ChoiceState: the TokenizerManager's contract
    generations.py drives one request's generations through the TokenizerManager
    rendering.py   accumulated state -> the JSON of each route (OpenAI chat, completions, native)
    tools.py       tool calling: the tools a request offers, their prompt, parsing replies
    tenancy.py     API keys, tenants and the radix tree namespace of a request
    errors.py      ApiError / GenerationError and the OpenAI error body

The HTTP server (server/http_server.py) and the offline ``Engine`` (engine.py) both use it;
nothing here imports FastAPI or anything from ``radix_runtime.server``.
"""
