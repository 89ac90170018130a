"""Phi-3 (`Phi3ForCausalLM`, also Phi-3.5-mini and Phi-4-mini): Llama's decoder with
fused checkpoint tensors, partial rotary and LongRoPE.

Reference: transformers' `modeling_phi3.py`. The checkpoint holds q, k, v as one
`qkv_proj` and gate, up as one `gate_up_proj`, stacked in the order fusegen's fused
`qkv` and `gate_up` parameters hold them, so each loads as it is. No biases.
`partial_rotary_factor` rotates the first int(head_dim * factor) dims of each head.

LongRoPE (`rope_scaling` of type `longrope`, or its old name `su`): two lists of
per-frequency factors, `short_factor` for sequences within
`original_max_position_embeddings` (the pretraining length) and `long_factor` beyond
it; cos and sin are both scaled by the attention factor (config.json's
`attention_factor`, else sqrt(1 + ln(factor) / ln(original)) with `factor`, else
max_position_embeddings / original). A sequence within the original length is
rotated by the short factors throughout, a longer one by the long factors throughout:
transformers picks the list per forward call by the sequence's length, and its Phi-3
`generate` drops the cache and computes the whole sequence again at the step where the
sequence first grows past the original length. fusegen does the same per request,
whatever the batch and however the prompt is chunked: every token a step computes for
a request of n tokens (prompt and generated so far) takes the long factors iff
n > original, and a request growing from `original` tokens to one more is computed
again from its first token, in its own KV blocks (the scheduler's `recompute_at`).
That costs one prefill of the request at the switch, as in transformers.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from fusegen.engine.models.registry import register
from fusegen.engine.models.architecture import TensorSpec
from fusegen.engine.models.decoder import AttentionMetadata, CausalLM
from fusegen.engine.models.llama import Llama

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig

_PHI3_ORIGINAL_LENGTH = 4096  # Phi3Config's original_max_position_embeddings default


@register
class Phi3(Llama):
    hf_names = ("Phi3ForCausalLM",)
    model_type = "phi3"

    def config_flags(self, raw: dict) -> dict:
        flags = {**super().config_flags(raw), "qkv_bias": False, "o_bias": False,
                 "mlp_bias": False}
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
        num_heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // num_heads)
        rotary_dim = int(head_dim * factor)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {factor} gives a rotary width of "
                             f"{rotary_dim} of head_dim {head_dim}; it must be even and > 0")
        flags["partial_rotary_factor"] = factor
        if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
            flags["rope_scaling"] = _longrope_scaling(raw, rope, rotary_dim)
        return flags

    def layer_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        h, inter = cfg.hidden_size, cfg.intermediate_size
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        return [("input_layernorm.weight", (h,), "input_norm"),
                ("self_attn.qkv_proj.weight", (qkv, h), "qkv.weight"),
                ("self_attn.o_proj.weight", (h, cfg.num_heads * cfg.head_dim), "o.weight"),
                ("post_attention_layernorm.weight", (h,), "post_norm"),
                ("mlp.gate_up_proj.weight", (2 * inter, h), "gate_up.weight"),
                ("mlp.down_proj.weight", (h, inter), "down.weight")]

    def uses_request_lengths(self, cfg: ModelConfig) -> bool:
        return cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"

    def build_model(self, cfg: ModelConfig) -> CausalLM:
        return LongRopeCausalLM(cfg) if self.uses_request_lengths(cfg) else CausalLM(cfg)

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        if attention_bias:
            raise ValueError("Phi3ForCausalLM has no attention biases; use arch='qwen2' or 'llama'")
        return {"embd_pdrop": 0.0, "resid_pdrop": 0.0, "sliding_window": None,
                "original_max_position_embeddings": _PHI3_ORIGINAL_LENGTH}


def _longrope_scaling(raw: dict, rope: dict, rotary_dim: int) -> dict:
    """The rope_scaling dict rope.py reads, every value resolved as transformers'
    Phi3Config resolves it."""
    # Phi3Config always has the top-level key (default 4096) and it wins over the dict's.
    original = int(raw.get("original_max_position_embeddings", _PHI3_ORIGINAL_LENGTH))
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if not isinstance(factors, list) or len(factors) != rotary_dim // 2:
            raise ValueError(f"rope_scaling {key} must list {rotary_dim // 2} numbers (half "
                             f"the rotary width), got {factors!r}")
    factor = rope.get("factor") or int(raw.get("max_position_embeddings", 4096)) / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(original)))
    return {**rope, "rope_type": "longrope", "original_max_position_embeddings": original,
            "attention_factor": float(attention_factor)}


class LongRopeCausalLM(CausalLM):
    """Llama's decoder that rotates each token by the short or the long factors, as
    the module docstring says. The rotary table (rope.py) holds the short rows, then
    from row `original` on the long rows, so a token's row is its position, or
    original + its position. It reads AttentionMetadata.num_tokens, which the runners
    fill for it (`Phi3.uses_request_lengths`)."""

    def forward(self, input_ids, positions, cos_sin, kv_caches, meta: AttentionMetadata,
                **stage):
        # positions only index the rotary table in the decoder, so rows replace them.
        original = self.cfg.rope_scaling["original_max_position_embeddings"]
        if cos_sin[0].shape[0] > original:  # the long rows exist: max_model_len > original
            positions = rope_rows(positions, meta, original)
        return super().forward(input_ids, positions, cos_sin, kv_caches, meta, **stage)


def rope_rows(positions: torch.Tensor, meta: AttentionMetadata, original: int) -> torch.Tensor:
    """[T] each token's row in the LongRoPE table: its position p, or original + p
    where its request has more than `original` tokens."""
    long = meta.num_tokens > original  # [B]
    query_lens = meta.query_start_loc.diff()  # [B]
    return positions + original * torch.repeat_interleave(long, query_lens,
                                                          output_size=positions.shape[0])
