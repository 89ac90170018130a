"""fusegen's sparse weights (issue 32; the format: kernels/sparse_format.py and
docs/sparsity.md) at run time: `SparseLinear` and its MoE expert form hold a pruned
weight's bitmap tiles (bitmap, offsets, packed non-zeros, int8 scales) and multiply
through kernels/sparse_linear.py (the C kernel, else bands of row-tiles expanded at a
time: never a dense copy of the whole weight); `read_sparse_checkpoint`
serves a checkpoint's sparse linears (config.json's "sparsity_config") as compressed
entries, format "sparse".

A source's params are (values dtype name,); its `segments` are ((out_features, nnz), ...)
of the weights stacked in it: a fused parameter (q, k, v into `qkv`) keeps each part's
own tile table, one after the other in each component, so parts need not be whole
row-tiles and a staging slot stacks the parts' components as stored.
"""
from __future__ import annotations

import functools
import json
import os
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from fusegen.engine.errors import ModelLoadError
from fusegen.engine.weights.compressed import (NARROWED_BY, CompressedLinear, CompressedSource,
                                              expert_product, expert_shell, tile_product)
from fusegen.engine.weights.lazy import LazyTensor
from fusegen.engine.weights.linear import Linear, row_tiled

CONFIG_KEY = "sparsity_config"
FORMAT = "fusegen-bitmap-tiles"
VERSION = 1
TILE = (64, 64)
VALUES = ("bfloat16", "float16", "float32", "int8")
METHODS = ("magnitude", "wanda")
# checkpoint suffix -> component name in a SparseLinear and its staging slot
SUFFIXES = {".sparse_bitmap": "bitmap", ".sparse_offsets": "offsets",
            ".sparse_values": "values", ".sparse_scales": "scales"}


def _codec():
    from fusegen.kernels import sparse_format

    return sparse_format


@functools.cache
def _kernels():
    from fusegen.kernels import sparse_linear

    return sparse_linear


@dataclass(frozen=True, slots=True)
class SparseFormat:
    """A checkpoint's "sparsity_config": which weights are stored as bitmap tiles, and
    their values' dtype."""
    values: str
    sparsity: float
    method: str
    modules: tuple[str, ...]

    @property
    def name(self) -> str:
        return "sparse"  # the resolved quantization that keeps them (memory/shape.py)

    @property
    def params(self) -> tuple:
        return (self.values,)


def sparsity_config(model) -> SparseFormat | None:
    """The sparse format a checkpoint directory's config.json declares, or None.
    ModelLoadError naming the key and the value for a declaration fusegen cannot read."""
    path = Path(model) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    sc = raw.get(CONFIG_KEY) if isinstance(raw, dict) else None
    if sc is None:
        return None

    def bad(key, value, want):
        return ModelLoadError(f"{path}: {CONFIG_KEY}.{key} is {value!r}; {want}")

    if not isinstance(sc, dict):
        raise ModelLoadError(f"{path}: {CONFIG_KEY} is {sc!r}, not an object")
    if sc.get("format") != FORMAT:
        raise bad("format", sc.get("format"), f"fusegen reads {FORMAT!r}")
    if sc.get("version") != VERSION or isinstance(sc.get("version"), bool):
        raise bad("version", sc.get("version"), f"this fusegen reads version {VERSION}; "
                  "write the checkpoint again with this fusegen's `fusegen sparsify`")
    if list(sc.get("tile", ())) != list(TILE):
        raise bad("tile", sc.get("tile"), f"version {VERSION} tiles are {list(TILE)}")
    if sc.get("values") not in VALUES:
        raise bad("values", sc.get("values"), f"it must be one of {', '.join(VALUES)}")
    sparsity = sc.get("sparsity")
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) \
            or not 0 < sparsity < 1:
        raise bad("sparsity", sparsity, "it must be a number in (0, 1)")
    if sc.get("method") not in METHODS:
        raise bad("method", sc.get("method"), f"it must be one of {', '.join(METHODS)}")
    modules = sc.get("modules")
    if not isinstance(modules, list) or not modules or \
            not all(isinstance(m, str) for m in modules):
        raise bad("modules", modules, "it must be a non-empty list of weight names")
    repeated = sorted(m for m, n in Counter(modules).items() if n > 1)
    if repeated:
        raise ModelLoadError(f"{path}: {CONFIG_KEY}.modules lists {repeated[0]!r} more than "
                             "once; each sparse weight is listed once")
    return SparseFormat(sc["values"], float(sparsity), sc["method"], tuple(modules))


