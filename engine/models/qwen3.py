"""Qwen3 (`Qwen3ForCausalLM`): Llama's decoder with an RMSNorm on each query and key
head before the rotary embedding.

Reference: transformers' `modeling_qwen3.py`. `attention_bias` puts biases on q, k, v
and o; the MLP has none. Sliding-window attention only where config.json's
`layer_types` says "sliding_attention" (transformers derives them from
`use_sliding_window` and `max_window_layers` when the list is absent).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fusegen.engine.models.registry import register
from fusegen.engine.models.config import FULL, SLIDING, check_layer_types
from fusegen.engine.models.decoder import CausalLM, DecoderLayer
from fusegen.engine.models.head_norm import HeadNorms
from fusegen.engine.models.llama import Llama

if TYPE_CHECKING:
    from fusegen.engine.models.architecture import TensorSpec
    from fusegen.engine.models.config import ModelConfig


class Qwen3DecoderLayer(HeadNorms, DecoderLayer):
    """Llama's layer with an RMSNorm on each query and key head."""


class Qwen3CausalLM(CausalLM):
    layer_cls = Qwen3DecoderLayer


@register
class Qwen3(Llama):
    hf_names = ("Qwen3ForCausalLM",)
    model_type = "qwen3"

    def config_flags(self, raw: dict) -> dict:
        # Llama's attention biases; no MLP bias, a window only with use_sliding_window
        layer_types = sliding_layer_types(raw)
        window = int(raw.get("sliding_window") or 0) if raw.get("use_sliding_window") else 0
        if SLIDING in layer_types and not window:
            raise ValueError("layer_types has sliding_attention layers but no sliding_window "
                             "is set (with use_sliding_window true); set both or neither")
        return {**super().config_flags(raw), "mlp_bias": False, "sliding_window": window,
                "layer_types": layer_types, "head_dim": int(raw.get("head_dim") or 128)}

    def layer_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        # Llama's, with the head norms after the attention projections
        tensors = super().layer_tensors(cfg)
        at = next(i for i, t in enumerate(tensors) if t[0] == "post_attention_layernorm.weight")
        norms = [("self_attn.q_norm.weight", (cfg.head_dim,), "q_norm"),
                 ("self_attn.k_norm.weight", (cfg.head_dim,), "k_norm")]
        return [*tensors[:at], *norms, *tensors[at:]]

    def build_model(self, cfg: ModelConfig) -> CausalLM:
        return Qwen3CausalLM(cfg)

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        return {"attention_bias": bool(attention_bias), "layer_types": [FULL] * num_layers,
                "max_window_layers": num_layers, "sliding_window": None,
                "use_sliding_window": False}


def sliding_layer_types(raw: dict) -> list[str]:
    """Qwen's layer types: config.json's list, else transformers' rule (layers from
    `max_window_layers` on slide when `use_sliding_window` is set)."""
    num_layers = int(raw["num_hidden_layers"])
    if raw.get("layer_types") is not None:
        return check_layer_types(raw["layer_types"], num_layers)
    sliding = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
    first = int(raw.get("max_window_layers", 28)) if sliding else num_layers
    return [SLIDING if i >= first else FULL for i in range(num_layers)]
