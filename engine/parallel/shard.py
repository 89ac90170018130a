"""Which slice of each weight a tensor-parallel rank holds (1-D, Megatron's split).

A rank builds its decoder from `rank_model_config`: its own number of query heads, KV
heads and intermediate rows, so the decoder's code runs unchanged on local shapes. Its
weights are views of the checkpoint's tensors narrowed to its slice (memory-mapped
tensors stay unread until the loader copies them):
- q/k/v and gate/up: split by output rows, q by query heads and k/v by KV heads (a KV
  head is replicated when there are more ranks than KV heads);
- o and down: split by input columns; the rank's partial sums are all-reduced
  (layers.RowParallelLinear), their biases kept whole and added once, after;
- MoE experts: each expert's gate/up and down split like the dense MLP; router whole;
- embedding and LM head: split by vocabulary rows (`vocab_range`);
- norms (and per-head q/k norms) whole.
"""
from __future__ import annotations

import dataclasses

import torch

from fusegen.engine.models.config import ModelConfig


def rank_model_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model one rank of a tp-way split runs (vocabulary stays whole: only the
    embedding and head tensors are sliced, by `vocab_range`)."""
    if tp == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // tp, num_kv_heads=max(cfg.num_kv_heads // tp, 1),
        intermediate_size=cfg.intermediate_size // tp,
        moe_intermediate_size=cfg.moe_intermediate_size // tp)


def vocab_range(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """Rank `tp_rank`'s rows of the vocabulary: near-equal runs, in rank order."""
    return vocab_size * tp_rank // tp, vocab_size * (tp_rank + 1) // tp


def kv_heads(cfg: ModelConfig, tp: int, tp_rank: int) -> range:
    """The KV heads rank `tp_rank` holds: its share, or the one its query heads read
    when ranks outnumber KV heads."""
    if tp <= cfg.num_kv_heads:
        per = cfg.num_kv_heads // tp
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank * cfg.num_kv_heads // tp
    return range(head, head + 1)


def shard_layer_sources(cfg: ModelConfig, sources: dict[str, list[torch.Tensor]],
                        tp_rank: int, tp: int) -> dict[str, list[torch.Tensor]]:
    """One layer's parameter sources (Architecture.layer_sources of the whole model:
    per parameter, the tensors that stacked along dim 0 give it) narrowed to the rank's
    slice, so that stacking them gives the rank's parameter."""
    if tp == 1:
        return sources
    d, heads = cfg.head_dim, cfg.num_heads // tp
    q_rows = (tp_rank * heads * d, heads * d)
    kv = kv_heads(cfg, tp, tp_rank)
    kv_rows = (kv.start * d, len(kv) * d)
    out = {}
    for name, parts in sources.items():
        owner = name.rpartition(".")[0]
        if owner == "qkv":
            q, k, v = _split_fused(parts, [cfg.num_heads * d, cfg.num_kv_heads * d,
                                           cfg.num_kv_heads * d])
            out[name] = [q.narrow(0, *q_rows), k.narrow(0, *kv_rows), v.narrow(0, *kv_rows)]
        elif owner == "gate_up":
            if len(parts) == 1:  # gate and up shipped as one tensor (Phi-3)
                parts = list(parts[0].chunk(2, dim=0))
            out[name] = [_rows(p, tp_rank, tp) for p in parts]  # every gate and up part
        elif name == "o.weight":
            out[name] = [p.narrow(1, *q_rows) for p in parts]
        elif name == "down.weight":
            out[name] = [_rows(p, tp_rank, tp, dim=1) for p in parts]
        else:  # norms, the router, the row-parallel biases: whole
            out[name] = parts
    return out


def _split_fused(parts: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """q, k, v as three tensors, whether shipped apart or as one (Phi-3's qkv_proj)."""
    return list(parts) if len(parts) == len(sizes) else list(parts[0].split(sizes, dim=0))


def _rows(t: torch.Tensor, tp_rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    size = t.shape[dim] // tp
    return t.narrow(dim, tp_rank * size, size)


def shard_fixed_sources(cfg: ModelConfig, sources: dict[str, list[torch.Tensor]],
                        tp_rank: int, tp: int) -> dict[str, list[torch.Tensor]]:
    """The embedding and an untied head narrowed to the rank's vocabulary rows."""
    if tp == 1:
        return sources
    start, end = vocab_range(cfg.vocab_size, tp, tp_rank)
    return {name: [p.narrow(0, start, end - start) for p in parts]
            if name in ("embed", "lm_head.weight") else parts
            for name, parts in sources.items()}
