"""`Linear`: the one way a decoder applies a weight matrix.

The decoder calls `self.qkv(x)` and never sees how the weight is stored, so a layer's
weight can later be kept another way by another class with the same members, without
touching the decoder: sharded across a device group (a column- or row-parallel linear
narrows each checkpoint part to its rank's rows or columns before the parts are
stacked, and adds its one collective in `forward`), quantized blocks, sparse tiles.

A linear's tensors have names ("weight", "bias"), the names the architectures'
weight-name maps and the streamer's staging slots use ("qkv.weight"). Setting one
points the layer at a tensor someone else owns (a device copy, or a staging slot the
next streamed layer refills) and copies nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """x [T, in] -> x @ weight.T + bias [T, out]; dense weight [out, in], bias [out].

    Runs four times per decoder layer per step, so the CPU hot path pays only the
    method call: `__call__` is `forward` itself (nn.Module's hook dispatch skipped),
    and the tensors are plain attributes (an instance-dict lookup, where an
    nn.Parameter goes through nn.Module.__getattr__)."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.weight = torch.empty(0)
        self.bias = torch.empty(0) if bias else None
        self.row_tile: int | None = None  # set: batch-invariant (see `row_tiled`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is not None:
            return row_tiled(x, self._matmul, self.weight.shape[0], self.bias, self.row_tile)
        return F.linear(x, self.weight, self.bias)

    def _matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # rows [n, in] -> [n, out], no bias: one call of row_tiled's
        return torch.mm(rows, self.weight.t(), out=out)

    __call__ = forward

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward  # each storage form's own forward, called directly

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        """Point tensor `name` ("weight" or "bias") at `tensor`, shared, not copied."""
        if getattr(self, name) is None:
            raise ValueError(f"Linear has no {name} (built without one), but the weight map "
                             "gives one: the architecture's weight map and config flags disagree")
        setattr(self, name, tensor)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias)
                   if t is not None)


# Rows per matmul call in deterministic mode. A BLAS picks its kernel (and with it the
# order it sums over `in`) by the call's shape: a lone decode row takes a matrix-vector
# path, a few rows another, and which rows share a step decides the shape. Calls of
# exactly this many rows always take the same path, so a row's result depends on the
# row alone. 64 keeps the padding of small steps and the weight re-reads of large ones
# both modest (docs/performance.md has the cost).
ROW_TILE = 64


def row_tiled(x: torch.Tensor, matmul, out_features: int, bias: torch.Tensor | None,
              tile: int) -> torch.Tensor:
    """x @ weight.T (+ bias) [T, out] computed `tile` rows per `matmul(rows, out=None)`
    call, the last call padded with zero rows, each call over a 64-byte aligned
    [tile, in] input."""
    num_rows = x.shape[0]
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    staged = None
    for start in range(0, num_rows, tile):
        rows = x[start:start + tile]
        n = rows.shape[0]
        if n < tile or not rows.is_contiguous() or rows.data_ptr() % 64:
            if staged is None:
                staged = x.new_zeros(tile, x.shape[1])
            staged[:n] = rows
            staged[n:] = 0
            out[start:start + n] = matmul(staged)[:n]
        else:
            matmul(rows, out=out[start:start + n])
    if bias is not None:
        out += bias  # elementwise: the same bits whatever the batch
    return out
