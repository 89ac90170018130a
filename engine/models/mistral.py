"""Mistral: Llama's decoder and weight names, with sliding-window attention."""
from fusegen.engine.models.registry import register
from fusegen.engine.models.llama import Llama


@register
class Mistral(Llama):
    """`MistralForCausalLM` (transformers' `modeling_mistral.py`): attention over the last
    `sliding_window` positions when config.json sets it; no bias on o_proj or the MLP."""

    hf_names = ("MistralForCausalLM",)
    model_type = "mistral"

    def config_flags(self, raw: dict) -> dict:
        return {**super().config_flags(raw), "o_bias": False, "mlp_bias": False}

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        if attention_bias:
            raise ValueError("MistralForCausalLM has no attention biases; use arch='qwen2' or 'llama'")
        return {"sliding_window": None}
