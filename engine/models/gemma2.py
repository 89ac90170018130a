"""Gemma 2 (`Gemma2ForCausalLM`, transformers' `modeling_gemma2.py`): the Gemma decoder
(`gemma.py`) with attention-score and final-logit soft-capping, and sliding-window
layers alternating with global ones (even layers slide unless `layer_types` says)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fusegen.engine.models.registry import register
from fusegen.engine.models.gemma import GemmaCausalLM, GemmaFamily, softcap_flag

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig


@register
class Gemma2(GemmaFamily):
    hf_names = ("Gemma2ForCausalLM",)
    model_type = "gemma2"

    def config_flags(self, raw: dict) -> dict:
        return {**self.common_flags(raw, default_pattern=2),
                "attn_softcap": softcap_flag(raw, "attn_logit_softcapping", 50.0),
                "final_softcap": softcap_flag(raw, "final_logit_softcapping", 30.0)}

    def build_model(self, cfg: ModelConfig) -> GemmaCausalLM:
        return GemmaCausalLM(cfg)

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        return {**super().synthetic_config(num_layers, attention_bias),
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
