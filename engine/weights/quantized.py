"""Compressed weights: a linear whose weight stays in a compressed form (a GGUF file's
blocks, fusegen's group-quantized int8 / int4 codes; docs/quantization.md) from the file
to the product, expanded only inside the matmul, never into a dense copy of the layer.

- `CompressedSource` (weights/compressed.py): one checkpoint weight in its compressed
  form, not read yet; a state-dict entry stored compressed carries one as its
  `.compressed` attribute (the entry itself still reads as a dense tensor, dequantized
  on use).
- `split_kept` decides, over the sources and the device alone, which of a layer's
  parameters stay compressed: a linear's weight whose parts share one format, one set
  of parameters and one in_features, with a kernel for them on that device (GGUF types:
  `gguf_kernel_types`). A fused parameter (q, k, v into `qkv`; gate,
  up into `gate_up`) stays compressed when its parts do: each part's component rows are
  whole weight rows, so stacking them along the output dimension stacks the weights.
- `CompressedLinear`: the `Linear` of a compressed weight; `GGUFLinear` here (the C
  kernels on CPUs, kernels/triton_quant.py's on CUDA GPUs), `GroupQuantLinear` in
  weights/groupquant.py, `FP8Linear` in weights/fp8.py, `SparseLinear` (bitmap tiles)
  in weights/sparse.py. `keep_blocks` swaps a resident layer's
  Linears for them, `compress_shell` for empty ones whose tensors arrive per step.

The placement plan (compressed bytes per layer, `layer_nbytes`) and the load make the
same decision, from the same sources.
"""
from __future__ import annotations

import functools

import torch

from fusegen.engine.weights.compressed import (GROUP_BITS, CompressedLinear, CompressedSource,
                                              stack_sources)
from fusegen.engine.weights.compressed import _block_values  # noqa: F401 - parallel/shard.py's
from fusegen.engine.weights.fp8 import FP8Linear
from fusegen.engine.weights.groupquant import GroupQuantExpertLinear, GroupQuantLinear
from fusegen.engine.weights.linear import Linear, row_tiled
from fusegen.engine.weights.sparse import SparseExpertLinear, SparseLinear
from fusegen.kernels import _triton_available, kernels_mode, use_native, use_triton
from fusegen.kernels.quant_linear import SUPPORTED, has_kernel, quant_linear
from fusegen.kernels.quant_vnni import (pack_blocks, q8_packed_available, quant_linear_q8_packed,
                                        unpack_blocks)

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
    if first.format == "sparse":  # each part keeps its own tile table (weights/sparse.py)
        # kernels/sparse_linear.py multiplies CPU tensors, and CUDA ones by Triton
        # (kernels/triton_sparse.py; its torch path reads CPU tiles only); elsewhere
        # decoded as it loads
        kernel = device == "cpu" or (device.startswith("cuda") and _triton_available()
                                     and kernels_mode() != "reference")
        return kernel and len({p.shape[1] for p in parts}) == 1
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
        return GroupQuantExpertLinear if expert else GroupQuantLinear
    if format == "sparse":
        return SparseExpertLinear if expert else SparseLinear
    if format == "fp8" and not expert:
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
        if isinstance(module, GGUFLinear):
            module.may_repack = True  # resident: its own blocks
    return out


class GGUFLinear(CompressedLinear):
    """W held as `blocks` uint8 [out, row_bytes], each row one weight row's GGUF blocks
    of type `qtype`, multiplied by kernels/quant_linear.py (CPUs) or
    kernels/triton_quant.gguf_linear_triton (CUDA tensors, `on_triton`).

    A resident layer (`may_repack`, keep_blocks) on a CPU whose build has the int8
    product (AVX512_VNNI or AVX2, kernels/quant_vnni.py) repacks its blocks in place at
    its first bf16 call (`packed` True): groups of 16 rows interleaved as the kernel's
    registers take them, the same bytes, so no call transposes or gathers them again. A
    later call that another kernel serves (fp32 x, FUSEGEN_KERNELS set) unpacks them in
    place for good. Streamed layers' staging slots refill every step: kept as stored. The
    tied head repacks the table it shares with the embedding, whose lookups then read the
    repacked rows (weights/quantized_fixed.py's GGUFEmbedding.tied_head)."""
    components = ("blocks",)
    format = "gguf"
    packed = False
    may_repack = False

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        super().set_weight(name, tensor)
        if name == "blocks":  # a new tensor, as stored, perhaps a staging slot's
            self.packed = self.may_repack = False

    def _pack(self, x: torch.Tensor) -> None:
        """Repack the blocks in place where x's products will read them so."""
        qtype = self.params[0]
        if (x.dtype == torch.bfloat16 and use_native(x) and self.blocks.is_cpu
                and self.blocks.is_contiguous() and q8_packed_available(qtype)):
            pack_blocks(self.blocks, qtype, self.in_features)
            self.packed = True
        self.may_repack = False  # decided once

    def _unpack(self) -> None:
        unpack_blocks(self.blocks, self.params[0], self.in_features)
        self.packed = False

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
        if self.may_repack:
            self._pack(x)
        if self.packed:
            out = self._packed_product(x)
            if out is not None:
                return out if self.bias is None else out.add_(self.bias)
            self._unpack()
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

    def _packed_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """x @ W.T by the int8 product over the repacked blocks: bf16 x on this CPU (any
        row count, batch-invariant); None for any other x."""
        if x.dtype != torch.bfloat16 or not use_native(x):
            return None
        if x.dim() == 2 and x.shape[0] and x.shape[1] == self.in_features and x.stride(1) == 1:
            # a step's rows as they come: no reshapes
            return quant_linear_q8_packed(x, self.blocks, self.params[0], self.out_features)
        rows = x.reshape(-1, self.in_features)
        if not rows.shape[0]:
            return x.new_empty(*x.shape[:-1], self.out_features)
        out = quant_linear_q8_packed(rows if rows.stride(-1) == 1 else rows.contiguous(),
                                     self.blocks, self.params[0], self.out_features)
        return None if out is None else out.view(*x.shape[:-1], self.out_features)

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
