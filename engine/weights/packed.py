"""`PackedLinear`: a CPU linear whose weight is pre-packed once for oneDNN.

A BLAS call re-lays out (packs) the weight matrix into the blocks its micro-kernel
reads on every call. For the engine's shapes (a few hundred rows against a
[3072, 512] or [32000, 512] weight) that repacking is most of the call: measured on
a 2-core AVX2 EPYC, torch's fp32 `F.linear` (MKL) reaches 35-60 GFLOP/s at 16-128
rows where oneDNN on a weight packed once at load reaches 80-125 (docs/performance.md).
So on CPUs fusegen packs every resident weight at load, with oneDNN's
`_reorder_linear_weight`, and calls oneDNN's linear on it.

The packed tensor replaces the dense weight (the same bytes; the dense copy is
freed), so it costs no memory, except for a head tied to the embedding, which keeps
the dense embedding for the lookup beside the packed head. Layers streamed through
the memory pool keep dense `Linear`s: their weights change every step.

Packing is used only where oneDNN can pack the dtype on this CPU (fp32 on any x86-64
with AVX2; bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT) and gives F.linear's
result on a probe; elsewhere the dense `Linear` (torch's reference) serves.
FUSEGEN_KERNELS=reference turns packing off, like the other CPU kernels.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from fusegen.engine.weights.linear import Linear, row_tiled

log = logging.getLogger("fusegen.engine")


class PackedLinear(Linear):
    """x [T, in] -> [T, out] through oneDNN on a weight packed for it (an opaque mkldnn
    tensor of shape [out, in]); bias [out] dense."""

    @classmethod
    def pack(cls, linear: Linear, batch_hint: int) -> "PackedLinear":
        """A packed copy of `linear`'s weight; `batch_hint` is the row count oneDNN
        picks its blocking for (the step's token budget: any row count still works)."""
        packed = cls(bias=linear.bias is not None)
        packed.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.contiguous(),
                                                                batch_hint)
        packed.bias = linear.bias
        packed.row_tile = linear.row_tile
        packed.out_features = linear.weight.shape[0]
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is not None:
            return row_tiled(x, self._matmul, self.out_features, self.bias, self.row_tile)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def _matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        result = torch.ops.mkldnn._linear_pointwise(rows, self.weight, None, "none", [], "")
        return result if out is None else out.copy_(result)

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        raise TypeError("a packed linear's weight is fixed at load; streamed layers use Linear")


def can_pack(dtype: torch.dtype) -> bool:
    """Whether resident CPU weights of `dtype` are packed: unless FUSEGEN_KERNELS asks
    for the reference, when oneDNN packs the dtype on this CPU."""
    return os.environ.get("FUSEGEN_KERNELS", "auto") == "auto" and _onednn_packs(dtype)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU and its linear then matches
    torch's (to rounding), checked once per dtype on a small probe."""
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    except RuntimeError as exc:  # the CPU lacks the instructions oneDNN needs for dtype
        log.info("oneDNN cannot pack %s weights on this CPU (%s); using torch's linear", dtype,
                 str(exc).splitlines()[0])
        return False
    want = F.linear(x.float(), weight.float(), bias.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return torch.allclose(got.float(), want, rtol=tol, atol=tol * 8)


def pack_linears(module: torch.nn.Module, batch_hint: int) -> None:
    """Replace every dense `Linear` among `module`'s children (recursively) by a
    `PackedLinear` of the same weight."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Linear and child.weight.device.type == "cpu":
                setattr(parent, name, PackedLinear.pack(child, batch_hint))
