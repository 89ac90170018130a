"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (q/k head norms) with a sparse
mixture-of-experts MLP in every layer.

Reference: transformers' `modeling_qwen3_moe.py`. Each token goes to its top
`num_experts_per_tok` of `num_experts` experts; their weights are renormalised to sum
to 1 only with `norm_topk_prob`, then rounded to the model's dtype. Sliding-window
attention in every layer when `use_sliding_window` is set. Checkpoint names:
`mlp.gate` (the router), `mlp.experts.{e}.gate_proj / up_proj / down_proj`.

fusegen runs checkpoints whose every layer has experts (published Qwen3-MoE models
do): a dense layer among them (`mlp_only_layers`, `decoder_sparse_step` > 1) would
give layers of two sizes, which the memory pool's per-layer placement does not hold.
"""
from __future__ import annotations

from fusegen.engine.models.registry import register
from fusegen.engine.models.decoder import CausalLM
from fusegen.engine.models.moe import MoeArchitecture, MoeLayer, moe_flags
from fusegen.engine.models.qwen3 import Qwen3, Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(MoeLayer, Qwen3DecoderLayer):
    weights_in_model_dtype = True


class Qwen3MoeCausalLM(CausalLM):
    layer_cls = Qwen3MoeDecoderLayer


@register
class Qwen3Moe(MoeArchitecture, Qwen3):
    hf_names = ("Qwen3MoeForCausalLM",)
    model_type = "qwen3_moe"
    expert_prefix, expert_names = "mlp", ("gate_proj", "up_proj", "down_proj")
    causal_lm = Qwen3MoeCausalLM

    def config_flags(self, raw: dict) -> dict:
        if raw.get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers {raw['mlp_only_layers']} not supported: fusegen "
                             "runs Qwen3-MoE checkpoints with experts in every layer "
                             "(mlp_only_layers empty)")
        if int(raw.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(f"decoder_sparse_step {raw['decoder_sparse_step']} not supported: "
                             "fusegen runs Qwen3-MoE checkpoints with experts in every layer "
                             "(decoder_sparse_step 1)")
        bias = bool(raw.get("attention_bias", False))
        window = int(raw.get("sliding_window") or 0) if raw.get("use_sliding_window") else 0
        renormalize = bool(raw.get("norm_topk_prob", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "sliding_window": window,
                **moe_flags(raw, "num_experts", "moe_intermediate_size", renormalize)}

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        return {"attention_bias": bool(attention_bias), "decoder_sparse_step": 1,
                "mlp_only_layers": [], "moe_intermediate_size": 64, "norm_topk_prob": True,
                "num_experts": 4, "num_experts_per_tok": 2, "output_router_logits": False,
                "router_aux_loss_coef": 0.001, "sliding_window": None,
                "use_sliding_window": False}
