"""The decoder (Llama, Mistral, Qwen2) over one ragged token stream.

A step's tokens from all requests are packed into one sequence of T tokens with no
padding (ByteTransformer's idea); the attention metadata says where each request's
tokens start and where its keys and values live in the paged cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusegen.engine.models.config import ModelConfig
from fusegen.kernels.kv_cache import write_kv_cache
from fusegen.kernels.paged_attention import paged_attention
from fusegen.kernels.rms_norm import rms_norm
from fusegen.kernels.rotary import rotary_embedding
from fusegen.kernels.silu_mul import silu_and_mul


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    query_start_loc: torch.Tensor  # [B+1] int32
    max_query_len: int
    max_seq_len: int


def _param(present: bool = True):
    # Filled by `CausalLM.load`; None marks a bias the architecture does not have.
    return nn.Parameter(torch.empty(0), requires_grad=False) if present else None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.eps = cfg.rms_norm_eps
        self.sliding_window = cfg.sliding_window
        self.scale = d ** -0.5
        self.input_norm = _param()
        self.qkv = _param()  # [q + 2 kv, hidden]: q, k, v stacked
        self.qkv_bias = _param(cfg.qkv_bias)
        self.o = _param()
        self.o_bias = _param(cfg.o_bias)
        self.post_norm = _param()
        self.gate_up = _param()  # [2 * intermediate, hidden]: gate, up stacked
        self.gate_up_bias = _param(cfg.mlp_bias)
        self.down = _param()
        self.down_bias = _param(cfg.mlp_bias)

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        for name, tensor in weights.items():
            getattr(self, name).data = tensor

    def forward(self, positions, x, residual, rope, kv_cache, meta: AttentionMetadata):
        # x [T, hidden] is the previous layer's output, not yet added to the residual
        # stream (the add is fused into the norm); residual is None at the first layer.
        if residual is None:
            residual, h = x, rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = rms_norm(x, self.input_norm, self.eps, residual=residual)
        h = self._attention(positions, h, rope, kv_cache, meta)
        h, residual = rms_norm(h, self.post_norm, self.eps, residual=residual)
        return self._mlp(h), residual

    def _attention(self, positions, x, rope, kv_cache, meta):
        num_tokens = x.shape[0]
        qkv = F.linear(x, self.qkv, self.qkv_bias)  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        rotary_embedding(positions, q, k, *rope)  # in place
        k_cache, v_cache = kv_cache
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                              meta.query_start_loc, max_query_len=meta.max_query_len,
                              max_seq_len=meta.max_seq_len, scale=self.scale,
                              sliding_window=self.sliding_window)
        return F.linear(out.reshape(num_tokens, self.q_size), self.o, self.o_bias)

    def _mlp(self, x):
        gate_up = F.linear(x, self.gate_up, self.gate_up_bias)  # [T, 2 * intermediate]
        return F.linear(silu_and_mul(gate_up), self.down, self.down_bias)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = _param()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _param()
        self.lm_head = _param(not cfg.tie_word_embeddings)
        self.streamer = None  # engine.memory.offload.WeightStreamer when some layers stream

    def forward(self, input_ids, positions, cos_sin, kv_caches, meta: AttentionMetadata):
        # input_ids, positions [T]; cos_sin [max_len, head_dim] (cos halves, sin halves)
        rope = cos_sin.chunk(2, dim=-1)
        x, residual = F.embedding(input_ids, self.embed), None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if self.streamer is not None:
                self.streamer.acquire(i)
            x, residual = layer(positions, x, residual, rope, kv_cache, meta)
            if self.streamer is not None:
                self.streamer.release(i)
        return x, residual  # [T, hidden] each: the stream is x + residual

    def logits(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # rows [N, hidden] of the tokens that sample -> [N, vocab] fp32
        head = self.embed if self.lm_head is None else self.lm_head
        h, _ = rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual=residual)
        return F.linear(h, head).float()

    def load_fixed(self, state: dict[str, torch.Tensor], device, dtype) -> None:
        """The tensors every step needs: embedding, final norm, LM head."""
        self.embed.data = state["model.embed_tokens.weight"].to(device, dtype)
        self.norm.data = state["model.norm.weight"].to(device, dtype)
        if self.lm_head is not None:
            self.lm_head.data = state["lm_head.weight"].to(device, dtype)


def layer_sources(state: dict[str, torch.Tensor], index: int, cfg: ModelConfig
                  ) -> dict[str, list[torch.Tensor]]:
    """Layer `index`'s parameters as lists of checkpoint tensors that, stacked along
    dim 0, give the fused parameter (q/k/v into qkv, gate/up into gate_up)."""
    p = f"model.layers.{index}."
    attn, mlp = p + "self_attn.", p + "mlp."
    sources = {
        "input_norm": [state[p + "input_layernorm.weight"]],
        "post_norm": [state[p + "post_attention_layernorm.weight"]],
        "qkv": [state[attn + f"{n}_proj.weight"] for n in "qkv"],
        "o": [state[attn + "o_proj.weight"]],
        "gate_up": [state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]],
        "down": [state[mlp + "down_proj.weight"]],
    }
    if cfg.qkv_bias:
        sources["qkv_bias"] = [state[attn + f"{n}_proj.bias"] for n in "qkv"]
    if cfg.o_bias:
        sources["o_bias"] = [state[attn + "o_proj.bias"]]
    if cfg.mlp_bias:
        sources["gate_up_bias"] = [state[mlp + "gate_proj.bias"], state[mlp + "up_proj.bias"]]
        sources["down_bias"] = [state[mlp + "down_proj.bias"]]
    return sources


def fuse(sources: dict[str, list[torch.Tensor]], device, dtype) -> dict[str, torch.Tensor]:
    return {name: torch.cat([t.to(dtype) for t in parts]).to(device) if len(parts) > 1
            else parts[0].to(device, dtype, copy=True) for name, parts in sources.items()}
