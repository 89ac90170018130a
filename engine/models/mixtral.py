"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a sparse mixture-of-experts
MLP in every layer.

Reference: transformers' `modeling_mixtral.py`. Each token goes to its top
`num_experts_per_tok` of `num_local_experts` experts; their weights are always
renormalised to sum to 1 and stay in fp32. Checkpoint names are those `save_pretrained`
writes (and published checkpoints use): `block_sparse_moe.gate` (the router) and
`block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate, up, down).
"""
from __future__ import annotations

from fusegen.engine.models.registry import register
from fusegen.engine.models.mistral import Mistral
from fusegen.engine.models.moe import MoeArchitecture, moe_flags


@register
class Mixtral(MoeArchitecture, Mistral):
    hf_names = ("MixtralForCausalLM",)
    model_type = "mixtral"
    expert_prefix, expert_names = "block_sparse_moe", ("w1", "w3", "w2")

    def config_flags(self, raw: dict) -> dict:
        # An expert's width is config.json's intermediate_size.
        return {**super().config_flags(raw),
                **moe_flags(raw, "num_local_experts", "intermediate_size", renormalize=True)}

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        return {**super().synthetic_config(num_layers, attention_bias),
                "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": False,
                "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}
