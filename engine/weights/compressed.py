"""A weight kept in a compressed form: `CompressedSource` (one checkpoint weight as
stored, not read yet: a GGUF file's blocks, fusegen's group-quantized int8 / int4 codes,
FP8 codes, fusegen's sparse bitmap tiles; docs/quantization.md, docs/sparsity.md) and
`CompressedLinear`, the base of the `Linear`s that multiply such a weight as stored.

A state-dict entry stored compressed carries its source as `.compressed` (the entry itself
still reads as a dense tensor, dequantized on use). The format modules (weights/gguf.py,
groupquant.py, fp8.py) build sources and subclass `CompressedLinear`; weights/quantized.py
decides which parameters stay compressed and swaps a layer's Linears for them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from fusegen.engine.weights.linear import Linear, row_tiled
from fusegen.kernels.quant_linear import BLOCK_SIZES

FORMATS = ("gguf", "group", "fp8", "sparse")
GROUP_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# int4 codes are packed two to a byte in runs of this many input channels
INT4_RUN = 32


def _gguf_block(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type."""
    if qtype in BLOCK_SIZES:
        return BLOCK_SIZES[qtype]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # types without a kernel

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


_SPARSE_VALUES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                  "float32": torch.float32, "int8": torch.int8}
SPARSE_TILE = 64  # output rows and input columns of a sparse tile (kernels/sparse_format.py)


