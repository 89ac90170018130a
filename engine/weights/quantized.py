"""Compressed weights: a linear whose weight stays in a compressed form (a GGUF file's
blocks, fusegen's group-quantized int8 / int4 codes; docs/quantization.md) from the file
to the product, expanded only inside the matmul, never into a dense copy of the layer.

- `CompressedSource`: one checkpoint weight in its compressed form, not read yet; a
  state-dict entry stored compressed carries one as its `.compressed` attribute (the
  entry itself still reads as a dense tensor, dequantized on use).
- `split_kept` decides, over the sources and the device alone, which of a layer's
  parameters stay compressed: a linear's weight whose parts share one format, one set
  of parameters and one in_features, with a kernel for them on that device (GGUF types:
  `gguf_kernel_types`). A fused parameter (q, k, v into `qkv`; gate,
  up into `gate_up`) stays compressed when its parts do: each part's component rows are
  whole weight rows, so stacking them along the output dimension stacks the weights.
- `CompressedLinear`: the `Linear` of a compressed weight; `GGUFLinear` here (the C
  kernels on CPUs, kernels/triton_quant.py's on CUDA GPUs), `GroupQuantLinear` in
  weights/groupquant.py, `FP8Linear` in weights/fp8.py. `keep_blocks` swaps a resident layer's
  Linears for them, `compress_shell` for empty ones whose tensors arrive per step.

The placement plan (compressed bytes per layer, `layer_nbytes`) and the load make the
same decision, from the same sources.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from fusegen.engine.weights.linear import Linear, row_tiled
from fusegen.kernels import _triton_available, use_native, use_triton
from fusegen.kernels.quant_linear import BLOCK_SIZES, SUPPORTED, has_kernel, quant_linear

FORMATS = ("gguf", "group", "fp8")
GROUP_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# int4 codes are packed two to a byte in runs of this many input channels
INT4_RUN = 32
# The GGUF types kernels/triton_quant.py's `_gguf_weights` decodes (Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): what GPUs keep as blocks. A type the C kernels gain
# stays dense on GPUs until the Triton kernel decodes it too.
TRITON_GGUF_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})


def gguf_kernel_types(device: str) -> frozenset[int]:
    """The GGUF types whose blocks a linear on `device` ("cpu", "cuda", "cuda:1",
    "cuda:0,1") multiplies as stored: the C kernels' (or their reference's) on CPUs,
    the Triton kernel's on CUDA GPUs where Triton is installed, none elsewhere."""
    if device == "cpu":
        return frozenset(SUPPORTED)
    if device.startswith("cuda") and _triton_available():
        return TRITON_GGUF_TYPES & SUPPORTED.keys()
    return frozenset()