def read_sparse_checkpoint(tensors: dict[str, tuple[Path, torch.Tensor]],
                           expected: dict[str, tuple[int, ...]], fmt: SparseFormat,
                           model_dir: Path) -> dict[str, torch.Tensor]:
    """The sparse linears of a checkpoint as state-dict entries under their dense
    weights' names. `tensors`: the checkpoint's `NAME.sparse_*` tensors (name -> (file,
    tensor)), taken out of it here; `expected`: every weight name's dense shape. Each
    weight's tile table is checked (the codec's `check`: shapes, dtypes, offsets against
    the bitmaps' popcounts, bits past the edge), errors naming the file and tensor, once
    a process (`_check_once`: the plan reads the checkpoint, then the runner)."""
    codec = _codec()
    out = {}
    for module in fmt.modules:
        weight = module if module in expected else module + ".weight"
        shape = expected.get(weight)
        if shape is None or len(shape) != 2:
            raise ModelLoadError(f"{model_dir}: config.json's {CONFIG_KEY}.modules lists "
                                 f"{module!r}, which is no linear weight of this "
                                 "architecture with this config.json")
        parts, file = {}, None
        for suffix, component in SUFFIXES.items():
            if module + suffix in tensors:
                file, parts[component] = tensors.pop(module + suffix)
        for suffix in (".sparse_bitmap", ".sparse_offsets", ".sparse_values"):
            if SUFFIXES[suffix] not in parts:
                raise ModelLoadError(f"{model_dir}: tensor {module + suffix!r} is missing; "
                                     f"{weight!r} is listed in {CONFIG_KEY}.modules")
        tiles = codec.SparseTiles(parts["bitmap"], parts["offsets"], parts["values"],
                                  parts.get("scales"), *shape)
        _check_once(tiles, shape, file, weight)
        want = codec.VALUE_DTYPES[fmt.values]
        if tiles.values.dtype != want:
            raise ModelLoadError(
                f"{file}: tensor {module + '.sparse_values'!r} is {tiles.values.dtype}; "
                f"config.json's {CONFIG_KEY}.values says {fmt.values}")
        out[weight] = sparse_entry(shape, fmt.values, weight, tiles.nnz, partial(dict, parts))
    stray = sorted(n for n in tensors if n.endswith(tuple(SUFFIXES)))
    if stray:
        raise ModelLoadError(f"{tensors[stray[0]][0]}: tensor {stray[0]!r} belongs to no "
                             f"weight listed in config.json's {CONFIG_KEY}.modules")
    return out


_CHECKED: set[tuple] = set()  # tile tables found well-formed: (file, its identity, weight)


def _check_once(tiles, shape: tuple[int, int], file: Path, weight: str) -> None:
    """The codec's check of one weight's tile table in `file`, skipped where this process
    has checked that weight of the same file (same path, inode, size and change times)
    before. ModelLoadError naming the file, the weight, the component and the tile."""
    stat = os.stat(file)
    key = (str(file), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, weight,
           tuple(shape))
    if key in _CHECKED:
        return
    try:
        _codec().check(tiles, *shape)
    except ValueError as exc:
        raise ModelLoadError(f"{file}: sparse weight {weight!r} {list(shape)}: {exc}"
                             ) from None
    _CHECKED.add(key)