def component_shapes(format: str, params: tuple, shape: tuple[int, int],
                     segments: tuple[tuple[int, int], ...] = ()
                     ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The components of a weight of dense `shape` [out, in] stored in `format` with
    `params`: name -> (dtype, shape), dim 0 the output rows (sparse tiles: dim 0 the
    tiles, then the values; their sizes follow the `segments`' (out, nnz))."""
    out, inp = shape
    if format == "sparse":
        return _sparse_shapes(params[0], inp, segments)
    if format == "gguf":
        block, block_bytes = _gguf_block(params[0])
        return {"blocks": (torch.uint8, (out, inp // block * block_bytes))}
    if format == "group":
        bits, group_size, symmetric = params
        shapes = {"qweight": (torch.uint8, (out, inp if bits == 8 else inp // 2)),
                  "scales": (torch.float16, (out, inp // group_size))}
        if not symmetric:
            shapes["zeros"] = (torch.uint8, (out, inp // group_size))
        return shapes
    if format == "fp8":  # quantized on load (weights/fp8.py): e4m3 codes, a scale a row
        return {"weight_fp8": (torch.float8_e4m3fn, (out, inp)),
                "weight_scale": (torch.float32, (out,))}
    raise ValueError(f"compressed format {format!r}; fusegen keeps {', '.join(FORMATS)}")


def _sparse_shapes(values: str, inp: int, segments: tuple[tuple[int, int], ...]
                   ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Sparse components of the stacked weights `segments` ((out, nnz) each): every
    weight its own tile table, one after another (offsets: tiles + 1 a weight)."""
    col_tiles = -(-inp // SPARSE_TILE)
    tiles = sum(-(-rows // SPARSE_TILE) * col_tiles for rows, _ in segments)
    shapes = {"bitmap": (torch.uint64, (tiles, 64)),
              "offsets": (torch.int64, (tiles + len(segments),)),
              "values": (_SPARSE_VALUES[values], (sum(nnz for _, nnz in segments),))}
    if values == "int8":
        shapes["scales"] = (torch.float32, (tiles,))
    return shapes


def _block_values(format: str, params: tuple) -> int:
    """Input channels per block: the unit a weight's columns are split in."""
    if format in ("fp8", "sparse"):
        return 1  # one scale per output row, or tiles re-cut on narrowing: any columns
    return _gguf_block(params[0])[0] if format == "gguf" else params[1]


# format -> how a window of one of its weights becomes a source of its own, for formats
# whose windows are no views of the stored components (weights/sparse.py fills "sparse":
# its sources exist only once that module has built them).
NARROWED_BY: dict[str, Callable] = {}


@dataclass(frozen=True, slots=True)
class CompressedSource:
    """One checkpoint weight in its compressed form, not read yet.

    `format` "gguf": params (qtype,), components {"blocks": uint8 [out, row_bytes]};
    "group": params (bits, group_size, symmetric), components {"qweight", "scales", and
    "zeros" when asymmetric} (docs/quantization.md); "fp8": params (), components
    {"weight_fp8" e4m3 [out, in], "weight_scale" fp32 [out]}; "sparse": params (values
    dtype name,), components {"bitmap", "offsets", "values", and "scales" with int8
    values}, one tile table per weight in `segments` ((out, nnz) each: weights/sparse.py,
    docs/sparsity.md). `shape` is the dense weight's
    [out, in]; `read()` returns the whole stored weight's components (rows in Hugging
    Face order), `window` the (row start, rows, column start, columns) of it this source
    is (`narrow`)."""
    format: str
    params: tuple
    shape: tuple[int, int]  # the dense weight's [out_features, in_features]
    nbytes: int
    name: str  # the checkpoint tensor's name, for errors
    read: object = dataclasses.field(repr=False, default=None)  # () -> {name: tensor}
    window: tuple[int, int, int, int] | None = None
    # "sparse": (out_features, nnz) of each weight stacked in it (weights/sparse.py)
    segments: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, format: str, params: tuple, shape: tuple[int, int], name: str, read,
           segments: tuple[tuple[int, int], ...] = ()) -> "CompressedSource":
        """A whole stored weight; its bytes are its components'."""
        params, shape = tuple(params), tuple(int(s) for s in shape)
        return cls(format, params, shape, _nbytes(component_shapes(format, params, shape,
                                                                   segments)),
                   name, read, segments=tuple(segments))

    def components(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return component_shapes(self.format, self.params, self.shape, self.segments)

    def load(self) -> dict[str, torch.Tensor]:
        """The components, each [rows, ...] with dim 0 the output rows (views of the
        file where the reader hands views: copy before keeping them)."""
        parts = self.read()
        if self.window is None:
            return parts
        row, rows, col, cols = self.window
        return {name: t[row:row + rows] if t.dim() == 1 else
                t[row:row + rows, _columns(self.format, self.params, name, col, cols)]
                for name, t in parts.items()}

    def narrow(self, dim: int, start: int, length: int) -> "CompressedSource":
        """Rows (dim 0) or input columns (dim 1) [start, start + length) of the weight;
        columns only in whole blocks (GGUF's block, or the group size); a sparse weight's
        window is cut into tiles of its own (weights/sparse.py `narrow_tiles`)."""
        if dim not in (0, 1):
            raise ValueError(f"{self.name}: a compressed weight narrows along dim 0 (output "
                             f"rows) or 1 (input columns), not {dim}")
        if start < 0 or length < 1 or start + length > self.shape[dim]:
            raise ValueError(f"{self.name}: [{start}, {start + length}) is outside dim {dim} "
                             f"of its {list(self.shape)} weight")
        if self.format in NARROWED_BY:  # e.g. sparse: re-tiled from the window when read
            return NARROWED_BY[self.format](self, dim, start, length)
        block = _block_values(self.format, self.params)
        if dim == 1 and (start % block or length % block):
            raise ValueError(
                f"{self.name}: its {self.format} weight keeps input columns in blocks of "
                f"{block}; the split [{start}, {start + length}) cuts one (use a split whose "
                f"columns are multiples of {block})")
        row, rows, col, cols = self.window or (0, self.shape[0], 0, self.shape[1])
        window = (row + start, length, col, cols) if dim == 0 else (row, rows, col + start,
                                                                     length)
        shape = (length, self.shape[1]) if dim == 0 else (self.shape[0], length)
        return dataclasses.replace(self, shape=shape, window=window, nbytes=_nbytes(
            component_shapes(self.format, self.params, shape)))


def _columns(format: str, params: tuple, component: str, start: int, length: int) -> slice:
    """The columns of `component` that hold input channels [start, start + length)
    (whole blocks or groups: `narrow` checked)."""
    if format == "gguf":
        block, block_bytes = _gguf_block(params[0])
        return slice(start // block * block_bytes, (start + length) // block * block_bytes)
    if format == "fp8":
        return slice(start, start + length)
    bits, group_size, _ = params
    per = (1 if bits == 8 else 2) if component == "qweight" else group_size
    return slice(start // per, (start + length) // per)


def _nbytes(shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> int:
    total = 0
    for dtype, shape in shapes.values():
        count = 1
        for size in shape:
            count *= size
        total += count * dtype.itemsize
    return total


def stack_sources(parts: list[CompressedSource]) -> CompressedSource:
    """A fused parameter's parts as one source: their component rows stacked along the
    output dimension (one format, params and in_features, `split_kept` checked)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]

    def read():
        loaded = [part.load() for part in parts]
        return {name: torch.cat([p[name] for p in loaded]) for name in loaded[0]}

    shape = (sum(p.shape[0] for p in parts), first.shape[1])
    return CompressedSource(first.format, first.params, shape, sum(p.nbytes for p in parts),
                            " + ".join(p.name for p in parts), read,
                            segments=sum((p.segments for p in parts), ()))


class CompressedLinear(Linear):
    """x [T, in] -> x @ W.T + bias [T, out], W held as its compressed `components`
    (each [out, ...]), bias [out] dense; `weight` is None (no dense weight exists)."""
    components: tuple[str, ...] = ()
    format: str = ""

    def __init__(self, bias: bool = False):
        super().__init__(bias=bias)
        self.weight = None
        for name in self.components:
            setattr(self, name, None)
        self.params: tuple = ()
        self.out_features = self.in_features = 0

    @classmethod
    def shell(cls, linear: Linear, source: CompressedSource) -> "CompressedLinear":
        """`linear`'s compressed form for `source` (its whole fused weight), no component
        set yet; it keeps `linear`'s bias (flag and tensor) and row tile."""
        if source.format != cls.format:
            raise ValueError(f"{source.name}: a {source.format} weight, not {cls.format}")
        module = cls(bias=linear.bias is not None)
        module.bias = linear.bias
        module.row_tile = linear.row_tile
        module.params = source.params
        module.out_features, module.in_features = source.shape
        return module

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Point component `name` (or "bias") at `tensor`, shared, not copied."""
        if name != "bias" and name not in self.components:
            raise ValueError(f"a {type(self).__name__} holds {', '.join(self.components)} "
                             f"and bias; it has no {name!r} (its weight is stored compressed)")
        if name == "bias":
            super().set_weight(name, tensor)
        else:
            setattr(self, name, tensor)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (*(getattr(self, n) for n in self.components), self.bias) if t is not None)


def expert_shell(module: CompressedLinear, linear: Linear, source: CompressedSource,
                 units: int = 0, what: str = "") -> CompressedLinear:
    """An expert Linear's shell (`module`, from CompressedLinear.shell over `source`, the E
    experts' weights stacked) given `linear`'s expert count and one expert's rows as
    out_features; a ValueError naming `source` where its rows (or its `units`, `what`
    they are, such as sparse weights) do not split evenly into the experts."""
    module.num_experts = experts = linear.num_experts
    if units % experts or source.shape[0] % experts:
        counted = f"{units} {what} of " if what else ""
        raise ValueError(f"{source.name}: {counted}{source.shape[0]} rows do not split "
                         f"into {experts} experts")
    module.out_features = source.shape[0] // experts  # one expert's
    return module


def expert_product(x: torch.Tensor, product, out_features: int,
                   row_tile: int | None) -> torch.Tensor:
    """x [n, in] -> product(x) [n, out_features], one expert's rows (no bias): in calls of
    `row_tile` rows where one is set (row_tiled), so each output sums in one order."""
    if row_tile is not None:
        return row_tiled(x, partial(tile_product, product), out_features, None, row_tile)
    return product(x)


def tile_product(product, rows: torch.Tensor, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """row_tiled's matmul over `product`: product(rows), copied into `out` where given."""
    result = product(rows)
    return result if out is None else out.copy_(result)
