"""A checkpoint pruned and written in fusegen's sparse format (`fusegen sparsify`;
the format: kernels/sparse_format.py, docs/sparsify.md).

Unstructured pruning, per output row: every decoder-layer linear (attention q/k/v/o,
gate/up/down, every MoE expert's) keeps in each row exactly
`kept_count(in_features, sparsity)` weights, those of the highest score:
- magnitude: |w|;
- wanda: |w| * ||x_k||_2, the L2 norm of input channel k over every calibration token
  that reached the linear (an expert's: the tokens routed to it), recorded through
  fusegen's engine by engine/weights/awq.py's `calibrate`. An expert no calibration
  token was routed to is pruned by magnitude, and the report says so.
Equal scores keep the lower input column. The router, embeddings, head and norms stay
dense. The kept weights are written as tiles (bitmap, offsets, values in the run dtype
or int8 with per-tile scales) through quantize.py's writer.

The source is a 16-bit / fp32 checkpoint directory or a GGUF file, opened as `fusegen
quantize` opens it (quantize.py's `open_source`): a GGUF file's tensors are dequantized
to fp32 when read, scored and pruned on those values, and written in bf16 (the kept
values too, unless --values says otherwise), with the config and tokenizer made from
its metadata.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import torch

from fusegen.engine.models import get_architecture
from fusegen.engine.weights.quantize import (MAX_SHARD_BYTES, Planned, check_output,
                                             open_source, quantized_tensors, write_checkpoint)
from fusegen.engine.weights.quantize_spec import QUANTIZED_PARAMS, QuantizeError, Report, Source

METHODS = ("magnitude", "wanda")
# --values: the name on the command line -> the name in the config entry
VALUES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int8": "int8"}
_SOURCE_VALUES = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                  torch.float32: "float32"}
_ROW_BAND = 1024  # rows scored and ranked at once: bounds the memory on wide linears
# Tiles encoded while planning the files are kept for writing them, up to this many
# bytes; past it a linear is pruned and encoded again when written.
_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class SparsifySpec:
    sparsity: float  # the fraction of each row's weights pruned, in (0, 1)
    method: str = "magnitude"  # magnitude: |w|; wanda: |w| * ||x||_2
    values: str | None = None  # bf16 / fp16 / fp32 / int8; None: the source's dtype

    def __post_init__(self):
        if not 0 < self.sparsity < 1:
            raise QuantizeError(f"sparsity must be between 0 and 1 (exclusive): the "
                                f"fraction of each row's weights pruned, got {self.sparsity!r}",
                                "sparsity")
        if self.method not in METHODS:
            raise QuantizeError(f"method must be magnitude or wanda, got {self.method!r}",
                                "method")
        if self.values is not None and self.values not in VALUES:
            raise QuantizeError(f"values must be bf16, fp16, fp32 or int8, got "
                                f"{self.values!r}", "values")


def kept_count(in_features: int, sparsity: float) -> int:
    """The weights a row of `in_features` keeps: (1 - sparsity) * in_features rounded
    to the nearest integer, a half to the even one, computed exactly on the sparsity as
    written in decimal (0.3 is 3/10, not the float nearest it)."""
    return round((1 - Fraction(repr(float(sparsity)))) * in_features)


def prune_rows(w: torch.Tensor, scores: torch.Tensor, kept: int) -> torch.Tensor:
    """w [out, in] with all but each row's `kept` highest `scores` [out, in] (finite,
    >= 0) set to 0; of equal scores the lower column is kept. fp32."""
    pruned = torch.zeros(w.shape, dtype=torch.float32)
    # Each score's fp32 bits (ordered as the non-negative floats are) above its column
    # counted from the right: every key distinct, equal scores ranked by column.
    columns = torch.arange(w.shape[1] - 1, -1, -1, dtype=torch.int64)
    for start in range(0, w.shape[0], _ROW_BAND):
        band = slice(start, start + _ROW_BAND)
        bits = scores[band].float().contiguous().view(torch.int32).to(torch.int64)
        keep = torch.topk((bits << 32) | columns, kept, dim=1, sorted=False).indices
        pruned[band].scatter_(1, keep, w[band].float().gather(1, keep))
    return pruned


@dataclass(slots=True)
class SparseReport(Report):
    """`Report`, and per linear (dense weight name) its bytes dense (the source's dtype)
    and in the sparse form (the codec's `nbytes`)."""
    layers: dict[str, tuple[int, int]] = field(default_factory=dict)
    dense_dtype: str = ""  # the source linears' dtype (float32, bfloat16, ...)
    values: str = ""  # the sparse values' dtype, as the config entry names it
    # wanda: the expert linears pruned by magnitude, no calibration token routed there
    by_magnitude: list[str] = field(default_factory=list)


class SparseForm:
    """The sparse form of quantize.py's writer: each decoder linear pruned per row and
    written as NAME.sparse_bitmap / .sparse_offsets / .sparse_values (/ .sparse_scales)."""

    def __init__(self, spec: SparsifySpec, values: str, modules: dict[str, int],
                 norms: dict[str, torch.Tensor], report: SparseReport,
                 out_dtype: torch.dtype | None = None):
        self.spec, self.values, self.modules = spec, values, modules
        self.out_dtype = out_dtype  # the source's `out_dtype`: bf16 for a GGUF file
        self.norms, self.report = norms, report  # norms: wanda's ||x|| per linear [in]
        self._planned_tiles, self._cached_bytes = {}, 0  # planned, kept to be written

    def pruned(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The weight [out, in] pruned (fp32, the pruned ones 0)."""
        w = weight.float()
        if not torch.isfinite(w).all():
            raise QuantizeError(f"tensor {name!r} holds inf or NaN; it cannot be pruned",
                                "model")
        scores = w.abs()
        if name in self.norms:
            scores = scores * self.norms[name]
        return prune_rows(w, scores, kept_count(w.shape[1], self.spec.sparsity))

    def _encoded(self, name: str, weight: torch.Tensor):
        from fusegen.kernels import sparse_format

        pruned = self.pruned(name, weight)
        tiles = sparse_format.encode(pruned, self.values)
        if tiles.values.is_floating_point() and not torch.isfinite(tiles.values).all():
            # finite weights turned inf: past the values dtype's range (float16's 65504)
            row, column = divmod(int(pruned.abs().argmax()), pruned.shape[1])
            raise QuantizeError(
                f"tensor {name!r} keeps the weight {float(pruned[row, column])!r} (row {row}, "
                f"column {column}), past {self.values}'s range "
                f"(largest {torch.finfo(tiles.values.dtype).max:g}); choose --values bf16, "
                "fp32 or int8", "values")
        return tiles

    def planned(self, name: str, source: Source) -> Planned:
        from fusegen.kernels import sparse_format

        tiles = self._encoded(name, source.read(name))
        nbytes = sparse_format.nbytes(tiles)
        self.report.layers[name] = (source.nbytes(name), nbytes)
        if self._cached_bytes + nbytes <= _CACHE_BYTES:
            self._planned_tiles[name] = tiles
            self._cached_bytes += nbytes
        return [(key, tuple(t.shape), t.dtype)
                for key, t in sparse_format.tensors(name, tiles).items()]

    def produce(self, name: str, weight: torch.Tensor) -> list[torch.Tensor]:
        from fusegen.kernels import sparse_format

        tiles = self._planned_tiles.pop(name, None)
        if tiles is None:
            tiles = self._encoded(name, weight)
        return list(sparse_format.tensors(name, tiles).values())

    def config_entries(self) -> dict:
        from fusegen.kernels import sparse_format

        return {"sparsity_config": {
            "format": sparse_format.FORMAT, "version": sparse_format.VERSION,
            "tile": [sparse_format.TILE_OUT, sparse_format.TILE_IN], "values": self.values,
            "sparsity": self.spec.sparsity, "method": self.spec.method,
            "modules": sorted(self.modules)}}


class PrunedDense(SparseForm):
    """The pruned weights written dense, in the dtype the source's other tensors are
    written in (a GGUF file's: bf16), with no config entry: the same model as the
    sparse checkpoint, to compare it against."""

    def planned(self, name: str, source: Source) -> Planned:
        tensor = source.tensors[name]
        return [(name, tuple(tensor.shape), self.out_dtype or tensor.dtype)]

    def produce(self, name: str, weight: torch.Tensor) -> list[torch.Tensor]:
        return [self.pruned(name, weight).to(self.out_dtype or weight.dtype)]

    def config_entries(self) -> dict:
        return {}


def sparsify_checkpoint(model, output, spec: SparsifySpec, *,
                        prompts: list[str] | None = None, overwrite: bool = False,
                        max_shard_bytes: int = MAX_SHARD_BYTES, dense: bool = False
                        ) -> SparseReport:
    """Write `model` (a 16-bit / fp32 checkpoint directory or a GGUF file) pruned by
    `spec` into the directory `output`; `prompts`: wanda's calibration prompts;
    `dense`: the pruned weights written dense instead (`PrunedDense`). QuantizeError,
    naming the option, for a bad input, before anything is written (an output that
    cannot be made: before the calibration pass; `overwrite` replaces only a checkpoint
    or an empty folder); nothing is written at `output` then, nor when interrupted."""
    output = Path(output)
    if spec.method == "wanda" and not prompts:
        raise QuantizeError("method wanda needs calibration prompts (--calibration)",
                            "calibration")
    if spec.method == "magnitude" and prompts:
        raise QuantizeError("calibration prompts are used only by method wanda "
                            "(--method wanda)", "calibration")
    source = open_source(Path(model), "sparsify")
    modules = quantized_tensors(source.cfg)
    dense_dtype = source.out_dtype or source.tensors[next(iter(modules))].dtype
    values = VALUES[spec.values] if spec.values else _source_values(dense_dtype)
    for name, in_features in modules.items():
        if kept_count(in_features, spec.sparsity) == 0:
            raise QuantizeError(f"sparsity {spec.sparsity} keeps no weight of tensor "
                                f"{name!r}'s rows of {in_features}; choose a lower one",
                                "sparsity")
    check_output(output, source.path, overwrite)
    report = SparseReport(output, dense_dtype=str(dense_dtype).removeprefix("torch."),
                          values=values)
    norms = wanda_norms(source, prompts, report) if spec.method == "wanda" else {}
    form = (PrunedDense if dense else SparseForm)(spec, values, modules, norms, report,
                                                  source.out_dtype)
    write_checkpoint(source, output, form, report, max_shard_bytes=max_shard_bytes)
    return report


def _source_values(dtype: torch.dtype) -> str:
    """The values' dtype by default: the one the source's linears are written in."""
    if dtype not in _SOURCE_VALUES:
        raise QuantizeError(f"the source's linears are {dtype}; choose the values' dtype "
                            "with --values bf16|fp16|fp32|int8", "values")
    return _SOURCE_VALUES[dtype]


def wanda_norms(source: Source, prompts: list[str], report: SparseReport
                ) -> dict[str, torch.Tensor]:
    """Each decoder linear's (checkpoint name) input L2 norm per channel [in] over the
    calibration prompts, run through fusegen's engine. The linears fused into one
    engine op (q/k/v, gate/up) share their input's norms; an MoE expert's are over the
    tokens routed to it (an expert without any: left out, and listed in the report)."""
    from fusegen.engine.weights.awq import calibrate

    inputs = calibrate(source, prompts)
    cfg, arch = source.cfg, get_architecture(source.cfg.architecture)
    specs = [(name, shape, param) for name, shape, param in arch.layer_tensors(cfg)
             if param in QUANTIZED_PARAMS]
    offsets, used = {}, {}  # each tensor's first row in its fused parameter
    for name, shape, param in specs:
        offsets[name] = used.get(param, 0)
        used[param] = offsets[name] + shape[0]
    norms = {}
    for i in range(cfg.num_layers):
        for name, _, param in specs:
            group = param.removesuffix(".weight")
            expert = None
            if cfg.num_experts and group in ("gate_up", "down"):
                expert = offsets[name] // (used[param] // cfg.num_experts)
            full = arch.layer_prefix.format(i) + name
            recorded = inputs.get((i, group, expert))
            if recorded is None:
                report.by_magnitude.append(full)
            else:
                norms[full] = recorded.l2_norm
    return norms

