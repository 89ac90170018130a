"""`GGUFLinear`: a linear whose weight stays as the GGUF file's blocks (codes and
scales), expanded only inside the product (`kernels/quant_linear.py`), never into a
dense copy of the layer.

With `quantization="gguf"` the decoder layers' linears (q/k/v/o, gate/up/down) of a
GGUF checkpoint keep their blocks where the kernel takes their type; the embedding,
the norms, the LM head and any weight of another type are dequantized as they load,
as without the option. A fused parameter (q, k, v into `qkv`; gate, up into `gate_up`)
keeps its blocks when its parts share one type: each part's rows are whole weight rows,
so stacking the block rows along the output dimension stacks the weights.

Which parameters keep their blocks is decided here once (`kept_as_blocks`), over the
tensor table alone, for the placement plan (compressed bytes per layer) and for the
load alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusegen.engine.weights.linear import Linear, row_tiled
from fusegen.kernels import use_native
from fusegen.kernels.quant_linear import SUPPORTED, has_kernel, quant_linear


@dataclass(frozen=True, slots=True)
class BlockSource:
    """One checkpoint weight as its blocks, not read yet: `load()` -> uint8
    [out_features, row_bytes], rows in Hugging Face order."""
    qtype: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, int]  # the dense weight's [out_features, in_features]
    nbytes: int  # out_features * row_bytes
    load: object  # () -> torch.Tensor


def kept_as_blocks(param: str, parts: list[tuple[int, tuple[int, ...]]]) -> bool:
    """Whether a decoder layer's parameter `param` ("qkv.weight") made of checkpoint
    tensors `parts` ((qtype, shape) each, in stacking order) keeps its blocks: a
    linear's 2-D weight (the decoder's norms are 1-D, its linears' parameters end in
    ".weight") whose parts all have one type the kernel takes."""
    qtypes = {int(qtype) for qtype, _ in parts}
    return (param.endswith(".weight") and len(qtypes) == 1 and qtypes <= SUPPORTED.keys()
            and all(len(shape) == 2 for _, shape in parts)
            and len({shape[1] for _, shape in parts}) == 1)


def split_kept(sources: dict[str, list]) -> tuple[dict[str, list[BlockSource]], dict]:
    """A layer's sources (`Architecture.layer_sources`) as (the parameters that keep
    their blocks, the rest, loaded dense as always). A part without a `blocks` source
    (a float tensor, a type the reader serves only dense) keeps its parameter dense."""
    kept, dense = {}, {}
    for param, parts in sources.items():
        blocks = [getattr(t, "blocks", None) for t in parts]
        if None not in blocks and kept_as_blocks(param, [(b.qtype, b.shape) for b in blocks]):
            kept[param] = blocks
        else:
            dense[param] = parts
    return kept, dense


def layer_nbytes(sources: dict[str, list], itemsize: int) -> int:
    """One layer's weight bytes as loaded: the kept parameters' blocks, the others dense
    at `itemsize` bytes a value (the placement plan's layer size)."""
    kept, dense = split_kept(sources)
    return (sum(part.nbytes for parts in kept.values() for part in parts)
            + sum(t.numel() for parts in dense.values() for t in parts) * itemsize)


def fuse_blocks(parts: list[BlockSource], device) -> torch.Tensor:
    """A parameter's parts' block rows stacked along the output dimension: uint8
    [sum of out_features, row_bytes] on `device`, always a copy (never a view of the
    file's memory map, so it counts as the weights' own memory)."""
    rows = [part.load() for part in parts]
    return (torch.cat(rows) if len(rows) > 1 else rows[0].clone()).to(device)


def keep_blocks(layer: torch.nn.Module, kept: dict[str, list[BlockSource]], device
                ) -> dict[str, torch.Tensor]:
    """Replace each of `layer`'s Linears named in `kept` ("qkv.weight" -> `layer.qkv`) by
    a `GGUFLinear` on the fused blocks, carrying its bias flag and row tile (the bias is
    set afterwards with the layer's other dense tensors). Returns the block tensors by
    parameter, for the memory report."""
    out = {}
    for param, parts in kept.items():
        owner, _, _ = param.rpartition(".")
        parent_name, _, name = owner.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        linear = getattr(parent, name)
        if not isinstance(linear, Linear):
            raise TypeError(f"{param}: the layer's {owner} is a {type(linear).__name__}, "
                            "not a Linear; its weight cannot be kept as blocks")
        blocks = fuse_blocks(parts, device)
        setattr(parent, name, GGUFLinear.from_blocks(linear, blocks, parts[0].qtype,
                                                     parts[0].shape[1]))
        out[param] = blocks
    return out


class GGUFLinear(Linear):
    """x [T, in] -> x @ W.T + bias [T, out], W held as `blocks` uint8 [out, row_bytes]
    (each row one weight row's GGUF blocks of type `qtype`), bias [out] dense."""

    @classmethod
    def from_blocks(cls, linear: Linear, blocks: torch.Tensor, qtype: int,
                    in_features: int) -> "GGUFLinear":
        kept = cls(bias=linear.bias is not None)
        kept.bias = linear.bias
        kept.row_tile = linear.row_tile
        kept.blocks, kept.qtype = blocks, int(qtype)
        kept.out_features, kept.in_features = blocks.shape[0], in_features
        kept.weight = None  # no dense weight exists
        return kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is not None and not (use_native(x) and has_kernel(self.qtype, x.dtype)):
            # The C kernel sums each row in one order whatever the call's row count
            # (64-row calls past that), so it is batch-invariant as it is; the reference
            # (torch's GEMM) orders its sums by the call's shape: exactly `row_tile` rows
            # per call make a row's result independent of the rows batched with it.
            return row_tiled(x, self._matmul, self.out_features, self.bias, self.row_tile)
        out = quant_linear(x, self.blocks, self.qtype, self.out_features, self.in_features)
        if self.bias is not None:
            out += self.bias
        return out

    def _matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # rows [n, in] -> [n, out], no bias: one call of row_tiled's
        result = quant_linear(rows, self.blocks, self.qtype, self.out_features,
                              self.in_features)
        return result if out is None else out.copy_(result)

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name != "bias":
            raise TypeError("a GGUF linear's blocks are fixed at load; its weight cannot be "
                            "pointed elsewhere (streamed layers are dense Linears)")
        super().set_weight(name, tensor)

    @property
    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.blocks.numel() + bias  # uint8: one byte an element
