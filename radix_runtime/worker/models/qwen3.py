"""Qwen3 dense: the Llama layer stack plus an RMSNorm over each q and k head before RoPE.

Everything else (fused q/k/v and gate/up, the CUDA fused paths, tied or untied embeddings,
sliding windows when a config turns them on) is Llama's; this file adds the two per-layer norm
weights and the one place they act: between the qkv projection and the rotation. On the CUDA
path that is one Triton kernel (`kernels/rope.py` with norm weights), so a Qwen3 layer costs
the same kernel count as a Llama layer.
"""

from __future__ import annotations

import torch

from radix_runtime.worker.attention.base import AttentionBackend
from radix_runtime.worker.kv_pool import KVPool
from radix_runtime.worker.layers import RMSNorm, apply_rope
from radix_runtime.worker.model_config import ModelConfig
from radix_runtime.worker.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Llama's attention with an RMSNorm over each q and k head before RoPE (Gemma 3 reuses it
    with its own norm class)."""

    head_norm = RMSNorm

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__(config, layer_id, dtype)
        self.q_norm = self.head_norm(config.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = self.head_norm(config.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        c = self.config
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rope(self.q_norm(q.view(-1, c.num_heads, c.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(k.view(-1, c.num_kv_heads, c.head_dim)), cos, sin)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        out = attn.forward(self.layer_id, q, k, v, kv_pool)
        return self.o_proj(out.reshape(-1, c.q_size))


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(config, dtype)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Qwen3Attention(config, i, dtype)

    def _attend(
        self,
        layer_id: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """The fused paths' attention: q/k norms and RoPE in one kernel, then the backend."""
        c = self.config
        a = self.model.layers[layer_id].self_attn
        q, k = self._ops.rotary_qk(
            qkv, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim,
            q_norm=a.q_norm.weight, k_norm=a.k_norm.weight, eps=c.rms_norm_eps,
        )  # fmt: skip
        v = qkv[:, c.q_size + c.kv_size :].view(-1, c.num_kv_heads, c.head_dim)
        return attn.forward(layer_id, q, k, v, kv_pool).view(-1, c.q_size)