def sparse_entry(shape: tuple[int, int], values: str, name: str, nnz: int, read
                 ) -> torch.Tensor:
    """A state-dict entry for a sparse weight: a lazy tensor of the dense weight (fp32,
    decoded when used: quantization="dequantize", a layer left dense) carrying its tiles
    as `.compressed`."""
    source = CompressedSource.of("sparse", (values,), shape, name, read,
                                 segments=((int(shape[0]), int(nnz)),))
    entry = LazyTensor(tuple(shape), torch.float32, partial(_decoded, source))
    entry.compressed = source
    return entry


def _decoded(source: CompressedSource) -> torch.Tensor:
    return _codec().decode(_tiles(source.load(), source.shape[0], source.shape[1]))


def _tiles(parts: dict[str, torch.Tensor], out_features: int, in_features: int):
    return _codec().SparseTiles(parts["bitmap"], parts["offsets"], parts["values"],
                                parts.get("scales"), out_features, in_features)


def narrow_tiles(source: CompressedSource, dim: int, start: int, length: int
                 ) -> CompressedSource:
    """Rows (dim 0) or input columns (dim 1) [start, start + length) of one sparse weight
    (a tensor-parallel rank's slice) as a sparse weight of its own: the window's kept
    weights (the bitmaps' mask, kept zeros too) cut into tiles from its own origin, when
    read. Float values move as they are; int8 values are scaled again per new tile
    (the same codes where the window keeps whole tiles)."""
    if len(source.segments) != 1:
        raise ValueError(f"{source.name}: stacked sparse weights are narrowed part by part")
    out, inp = source.shape
    window = (slice(start, start + length), slice(None)) if dim == 0 else \
        (slice(None), slice(start, start + length))
    shape = (length, inp) if dim == 0 else (out, length)
    nnz = int(_mask(source.load(), out, inp)[window].sum())
    return CompressedSource.of("sparse", source.params, shape, source.name,
                               partial(_window_parts, source, window),
                               segments=((shape[0], nnz),))


NARROWED_BY["sparse"] = narrow_tiles


