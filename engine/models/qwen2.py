"""Qwen2: Llama's decoder and weight names, with q/k/v biases."""
from fusegen.engine.models.registry import register
from fusegen.engine.models.llama import Llama


@register
class Qwen2(Llama):
    """`Qwen2ForCausalLM` (transformers' `modeling_qwen2.py`): biases on q, k and v
    always, none on o_proj or the MLP; sliding-window attention only when config.json
    sets `use_sliding_window`."""

    hf_names = ("Qwen2ForCausalLM",)
    model_type = "qwen2"

    def config_flags(self, raw: dict) -> dict:
        flags = {**super().config_flags(raw), "qkv_bias": True, "o_bias": False, "mlp_bias": False}
        if not raw.get("use_sliding_window", False):
            flags["sliding_window"] = 0
        return flags

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        if attention_bias is not None and not attention_bias:
            # transformers has no switch for them
            raise ValueError("Qwen2ForCausalLM always has q/k/v biases; attention_bias=False is not expressible")
        return {"layer_types": ["full_attention"] * num_layers, "max_window_layers": num_layers,
                "sliding_window": None, "use_sliding_window": False}
