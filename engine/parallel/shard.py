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
A weight kept compressed (weights/quantized.py) is narrowed the same way as a
`CompressedSource`: rows are whole weight rows; input columns only in whole blocks
(GGUF's) or groups, so a split inside one is refused before loading (`shard_kept`).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from fusegen.engine.errors import EngineConfigError
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


def shard_layer_sources(cfg: ModelConfig, sources: dict[str, list], tp_rank: int,
                        tp: int) -> dict[str, list]:
    """One layer's parameter sources (Architecture.layer_sources of the whole model:
    per parameter, the parts that stacked along dim 0 give it) narrowed to the rank's
    slice, so that stacking them gives the rank's parameter. A part is a tensor or a
    compressed weight (weights/quantized.CompressedSource): only `shape` and `narrow`
    are used, so nothing is read here."""
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
                half = parts[0].shape[0] // 2
                parts = _split_fused(parts, [half, half])
            out[name] = [_rows(p, tp_rank, tp) for p in parts]  # every gate and up part
        elif name == "o.weight":
            out[name] = [p.narrow(1, *q_rows) for p in parts]
        elif name == "down.weight":
            out[name] = [_rows(p, tp_rank, tp, dim=1) for p in parts]
        else:  # norms, the router, the row-parallel biases: whole
            out[name] = parts
    return out


def _split_fused(parts: list, sizes: list[int]) -> list:
    """q, k, v as three parts, whether shipped apart or as one (Phi-3's qkv_proj)."""
    if len(parts) == len(sizes):
        return list(parts)
    if isinstance(parts[0], torch.Tensor):  # one read of a lazy tensor, not one a part
        return list(parts[0].split(sizes, dim=0))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [parts[0].narrow(0, start, size) for start, size in zip(starts, sizes)]


def _rows(t, tp_rank: int, tp: int, dim: int = 0):
    size = t.shape[dim] // tp
    return t.narrow(dim, tp_rank * size, size)


# The parameters split by input columns: a compressed one only in whole blocks.
_COLUMN_SPLIT = ("o.weight", "down.weight")


def shard_kept(cfg: ModelConfig, kept: dict[str, list], tp_rank: int, tp: int,
               index: int) -> dict[str, list]:
    """A layer's compressed parameters (`split_kept`'s first half) narrowed to the
    rank's slice. o and down split by input columns, which a compressed weight holds
    in blocks (GGUF's) or groups: a split inside one is refused, naming the layer, the
    block and tensor_parallel_size, before anything is read."""
    for name in _COLUMN_SPLIT:
        if tp > 1 and name in kept:
            part = kept[name][0]
            block, columns = block_columns(part), part.shape[1] // tp
            if columns % block:
                raise EngineConfigError(
                    f"tensor_parallel_size {tp} cannot split layer {index}'s {name} "
                    f"({part.name}): it is kept compressed ({_describe(part)}) in blocks of "
                    f"{block} input columns, and each rank would take {columns} of its "
                    f"{part.shape[1]}, which cuts a block; use a tensor_parallel_size that "
                    f"leaves each rank a multiple of {block} columns, or "
                    "quantization='dequantize'")
    return shard_layer_sources(cfg, kept, tp_rank, tp)


def block_columns(source) -> int:
    """Input columns per block of a compressed weight: a GGUF type's block, the group
    size, or 1 for FP8 (one scale per output row: any columns)."""
    from fusegen.engine.weights.quantized import _block_values

    return _block_values(source.format, source.params)


def _describe(source) -> str:
    if source.format == "gguf":
        from gguf import GGMLQuantizationType

        return f"GGUF {GGMLQuantizationType(source.params[0]).name}"
    if source.format == "fp8":
        return "FP8 e4m3, a scale per output row"
    bits, group_size, symmetric = source.params
    return f"int{bits}, groups of {group_size}{'' if symmetric else ', asymmetric'}"


@dataclasses.dataclass(frozen=True, slots=True)
class _Extent:
    """A dense tensor's shape alone, narrowed as the tensor would be (bytes counted,
    nothing read)."""
    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> "_Extent":
        return _Extent(self.shape[:dim] + (length,) + self.shape[dim + 1:])


def dense_numel(sources: dict[str, list]) -> int:
    """The values of parameter sources (lazy or narrowed tensors, or shapes alone), by
    their shapes: nothing read."""
    return sum(math.prod(part.shape) for parts in sources.values() for part in parts)


def rank_layer_nbytes(cfg: ModelConfig, sources: dict[str, list], tp: int, itemsize: int,
                      index: int, device: str = "cpu") -> int:
    """Layer `index`'s weight bytes on one rank of a tp-way split (every rank holds as
    many): its compressed parameters' components, the rest dense at `itemsize` bytes a
    value. Refuses a split inside a compressed weight's blocks (`shard_kept`). Sparse
    tiles hold each rank's own non-zeros: the largest rank's bytes."""
    from fusegen.engine.weights.quantized import split_kept

    kept, dense = split_kept(sources, device)
    ranks = range(tp) if any(p.format == "sparse" for ps in kept.values() for p in ps) \
        else range(1)
    kept_bytes = max(sum(part.nbytes for parts in shard_kept(cfg, kept, r, tp, index).values()
                         for part in parts) for r in ranks)
    dense = shard_layer_sources(cfg, {name: [_Extent(tuple(t.shape)) for t in parts]
                                      for name, parts in dense.items()}, 0, tp)
    return kept_bytes + sum(math.prod(e.shape) for parts in dense.values()
                            for e in parts) * itemsize


def shard_fixed_sources(cfg: ModelConfig, sources: dict[str, list], tp_rank: int,
                        tp: int) -> dict[str, list]:
    """The embedding and an untied head narrowed to the rank's vocabulary rows."""
    if tp == 1:
        return sources
    start, end = vocab_range(cfg.vocab_size, tp, tp_rank)
    return {name: [p.narrow(0, start, end - start) for p in parts]
            if name in ("embed", "lm_head.weight") else parts
            for name, parts in sources.items()}


# -- the Tesseract grid (tensor_parallel_mode 2d / 2.5d; engine/parallel/tesseract.py) --

def grid_model_config(cfg: ModelConfig, q: int) -> ModelConfig:
    """The model one rank of a [q, q, d] grid runs: heads block j (H / q query heads,
    K / q KV heads) and intermediate block j of the MLP; the hidden size stays whole
    (each rank holds its depth layer's residual stream whole, so norms run as they are);
    a mixture of experts: block j of every expert's intermediate size, all E experts."""
    if q == 1:
        return cfg
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // q,
                               num_kv_heads=cfg.num_kv_heads // q,
                               intermediate_size=cfg.intermediate_size // q,
                               moe_intermediate_size=cfg.moe_intermediate_size // q)


def grid_layer_sources(cfg: ModelConfig, sources: dict[str, list], q: int, i: int,
                       j: int) -> dict[str, list]:
    """One layer's parameter sources narrowed to rank (i, j, *)'s weight blocks:
    - q/k/v and gate/up: outputs of block j (heads block j of each of q, k, v; rows
      block j of each of gate and up), inputs (hidden columns) of block i; their biases
      the outputs of block j;
    - o and down: outputs (hidden rows) of block i, inputs of block j (heads block j;
      intermediate block j); their biases whole (added once, after the sums);
    - a mixture of experts: each expert's gate, up and down parts cut as the dense
      MLP's, the router whole;
    - norms (and per-head q/k norms) whole.
    Parts are narrowed, never read (as `shard_layer_sources`)."""
    if q == 1:
        return sources
    d, h = cfg.head_dim, cfg.hidden_size
    heads, kv_heads = cfg.num_heads // q, cfg.num_kv_heads // q
    hidden = (i * h // q, h // q)
    q_rows, kv_rows = (j * heads * d, heads * d), (j * kv_heads * d, kv_heads * d)
    out = {}
    for name, parts in sources.items():
        owner, _, kind = name.rpartition(".")
        if owner == "qkv":
            q_, k_, v_ = _split_fused(parts, [cfg.num_heads * d, cfg.num_kv_heads * d,
                                              cfg.num_kv_heads * d])
            cut = [q_.narrow(0, *q_rows), k_.narrow(0, *kv_rows), v_.narrow(0, *kv_rows)]
            out[name] = [p.narrow(1, *hidden) for p in cut] if kind == "weight" else cut
        elif owner == "gate_up":
            if len(parts) == 1:  # gate and up shipped as one tensor (Phi-3)
                half = parts[0].shape[0] // 2
                parts = _split_fused(parts, [half, half])
            cut = [_rows(p, j, q) for p in parts]
            out[name] = [p.narrow(1, *hidden) for p in cut] if kind == "weight" else cut
        elif name == "o.weight":
            out[name] = [p.narrow(0, *hidden).narrow(1, *q_rows) for p in parts]
        elif name == "down.weight":
            out[name] = [_rows(p.narrow(0, *hidden), j, q, dim=1) for p in parts]
        else:  # norms, the router, o's and down's biases: whole
            out[name] = parts
    return out