def _mask(parts: dict[str, torch.Tensor], out: int, inp: int) -> torch.Tensor:
    """The kept weights of a tile table: bool [out, in]."""
    n_to, n_ti = -(-out // TILE[0]), -(-inp // TILE[1])
    shifts = torch.arange(TILE[0], dtype=torch.int64)
    bits = (parts["bitmap"].view(torch.int64).unsqueeze(-1) >> shifts) & 1  # [t, c, j]
    grid = bits.bool().view(n_to, n_ti, TILE[1], TILE[0]).permute(0, 3, 1, 2)
    return grid.reshape(n_to * TILE[0], n_ti * TILE[1])[:out, :inp]


def _window_parts(source: CompressedSource, window) -> dict[str, torch.Tensor]:
    parts = source.load()
    out, inp = source.shape
    mask = _mask(parts, out, inp)[window]
    dense = _codec().decode(_tiles(parts, out, inp))[window]
    return _retile(dense, mask, source.params[0])


def _retile(dense: torch.Tensor, mask: torch.Tensor, values: str) -> dict[str, torch.Tensor]:
    """fp32 weights [out, in] and their kept mask as tile components (the format's order:
    tiles row-tile major, then local column, then local row)."""
    out, inp = dense.shape
    n_to, n_ti = -(-out // TILE[0]), -(-inp // TILE[1])

    def tiled(t):  # [out, in] -> [tiles, 64 columns, 64 rows], zero past the edge
        padded = t.new_zeros(n_to * TILE[0], n_ti * TILE[1])
        padded[:out, :inp] = t
        return (padded.view(n_to, TILE[0], n_ti, TILE[1]).permute(0, 2, 3, 1)
                .reshape(n_to * n_ti, TILE[1], TILE[0]))

    kept, w = tiled(mask), tiled(dense)
    shifts = torch.arange(TILE[0], dtype=torch.int64)
    bitmap = (kept.to(torch.int64) << shifts).sum(-1).view(torch.uint64)  # disjoint bits
    counts = kept.sum((1, 2))
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    flat = w[kept]
    if values != "int8":
        return {"bitmap": bitmap, "offsets": offsets,
                "values": flat.to(_codec().VALUE_DTYPES[values])}
    scales = torch.where(kept, w.abs(), 0.0).amax((1, 2)) / 127
    per = scales.repeat_interleave(counts)
    codes = torch.round(flat / torch.where(per > 0, per, 1.0)).clamp(-127, 127)
    return {"bitmap": bitmap, "offsets": offsets, "values": codes.to(torch.int8),
            "scales": scales}


def segment_tiles(components: dict[str, torch.Tensor | None],
                  segments: tuple[tuple[int, int], ...], in_features: int) -> list:
    """The stacked components of `segments` ((out, nnz) each, in order) as one
    `SparseTiles` a segment, views of `components` (no copy)."""
    codec = _codec()
    n_ti = -(-in_features // codec.TILE_IN)
    out, tile, value = [], 0, 0
    for i, (rows, nnz) in enumerate(segments):
        n = -(-rows // codec.TILE_OUT) * n_ti
        scales = components.get("scales")
        out.append(codec.SparseTiles(
            components["bitmap"][tile:tile + n],
            components["offsets"][tile + i:tile + i + n + 1],
            components["values"][value:value + nnz],
            None if scales is None else scales[tile:tile + n], rows, in_features))
        tile, value = tile + n, value + nnz
    return out


class SparseLinear(CompressedLinear):
    """W held as bitmap tiles: `bitmap` uint64 [tiles, 64], `offsets` int64 [tiles +
    segments], `values` [nnz] (bf16 / fp16 / fp32 / int8), `scales` fp32 [tiles] or None
    (not int8); params (values dtype name,), `segments` ((out, nnz) of each stacked
    weight, whose outputs are concatenated)."""
    components = ("bitmap", "offsets", "values", "scales")
    format = "sparse"

    def __init__(self, bias: bool = False):
        super().__init__(bias=bias)
        self.segments: tuple[tuple[int, int], ...] = ()
        self._views: list | None = None  # each segment's SparseTiles, until a set_weight

    @classmethod
    def shell(cls, linear: Linear, source: CompressedSource) -> "SparseLinear":
        module = super().shell(linear, source)
        module.segments = source.segments
        return module

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        super().set_weight(name, tensor)
        self._views = None  # new components (a staging slot's, each step): views anew

    def _parts(self) -> list:
        if self._views is None:
            self._views = segment_tiles({n: getattr(self, n) for n in self.components},
                                        self.segments, self.in_features)
        return self._views

    def _product(self, x: torch.Tensor, parts: list) -> torch.Tensor:
        """x [..., in] -> [..., sum of the parts' out]: the parts (a fused parameter's q,
        k, v, or gate and up) side by side in one output, one kernel call on CPUs."""
        if x.dim() == 2:  # the engine's rows [T, in]: no reshapes (a decode step's calls)
            return _kernels().sparse_linear_parts(x, parts)
        out = _kernels().sparse_linear_parts(x.reshape(-1, self.in_features), parts)
        return out.view(*x.shape[:-1], out.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._parts()
        if self.row_tile is not None:
            return row_tiled(x, partial(tile_product, partial(self._product, parts=parts)),
                             self.out_features, self.bias, self.row_tile)
        out = self._product(x, parts)
        if self.bias is not None:
            out += self.bias
        return out


class SparseExpertLinear(SparseLinear):
    """E experts' sparse weights stacked, as `ExpertLinear`'s: the segments are the
    experts' weights in turn (each expert's the same count: gate and up, or down);
    x [n, in] -> [n, out] through expert `expert`'s."""

    def __init__(self, bias: bool = False, num_experts: int = 1):
        super().__init__(bias=bias)
        self.num_experts = num_experts

    @classmethod
    def shell(cls, linear: Linear, source: CompressedSource) -> "SparseExpertLinear":
        return expert_shell(super().shell(linear, source), linear, source,
                            len(source.segments), "sparse weights")

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        per = len(self.segments) // self.num_experts
        parts = self._parts()[expert * per:(expert + 1) * per]
        return expert_product(x, partial(self._product, parts=parts), self.out_features,
                              self.row_tile)
