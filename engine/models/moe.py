"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE) and the layer that holds it.

A router scores the E experts for every token; each token runs through its top k
experts and their outputs are summed with the routing weights. Experts are batched: a
step sorts its (token, choice) pairs by expert and runs each expert once, one gate_up
and one down matmul over all the tokens routed to it, then puts each result back in its
(token, choice) slot and sums a token's k slots in choice order. That is transformers'
own batched path (`grouped_mm`, its default), so the sums are rounded as there.

Each layer's experts are stored stacked, one tensor per projection: gate_up
[E * 2I, h] (expert e's gate rows, then its up rows) and down [E * h, I], so a layer
is loaded, placed and streamed through the memory pool as one unit like a dense one.

Shapes: T tokens, k experts per token, E experts, h hidden size, I an expert's
intermediate size.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fusegen.engine.models.architecture import TensorSpec
from fusegen.engine.models.decoder import CausalLM, DecoderLayer
from fusegen.engine.weights.linear import Linear, row_tiled
from fusegen.kernels.silu_mul import silu_and_mul

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig


class ExpertLinear(Linear):
    """E weight matrices [E, out, in] stacked in one tensor; x [n, in] -> [n, out]
    through expert `expert`'s matrix. In deterministic mode every call is `row_tile`
    rows (as `Linear`'s), so a token's result does not depend on which other tokens
    share its expert this step. Never packed for oneDNN (`pack_linears` packs plain
    `Linear`s only). Its int8 / int4 form, with the same contract (components handed
    over as [E * out, ...], `forward(x, expert)`), is weights/groupquant.py's
    `GroupQuantExpertLinear`."""

    def __init__(self, num_experts: int):
        super().__init__(bias=False)
        self.num_experts = num_experts

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        # The loader and the streamer hand over [E * out, in]: the experts' rows in turn.
        super().set_weight(name, tensor.view(self.num_experts, -1, tensor.shape[-1]))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        weight = self.weight[expert]  # [out, in]
        if self.row_tile is not None:
            matmul = partial(_matmul, weight=weight)
            return row_tiled(x, matmul, weight.shape[0], None, self.row_tile)
        return F.linear(x, weight)


def _matmul(rows: torch.Tensor, out: torch.Tensor | None = None, *, weight) -> torch.Tensor:
    return torch.mm(rows, weight.t(), out=out)


def run_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                gate_up: ExpertLinear, down: ExpertLinear) -> torch.Tensor:
    """x [T, h]; weights [T, k] (fp32 or x's dtype), experts [T, k] int64 -> [T, h]."""
    num_tokens, top_k = experts.shape
    choices = experts.flatten()  # [T * k]: slot s is token s // k's (s % k)-th choice
    order = torch.argsort(choices, stable=True)  # slots grouped by expert, in slot order
    counts = torch.bincount(choices, minlength=gate_up.num_experts).tolist()  # one host sync
    rows = x[order // top_k]  # [T * k, h]: each slot's token, grouped by expert
    out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            group = slice(start, start + count)
            out[group] = down(silu_and_mul(gate_up(rows[group], expert)), expert)
            start += count
    del rows  # three [T * k, h] buffers at most at once (engine/config.py counts them)
    weighted = out * weights.flatten()[order, None]  # fp32 weights: an fp32 product
    slots = torch.empty_like(weighted).index_copy_(0, order, weighted)  # back in slot order
    return slots.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)  # [T, h]


class MoeLayer(DecoderLayer):
    """A decoder layer whose MLP is the sparse mixture of experts: router [E, h],
    gate_up [E, 2I, h], down [E, h, I]. Routing: softmax over the router's logits in
    fp32, `torch.topk` over the probabilities (ties broken as transformers' same call
    breaks them), the k weights renormalised to sum to 1 when `cfg.norm_topk_prob`."""
    graphable = False  # run_experts counts each expert's tokens on the host

    # Mixtral multiplies by the fp32 weights; Qwen3-MoE first rounds them to the
    # model's dtype. The same in fp32 runs; bf16 runs round as each does.
    weights_in_model_dtype = False

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = Linear()  # [E, h]
        self.gate_up = ExpertLinear(cfg.num_experts)  # [E, 2I, h]: gate, up stacked
        self.down = ExpertLinear(cfg.num_experts)  # [E, h, I]

    def _mlp(self, x):
        return run_experts(x, *self.route(x), self.gate_up, self.down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> each token's k routing weights and experts, [T, k] each."""
        logits = self.router(x)  # [T, E] in the model's dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts


class MoeCausalLM(CausalLM):
    layer_cls = MoeLayer


class MoeArchitecture:
    """Put before an `Architecture` whose layers are Llama-style: the same layers with
    the dense MLP's tensors replaced by a router and experts named
    `{expert_prefix}.gate` and `{expert_prefix}.experts.{e}.{name}` for the (gate,
    up, down) `expert_names`, and `causal_lm` as the decoder."""

    expert_prefix: str = ""
    expert_names: tuple[str, str, str] = ("", "", "")
    causal_lm: type[CausalLM] = MoeCausalLM

    def layer_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        dense = super().layer_tensors(cfg)  # type: ignore[misc]
        attention = [spec for spec in dense if not spec[0].startswith("mlp.")]
        return attention + expert_tensors(cfg, self.expert_prefix, self.expert_names)

    def build_model(self, cfg: ModelConfig) -> CausalLM:
        return self.causal_lm(cfg)


def expert_tensors(cfg: ModelConfig, prefix: str, names: tuple[str, str, str]
                   ) -> list[TensorSpec]:
    """One layer's router and expert tensors, named `{prefix}.gate.weight` and
    `{prefix}.experts.{e}.{name}.weight` for the (gate, up, down) `names`. Listed expert
    by expert, gate before up, so that stacking each parameter's tensors in list order
    gives the layouts `MoeLayer` reads."""
    h, inter, num_experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    specs = [(f"{prefix}.gate.weight", (num_experts, h), "router.weight")]
    for e in range(num_experts):
        gate, up, down = (f"{prefix}.experts.{e}.{name}.weight" for name in names)
        specs += [(gate, (inter, h), "gate_up.weight"), (up, (inter, h), "gate_up.weight"),
                  (down, (h, inter), "down.weight")]
    return specs


def moe_flags(raw: dict, experts_key: str, intermediate_key: str, renormalize: bool) -> dict:
    """The `ModelConfig` MoE fields from config.json; ValueError naming the key fusegen
    cannot run."""
    num_experts = int(raw.get(experts_key) or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if num_experts < 1:
        raise ValueError(f"{experts_key} must be at least 1, got {raw.get(experts_key)!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be between 1 and {experts_key} "
                         f"({num_experts}), got {raw.get('num_experts_per_tok')!r}")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(raw[intermediate_key]),
            "norm_topk_prob": renormalize}

