"""Gemma 3 text models (1B `Gemma3ForCausalLM`, and the language model of the 4B-27B
`Gemma3ForConditionalGeneration` checkpoints, whose vision weights are skipped).

Differences from Llama, each as Hugging Face's `modeling_gemma3` computes it:
- the embedding is scaled by sqrt(hidden_size) (the scale rounded to the weight dtype);
- every RMSNorm scales by (1 + w), in float32 (`GemmaRMSNorm`); q and k heads are normalized
  before RoPE; each sublayer's output is normalized before the residual add
  (post_attention_layernorm, post_feedforward_layernorm) and the MLP input has its own
  pre_feedforward_layernorm;
- the MLP is gelu(tanh)-gated;
- the softmax scale is query_pre_attn_scalar ** -0.5;
- layers alternate local (sliding window, RoPE base `rope_local_theta`, unscaled) and global
  (full attention, `rope_theta` with the config's scaling); the attention backend applies each
  layer's window (ModelConfig.layer_windows);
- optional soft-capping of attention scores (the backend) and of the final logits.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radix_runtime.worker.attention.base import AttentionBackend
from radix_runtime.worker.kv_pool import KVPool
from radix_runtime.worker.layers import (
    Embedding,
    GatedMLP,
    GemmaRMSNorm,
    Linear,
    RotaryEmbedding,
    reduce_row_parallel,
)
from radix_runtime.worker.model_config import ModelConfig
from radix_runtime.worker.models.llama import LlamaForCausalLM
from radix_runtime.worker.models.qwen3 import Qwen3Attention

# checkpoint name prefixes of the multimodal wrapper's language model -> ours
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.", "language_model.lm_head.")  # fmt: skip


class Gemma3Attention(Qwen3Attention):
    """Qwen3's attention (q/k head norms before RoPE) with Gemma's (1 + w) RMSNorm."""

    head_norm = GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.local = bool(config.layer_windows and config.layer_windows[layer_id])
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = Gemma3Attention(config, layer_id, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = GatedMLP(h, config.intermediate_size, dtype, config.hidden_act, config.tp_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(h), cos, sin, attn, kv_pool)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, dtype) for i in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's weight loading, logits and fused-ops switch; Gemma's layers and forward."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = Gemma3Model(config, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype)
        )
        self.rotary = RotaryEmbedding(config)  # global layers
        self.rotary_local = RotaryEmbedding(
            config, theta=config.rope_local_theta, scaling=config.rope_local_scaling
        )
        self._ops = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        # HF keeps sqrt(hidden) as a float32 buffer and rounds it to the weight dtype
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(h.dtype)
        return h * scale.item()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        h = self.embed(input_ids)
        rope = {
            False: self.rotary.cos_sin(positions, h.dtype),
            True: self.rotary_local.cos_sin(positions, h.dtype),
        }
        if self._ops is not None:
            return self._forward_fused(h, rope, attn, kv_pool)
        for layer in self.model.layers:
            h = layer(h, *rope[layer.local], attn, kv_pool)
        return self.model.norm(h)

    def _forward_fused(
        self,
        h: torch.Tensor,
        rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """The CUDA path: each sublayer's output norm, the residual add and the next input norm
        in one kernel (`kernels/norms.py`), q/k norms fused into the RoPE kernel,
        gelu-and-mul in one kernel (at one row: the down GEMV's prologue): 10 kernels a layer at
        batch 1."""
        ops, c = self._ops, self.config
        eps = c.rms_norm_eps
        layers = self.model.layers
        residual = h
        x = ops.gemma_rmsnorm(h, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            if i > 0:  # residual += post_ff_norm(h) of the layer before; x = input_norm(residual)
                x = ops.gemma_norm_add_norm(
                    h, residual, layers[i - 1].post_feedforward_layernorm.weight,
                    layer.input_layernorm.weight, eps,
                )  # fmt: skip
            a, mlp = layer.self_attn, layer.mlp
            qkv = ops.project(x, a.qkv_proj)
            cos, sin = rope[layer.local]
            q, k = ops.rotary_qk(
                qkv, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim,
                q_norm=a.q_norm.weight, k_norm=a.k_norm.weight, eps=eps, norm_offset=1.0,
            )  # fmt: skip
            v = qkv[:, c.q_size + c.kv_size :].view(-1, c.num_kv_heads, c.head_dim)
            out = attn.forward(a.layer_id, q, k, v, kv_pool).view(-1, c.q_size)
            h = reduce_row_parallel(a.o_proj, ops.project(out, a.o_proj))
            x = ops.gemma_norm_add_norm(
                h, residual, layer.post_attention_layernorm.weight,
                layer.pre_feedforward_layernorm.weight, eps,
            )  # fmt: skip
            gate_up = ops.project(x, mlp.gate_up_proj)
            down = ops.gated_project(gate_up, mlp.down_proj, "gelu_tanh")
            h = reduce_row_parallel(mlp.down_proj, down)
        return ops.gemma_norm_add_norm(
            h, residual, layers[-1].post_feedforward_layernorm.weight, self.model.norm.weight, eps
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(text_model_weights(weights))


def text_model_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """A multimodal checkpoint's language-model tensors under Gemma3ForCausalLM's names."""
    for name, tensor in weights:
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix) :]
                break
        yield name, tensor
