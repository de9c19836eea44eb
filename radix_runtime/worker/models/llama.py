"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) in plain torch over a paged KV cache.

Numerics follow Hugging Face transformers (RMSNorm in float32, RoPE with the rotate_half
convention, cos/sin computed in float32 then cast), so logits match `LlamaForCausalLM` to float32
rounding. Q/K/V and gate/up are fused into one matmul each; checkpoint tensors are sliced into
the fused weights by `load_weights`. The model works on a flat batch of tokens (no padding): the
attention backend knows which request each token belongs to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radix_runtime.worker.attention.base import AttentionBackend
from radix_runtime.worker.kv_pool import KVPool
from radix_runtime.worker.layers import (
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    apply_rope,
    reduce_row_parallel,
)
from radix_runtime.worker.model_config import ModelConfig
from radix_runtime.worker.models.checkpoint import fused_name, shard_rows, shards_of

if TYPE_CHECKING:
    from radix_runtime.worker.cpu_native import CpuDecoder
    from radix_runtime.worker.kernels.ops import FusedOps


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        qkv_out = config.q_size + 2 * config.kv_size
        self.qkv_proj = Linear(config.hidden_size, qkv_out, config.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(
            config.q_size, config.hidden_size, config.o_bias, dtype, config.tp_size
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        c = self.config
        qkv = self.qkv_proj(x)
        # RoPE on the q and k heads in one go (the same elementwise math as one call each)
        qk = qkv[:, : c.q_size + c.kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
        q, k = apply_rope(qk, cos, sin).split([c.num_heads, c.num_kv_heads], dim=1)
        if x.device.type != "cpu":  # as before for the CUDA kernels; the torch backend takes views
            q, k = q.contiguous(), k.contiguous()
        v = qkv[:, c.q_size + c.kv_size :].view(-1, c.num_kv_heads, c.head_dim)
        out = attn.forward(self.layer_id, q, k, v, kv_pool)
        return self.o_proj(out.reshape(-1, c.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, layer_id, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, dtype, tp_size=config.tp_size
        )

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attn, kv_pool)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Parameter names mirror Hugging Face's, except the fused `qkv_proj` and `gate_up_proj`."""

    # the decoder projections' format: none | fp8 (worker/quant.py swaps the layers) | int4 / awq
    # / gptq (packed Int4Linear layers on CUDA, dequantized weights elsewhere)
    quantization = "none"
    packed_int4 = False  # some decoder projections are Int4Linear (worker/quant.py)

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, dtype)
        )
        self.rotary = RotaryEmbedding(config)
        self._ops: FusedOps | None = None  # the CUDA path's kernels, once enable_fused_ops()
        # the CPU path's layers in one C++ call (worker/cpu_native.py), once the runner built it
        self.cpu_decoder: CpuDecoder | None = None

    def enable_fused_ops(self, ops: FusedOps) -> None:
        """Run the CUDA path (fused kernels, bf16/fp16) with `ops` from now on (again with other
        ops: a benchmark's kernel variant)."""
        self._ops = ops

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """input_ids/positions [N] -> final hidden states [N, hidden] (after the last norm)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        if self._ops is not None:
            return self._forward_fused(h, cos, sin, attn, kv_pool)
        if self.cpu_decoder is not None and self.cpu_decoder.serves(attn, kv_pool):
            return self.model.norm(self.cpu_decoder.forward(h, cos, sin))
        for layer in self.model.layers:
            h = layer(h, cos, sin, attn, kv_pool)
        return self.model.norm(h)

    def _forward_fused(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """The same layers in fewer kernels: each residual add fused into the next RMSNorm
        (the residual stream is carried separately and updated in place), RoPE on q and k in
        one kernel, SiLU-and-mul in one kernel, batch-1 projections as Triton GEMVs."""
        ops, c = self._ops, self.config
        eps = c.rms_norm_eps
        layers = self.model.layers
        # FP8 layers: the GEMV reads their scales; packed int4 ones run the int4 GEMV (with the
        # same prologues) unless the int4 kernels are off; tensor parallelism: the o/down GEMVs'
        # residual-add epilogue would add a partial sum
        int4_off = self.packed_int4 and not ops.config.int4_gemv
        row_ok = not (c.qkv_bias or c.o_bias or c.tp_size > 1 or int4_off)
        if h.shape[0] == 1 and ops.row_fusion and row_ok:
            return self._forward_row(h, cos, sin, attn, kv_pool)
        residual = h
        x = ops.rmsnorm(h, layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(layers):
            if i > 0:  # residual += h (the previous MLP's output); x = norm(residual)
                x = ops.fused_add_rmsnorm(h, residual, layer.input_layernorm.weight, eps)
            a, mlp = layer.self_attn, layer.mlp
            qkv = ops.project(x, a.qkv_proj)
            out = self._attend(a.layer_id, qkv, cos, sin, attn, kv_pool)
            h = reduce_row_parallel(a.o_proj, ops.project(out, a.o_proj))
            x = ops.fused_add_rmsnorm(h, residual, layer.post_attention_layernorm.weight, eps)
            gate_up = ops.project(x, mlp.gate_up_proj)
            down = ops.project(ops.silu_and_mul(gate_up), mlp.down_proj)
            h = reduce_row_parallel(mlp.down_proj, down)
        return ops.fused_add_rmsnorm(h, residual, self.model.norm.weight, eps)

    def _forward_row(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """One token (a batch-1 decode step): four GEMVs per layer that carry the norms, the
        residual adds and SiLU-and-mul in their prologues/epilogues (`kernels/gemv.py`), so a layer
        is eight kernels: the four GEMVs, RoPE, the KV store and attention's two (split, merge)."""
        ops, c = self._ops, self.config
        eps = c.rms_norm_eps
        residual = h  # [1, hidden], updated in place by the o and down GEMVs
        for layer in self.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = ops.row_project(residual, a.qkv_proj, norm_weight=layer.input_layernorm.weight,
                                  eps=eps)  # fmt: skip
            out = self._attend(a.layer_id, qkv, cos, sin, attn, kv_pool)
            ops.row_project(out, a.o_proj, add_to=residual)
            gate_up = ops.row_project(residual, mlp.gate_up_proj,
                                      norm_weight=layer.post_attention_layernorm.weight, eps=eps)  # fmt: skip
            ops.row_project(gate_up, mlp.down_proj, silu=True, add_to=residual)
        return ops.rmsnorm(residual, self.model.norm.weight, eps)

    def _attend(
        self,
        layer_id: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """The fused paths' attention from the qkv projection: RoPE on q and k in one kernel,
        then the backend (which stores the new K/V); returns [N, q_size]."""
        c = self.config
        q, k = self._ops.rotary_qk(qkv, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim)
        v = qkv[:, c.q_size + c.kv_size :].view(-1, c.num_kv_heads, c.head_dim)
        return attn.forward(layer_id, q, k, v, kv_pool).view(-1, c.q_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> float32 [R, vocab]; called only on the rows that need logits."""
        if self.lm_head is not None and not isinstance(self.lm_head, Linear):
            if self._ops is not None and hasattr(self.lm_head, "weight_scale"):
                return self._ops.project(hidden, self.lm_head).float()  # an FP8 head
            # a CPU int8/int4 head (worker/cpu_quant.py), or an FP8 one without the kernels
            return self.lm_head(hidden).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self._ops is not None:
            return self._ops.linear(hidden, weight, None).float()
        return F.linear(hidden, weight).float()

    # ------------------------------------------------------------------------------------------
    # weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the parameters from checkpoint tensors named as in HF, or already fused as ours.

        A tensor that already has a parameter's exact shape, dtype and device becomes that
        parameter (no copy: a memory-mapped safetensors cache loads without touching its pages);
        others are copied, into their row slice for the q/k/v and gate/up shards.
        Every parameter must be filled.
        """
        params = dict(self.named_parameters())
        missing = {name: set(shards_of(name)) for name in params}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue
            target, shard = fused_name(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            self._fill(params[target], shard, tensor, name)
            # a whole-parameter tensor (shard None) fills every shard of a fused parameter
            missing[target] -= set(shards_of(target)) if shard is None else {shard}
        unfilled = sorted(name for name, shards in missing.items() if shards)
        if unfilled:
            raise ValueError(f"the checkpoint did not fill {unfilled[:8]} ({len(unfilled)} in all)")

    def _fill(
        self, param: nn.Parameter, shard: str | int | None, tensor: torch.Tensor, name: str
    ) -> None:
        dst = param.data[shard_rows(self.config, shard, param.shape[0])]
        if name.endswith(".weight_scale") and tensor.numel() == 1 and dst.dim() == 1:
            tensor = tensor.reshape(1).expand(dst.shape)  # a per-tensor FP8 scale, on every row
        if dst.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model {tuple(dst.shape)}"
            )
        same_layout = tensor.dtype == dst.dtype and tensor.device == dst.device
        if shard is None and same_layout and tensor.is_contiguous():
            param.data = tensor
        else:
            dst.copy_(tensor)
