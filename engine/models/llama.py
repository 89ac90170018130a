"""Llama (`LlamaForCausalLM`): the decoder family Mistral and Qwen2 build on.

Reference: transformers' `modeling_llama.py`. `attention_bias` puts biases on q, k, v
and o; `mlp_bias` on gate, up and down.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fusegen.engine.models.registry import register
from fusegen.engine.models.architecture import Architecture, TensorSpec
from fusegen.engine.models.decoder import CausalLM

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig


def _linear(name: str, rows: int, cols: int, param: str, bias: bool) -> list[TensorSpec]:
    # transformers writes a projection's weight [rows, cols], then its bias [rows]
    weight = [(f"{name}.weight", (rows, cols), f"{param}.weight")]
    return (weight + [(f"{name}.bias", (rows,), f"{param}.bias")]) if bias else weight


@register
class Llama(Architecture):
    hf_names = ("LlamaForCausalLM",)
    model_type = "llama"

    def config_flags(self, raw: dict) -> dict:
        bias = bool(raw.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(raw.get("mlp_bias", False)),
                "sliding_window": int(raw.get("sliding_window") or 0)}  # 0: full attention

    def layer_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        h, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [
            ("input_layernorm.weight", (h,), "input_norm"),
            *_linear("self_attn.q_proj", q, h, "qkv", cfg.qkv_bias),
            *_linear("self_attn.k_proj", kv, h, "qkv", cfg.qkv_bias),
            *_linear("self_attn.v_proj", kv, h, "qkv", cfg.qkv_bias),
            *_linear("self_attn.o_proj", h, q, "o", cfg.o_bias),
            ("post_attention_layernorm.weight", (h,), "post_norm"),
            *_linear("mlp.gate_proj", inter, h, "gate_up", cfg.mlp_bias),
            *_linear("mlp.up_proj", inter, h, "gate_up", cfg.mlp_bias),
            *_linear("mlp.down_proj", h, inter, "down", cfg.mlp_bias),
        ]

    def build_model(self, cfg: ModelConfig) -> CausalLM:
        return CausalLM(cfg)

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        return {"attention_bias": False if attention_bias is None else attention_bias,
                "mlp_bias": False, "pretraining_tp": 1}