def _gguf_block(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type."""
    if qtype in BLOCK_SIZES:
        return BLOCK_SIZES[qtype]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # types without a kernel

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def component_shapes(format: str, params: tuple, shape: tuple[int, int]
                     ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The components of a weight of dense `shape` [out, in] stored in `format` with
    `params`: name -> (dtype, shape), dim 0 the output rows."""
    out, inp = shape
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


def _block_values(format: str, params: tuple) -> int:
    """Input channels per block: the unit a weight's columns are split in."""
    if format == "fp8":
        return 1  # one scale per output row: any columns
    return _gguf_block(params[0])[0] if format == "gguf" else params[1]


@dataclass(frozen=True, slots=True)
class CompressedSource:
    """One checkpoint weight in its compressed form, not read yet.

    `format` "gguf": params (qtype,), components {"blocks": uint8 [out, row_bytes]};
    "group": params (bits, group_size, symmetric), components {"qweight", "scales", and
    "zeros" when asymmetric} (docs/quantization.md); "fp8": params (), components
    {"weight_fp8" e4m3 [out, in], "weight_scale" fp32 [out]}. `shape` is the dense weight's
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

    @classmethod
    def of(cls, format: str, params: tuple, shape: tuple[int, int], name: str, read
           ) -> "CompressedSource":
        """A whole stored weight; its bytes are its components'."""
        params, shape = tuple(params), tuple(int(s) for s in shape)
        return cls(format, params, shape, _nbytes(component_shapes(format, params, shape)),
                   name, read)

    def components(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return component_shapes(self.format, self.params, self.shape)

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
        columns only in whole blocks (GGUF's block, or the group size)."""
        if dim not in (0, 1):
            raise ValueError(f"{self.name}: a compressed weight narrows along dim 0 (output "
                             f"rows) or 1 (input columns), not {dim}")
        if start < 0 or length < 1 or start + length > self.shape[dim]:
            raise ValueError(f"{self.name}: [{start}, {start + length}) is outside dim {dim} "
                             f"of its {list(self.shape)} weight")
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
                            " + ".join(p.name for p in parts), read)


def kept_as_blocks(param: str, parts: list[tuple[int, tuple[int, ...]]],
                   device: str = "cpu") -> bool:
    """Whether a decoder layer's parameter `param` ("qkv.weight") made of GGUF tensors
    `parts` ((qtype, shape) each, in stacking order) keeps its blocks on `device`: a
    linear's 2-D weight whose parts all have one type its kernel takes
    (`gguf_kernel_types`) and one in_features."""
    qtypes = {int(qtype) for qtype, _ in parts}
    return (param.endswith(".weight") and len(qtypes) == 1
            and qtypes <= gguf_kernel_types(device)
            and all(len(shape) == 2 for _, shape in parts)
            and len({shape[1] for _, shape in parts}) == 1)


def can_keep(param: str, parts: list[CompressedSource], device: str = "cpu") -> bool:
    """Whether parameter `param` made of compressed `parts` stays compressed on `device`:
    a linear's weight whose parts share one format, its params and in_features, with a
    kernel."""
    if not param.endswith(".weight") or len({(p.format, p.params) for p in parts}) != 1:
        return False
    first = parts[0]
    if first.format == "gguf":
        return kept_as_blocks(param, [(p.params[0], p.shape) for p in parts], device)
    return (first.format in ("group", "fp8")
            and (first.format == "fp8" or first.params[0] in GROUP_BITS)
            and len({p.shape[1] for p in parts}) == 1)


def split_kept(sources: dict[str, list], device: str = "cpu"
               ) -> tuple[dict[str, list[CompressedSource]], dict]:
    """A layer's sources (`Architecture.layer_sources`) as (the parameters that stay
    compressed on `device`, the rest, loaded dense as always). A part without a
    `compressed` source (a float tensor, a type the reader serves only dense) keeps its
    parameter dense."""
    kept, dense = {}, {}
    for param, parts in sources.items():
        compressed = [getattr(t, "compressed", None) for t in parts]
        if None not in compressed and can_keep(param, compressed, device):
            kept[param] = compressed
        else:
            dense[param] = parts
    return kept, dense


def layer_nbytes(sources: dict[str, list], itemsize: int, device: str = "cpu") -> int:
    """One layer's weight bytes as loaded on `device`: the kept parameters' compressed
    components, the others dense at `itemsize` bytes a value (the placement plan's
    layer size)."""
    kept, dense = split_kept(sources, device)
    return (sum(part.nbytes for parts in kept.values() for part in parts)
            + sum(t.numel() for parts in dense.values() for t in parts) * itemsize)


def fuse_components(parts: list[CompressedSource], device) -> dict[str, torch.Tensor]:
    """A parameter's parts' components stacked along the output dimension, on `device`,
    always a copy (never a view of the file's memory map, so they count as the weights'
    own memory)."""
    loaded = [part.load() for part in parts]
    return {name: (torch.cat([p[name] for p in loaded]) if len(loaded) > 1
                   else loaded[0][name].clone()).to(device) for name in loaded[0]}


def fuse_blocks(parts: list[CompressedSource], device) -> torch.Tensor:
    """GGUF parts' block rows stacked: uint8 [sum of out_features, row_bytes]."""
    return fuse_components(parts, device)["blocks"]


def _linear_at(layer: torch.nn.Module, param: str) -> tuple[torch.nn.Module, str, Linear]:
    owner, _, _ = param.rpartition(".")
    parent_name, _, name = owner.rpartition(".")
    parent = layer.get_submodule(parent_name) if parent_name else layer
    linear = getattr(parent, name)
    if not isinstance(linear, Linear):
        raise TypeError(f"{param}: the layer's {owner} is a {type(linear).__name__}, "
                        "not a Linear; its weight cannot be kept compressed")
    return parent, name, linear


def linear_class(format: str, linear: Linear) -> type["CompressedLinear"]:
    """The compressed form of `linear` for `format`: an expert form for MoE experts."""
    from fusegen.engine.models.moe import ExpertLinear

    expert = isinstance(linear, ExpertLinear)
    if format == "group":
        from fusegen.engine.weights.groupquant import GroupQuantExpertLinear, GroupQuantLinear

        return GroupQuantExpertLinear if expert else GroupQuantLinear
    if format == "fp8" and not expert:
        from fusegen.engine.weights.fp8 import FP8Linear

        return FP8Linear
    if format == "gguf" and not expert:
        return GGUFLinear
    raise ValueError(f"no compressed {'expert ' if expert else ''}linear for format "
                     f"{format!r}")


def compress_shell(layer: torch.nn.Module, kept: dict[str, list[CompressedSource]]
                   ) -> dict[str, "CompressedLinear"]:
    """Replace each of `layer`'s Linears named in `kept` ("qkv.weight" -> `layer.qkv`) by
    an empty compressed linear (`CompressedLinear.shell`), carrying its bias flag and row
    tile; its components are set later (`set_weight`, a staging slot per step). Returns
    the new modules by parameter."""
    out = {}
    for param, parts in kept.items():
        parent, name, linear = _linear_at(layer, param)
        source = stack_sources(parts)
        module = linear_class(source.format, linear).shell(linear, source)
        setattr(parent, name, module)
        out[param] = module
    return out


def keep_blocks(layer: torch.nn.Module, kept: dict[str, list[CompressedSource]], device
                ) -> dict[str, torch.Tensor]:
    """Replace each of `layer`'s Linears named in `kept` by a compressed linear holding
    its fused components on `device` (the bias is set afterwards with the layer's other
    dense tensors). Returns the component tensors under "qkv.blocks", "qkv.qweight", ...
    (the names `set_weights` and staging slots use), for the memory report."""
    out = {}
    for param, module in compress_shell(layer, kept).items():
        owner = param.rpartition(".")[0]
        for name, tensor in fuse_components(kept[param], device).items():
            module.set_weight(name, tensor)
            out[f"{owner}.{name}"] = tensor
    return out


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


class GGUFLinear(CompressedLinear):
    """W held as `blocks` uint8 [out, row_bytes], each row one weight row's GGUF blocks
    of type `qtype`, multiplied by kernels/quant_linear.py (CPUs) or
    kernels/triton_quant.gguf_linear_triton (CUDA tensors, `on_triton`)."""
    components = ("blocks",)
    format = "gguf"

    @property
    def qtype(self) -> int:
        return self.params[0]

    @classmethod
    def from_blocks(cls, linear: Linear, blocks: torch.Tensor, qtype: int,
                    in_features: int) -> "GGUFLinear":
        source = CompressedSource.of("gguf", (int(qtype),), (blocks.shape[0], in_features),
                                     "blocks", lambda: {"blocks": blocks})
        kept = cls.shell(linear, source)
        kept.set_weight("blocks", blocks)
        return kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qtype = self.params[0]
        if on_triton(x, qtype):
            # The Triton kernel's tiles: batch-invariant ones (kernels/triton_quant.py)
            # in deterministic mode, so no row tiling is needed there.
            out = _triton().gguf_linear_triton(x, self.blocks, qtype, self.out_features,
                                               self.in_features,
                                               batch_invariant=self.row_tile is not None)
        elif self.row_tile is not None and not (use_native(x) and has_kernel(qtype, x.dtype)):
            # The C kernel sums each row in one order whatever the call's row count
            # (64-row calls past that), so it is batch-invariant as it is; the reference
            # (torch's GEMM) orders its sums by the call's shape: exactly `row_tile` rows
            # per call make a row's result independent of the rows batched with it.
            return row_tiled(x, self._matmul, self.out_features, self.bias, self.row_tile)
        else:
            out = quant_linear(x, self.blocks, qtype, self.out_features, self.in_features,
                               batch_invariant=self.row_tile is not None)
        if self.bias is not None:
            out += self.bias
        return out

    def _matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # rows [n, in] -> [n, out], no bias: one call of row_tiled's
        result = quant_linear(rows, self.blocks, self.qtype, self.out_features,
                              self.in_features)
        return result if out is None else out.copy_(result)


def on_triton(x: torch.Tensor, qtype: int) -> bool:
    """Whether a GGUFLinear multiplies `x` with the Triton kernel: a CUDA tensor where
    Triton is installed (or any under FUSEGEN_KERNELS=triton, the tests' interpreter;
    none under =reference: `use_triton`), and a type the kernel decodes; others take
    quant_linear (the C kernels on CPUs, the reference elsewhere)."""
    return qtype in TRITON_GGUF_TYPES and use_triton(x)


@functools.cache
def _triton():
    from fusegen.kernels import triton_quant  # imports Triton: only where it runs

    return triton_quant
