"""The architecture registry: ModelConfig.architecture -> the model class that implements it.

model_config.py decides the family from a config.json's `architectures` (or `model_type`) and
gguf_format.py from a GGUF's `general.architecture`, refusing what no class here implements;
the loader builds whatever class the family names.
"""

from __future__ import annotations

import torch

from radix_runtime.worker.model_config import ModelConfig, UnsupportedModel
from radix_runtime.worker.models.gemma3 import Gemma3ForCausalLM
from radix_runtime.worker.models.llama import LlamaForCausalLM
from radix_runtime.worker.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,  # Llama 2/3/3.1, Mistral (windowed), Qwen2, SmolLM2
    "qwen3": Qwen3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModel(f"no model class for architecture {config.architecture!r}")
    return cls


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Allocate the parameters uninitialised on `device` (no init kernels, no CPU detour)."""
    with torch.device("meta"):
        model = model_class(config)(config, dtype)
    model = model.to_empty(device=device)
    model.requires_grad_(False)
    return model.eval()
