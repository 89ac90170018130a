"""Gemma 3 text models (`Gemma3ForCausalLM`, model_type `gemma3_text`; transformers'
`modeling_gemma3.py`): the Gemma decoder (`gemma.py`) with a Gemma-style RMSNorm on
each query and key head before the rotary embedding, five sliding-window layers to
each global one unless `layer_types` says otherwise, and two rotary tables: the
sliding layers' own base (`rope_local_base_freq`, default 10,000) and the global
layers' (`rope_theta`, default 1,000,000, with `rope_scaling` if any). transformers 5
writes both as `rope_parameters` per layer type.

Final-logit soft-capping applies when config.json sets it; transformers' Gemma 3 does
not cap attention scores even if `attn_logit_softcapping` is set, so neither does
fusegen. The multimodal `Gemma3ForConditionalGeneration` is not served.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fusegen.engine.models.registry import register
from fusegen.engine.models.config import FULL, SLIDING, rope_scaling_of
from fusegen.engine.models.gemma import (GemmaCausalLM, GemmaDecoderLayer, GemmaFamily,
                                         gemma_rms_norm, softcap_flag)
from fusegen.engine.models.head_norm import HeadNorms

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' defaults


class Gemma3DecoderLayer(HeadNorms, GemmaDecoderLayer):
    """Gemma's layer with a Gemma RMSNorm (weights 1 + w in fp32) on each query and key
    head."""
    head_norm = staticmethod(gemma_rms_norm)


class Gemma3CausalLM(GemmaCausalLM):
    layer_cls = Gemma3DecoderLayer


@register
class Gemma3(GemmaFamily):
    hf_names = ("Gemma3ForCausalLM",)
    model_type = "gemma3_text"
    has_qk_norm = True

    def config_flags(self, raw: dict) -> dict:
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        return {**self.common_flags(raw, default_pattern=int(pattern)), **rope_tables(raw),
                "final_softcap": softcap_flag(raw, "final_logit_softcapping", None)}

    def build_model(self, cfg: ModelConfig) -> Gemma3CausalLM:
        return Gemma3CausalLM(cfg)

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        return {**super().synthetic_config(num_layers, attention_bias),
                "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": _GLOBAL_THETA},
                                    SLIDING: {"rope_type": "default", "rope_theta": _LOCAL_THETA}}}


def rope_tables(raw: dict) -> dict:
    """The global and the local rotary table: from `rope_parameters` per layer type
    (transformers 5), else from `rope_theta` / `rope_scaling` and `rope_local_base_freq`."""
    params = raw.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        return {"rope_theta": float(full.get("rope_theta", _GLOBAL_THETA)),
                "rope_scaling": rope_scaling_of(full, f"rope_parameters.{FULL}"),
                "local_rope_theta": float(local.get("rope_theta", _LOCAL_THETA)),
                "local_rope_scaling": rope_scaling_of(local, f"rope_parameters.{SLIDING}")}
    return {"rope_theta": float(raw.get("rope_theta") or params.get("rope_theta") or _GLOBAL_THETA),
            "rope_scaling": rope_scaling_of(raw.get("rope_scaling"), "rope_scaling"),
            "local_rope_theta": float(raw.get("rope_local_base_freq") or _LOCAL_THETA),
            "local_rope_scaling": None}
