"""`PackedLinear`: a CPU linear whose weight is pre-packed once for oneDNN.

A BLAS call re-lays out (packs) the weight matrix into the blocks its micro-kernel
reads on every call. For the engine's shapes (a few hundred rows against a
[3072, 512] or [32000, 512] weight) that repacking is most of the call, so on CPUs
fusegen packs every resident weight once at load, with oneDNN's
`_reorder_linear_weight`, and calls oneDNN's linear on it (docs/performance.md has
the two side by side).

The packed tensor replaces the dense weight (the same bytes; the dense copy is
freed), so it costs no memory, except for a head tied to the embedding, which keeps
the dense embedding for the lookup beside the packed head. Layers streamed through
the memory pool keep dense `Linear`s: their weights change every step.

Packing is used only where oneDNN can pack the dtype on this CPU (fp32 on any x86-64
with AVX2; bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT) and gives F.linear's
result on a probe; elsewhere the dense `Linear` (torch's reference) serves.
FUSEGEN_KERNELS=reference turns packing off, like the other CPU kernels.

On AVX-512 CPUs a call of up to `DP_ROWS` rows (a decode step's) goes to fusegen's own
kernels (kernels/csrc/gemm_tiles.c) on the same packed weight, oneDNN's result to the
bit: in fp32, and in bf16 where the CPU has AVX512_BF16 and no AMX (whose tiles oneDNN
uses). In a decode step oneDNN's call pays for its own state coming back from memory
(the attention kernel has just streamed the KV cache through the caches); fusegen's
kernel keeps no such state, which makes it the faster of the two for decode-sized calls
(docs/performance.md). A probe per weight shape checks
the layout and finds oneDNN's blocking over the input channels (for one row and for
more: oneDNN blocks fp32 rows differently when there is one); a shape that does not
match to the bit stays with oneDNN.

Deterministic mode (`row_tile` set) needs a row's result to be the same whatever rows
share its call. fusegen's kernel gives that by construction when every call uses one
blocking over the channels, so such a weight takes it for calls of any row count
(`_dp_invariant`); a weight it does not serve is multiplied by oneDNN in calls of
exactly `row_tile` rows (`row_tiled`, zero padding), which costs up to `row_tile` times
the work of a small step.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from fusegen.engine.weights.linear import Linear, row_tiled

log = logging.getLogger("fusegen.engine")

# Rows up to which a call takes fusegen's kernel where it can (module docstring): up to
# here it is at least as fast as oneDNN for a small model's shapes; prefill steps of
# thousands of rows are oneDNN's.
DP_ROWS = 1024
# Bytes of a weight tile (64 columns by the input channels) up to which it does: the
# kernel reads a tile once per 6 rows, from L2 while the tile fits there. Past it (a 1B
# model's bf16 down projection: 8,192 channels, 1 MB tiles) oneDNN, whose blocking over
# the channels keeps its tiles in cache, is the faster. 4,096 channels in bf16, 2,048 in
# fp32.
DP_MAX_TILE = 512 * 1024
# per dtype: the kernel, its bit in gemm_tiles_available(), oneDNN's padding of the channels
_DP_DTYPES = {torch.bfloat16: ("gemm_tiles_bf16", 1, 32),
              torch.float32: ("gemm_tiles_f32", 2, 16)}


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
        # what oneDNN chose its layout by: two engines of one process packing the same
        # shape with other hints or thread counts may get other layouts
        packed.layout = (batch_hint, torch.get_num_threads())
        packed.bias = linear.bias
        packed.row_tile = linear.row_tile
        packed.out_features, packed.in_features = linear.weight.shape
        packed.dtype = linear.weight.dtype
        packed.k_blocks = None  # (for one row, for more): where fusegen's kernel serves
        if packed.dtype in _DP_DTYPES:
            packed.weight_ptr = torch.ops.mkldnn.data_ptr(packed.weight)  # fixed from now on
            packed.k_blocks = _dp_blocks(packed)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fits_dp = self.k_blocks is not None and x.dim() == 2 and x.dtype == self.dtype
        if self.row_tile is not None:
            if fits_dp:
                return self._dp_invariant(x)
            return row_tiled(x, self._matmul, self.out_features, self.bias, self.row_tile)
        if fits_dp and x.shape[0] <= DP_ROWS:
            return self._dp(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    def _dp(self, x: torch.Tensor, k_block: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] through fusegen's kernel (kernels/csrc/gemm_tiles.c);
        `k_block`: its blocking over the channels, else the one found for T rows; `out`:
        rows [T, out] to write, contiguous, else new ones."""
        from fusegen.kernels import native

        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        if k_block is None:
            k_block = self.k_blocks[0 if rows == 1 else 1]
        if out is None:
            out = torch.empty(rows, self.out_features, dtype=self.dtype)
        getattr(native.library(), _DP_DTYPES[self.dtype][0])(
            x.data_ptr(), rows, x.stride(0), self.weight_ptr, self.out_features,
            self.in_features, k_block, None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(), self.out_features, torch.get_num_threads())
        return out

    def _dp_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """Deterministic mode's product: fusegen's kernel with one blocking over the
        channels for every call (the one oneDNN's multi-row calls use), DP_ROWS rows a
        call. The kernel sums each row alone, in the same order whatever rows and
        threads share its call (threads split tiles and row blocks, never a row's
        sums), so a row's bits depend on the row alone: no padding to row tiles."""
        rows, k_block = x.shape[0], self.k_blocks[1]
        if rows <= DP_ROWS:
            return self._dp(x, k_block)
        out = torch.empty(rows, self.out_features, dtype=self.dtype)
        for start in range(0, rows, DP_ROWS):
            self._dp(x[start:start + DP_ROWS], k_block, out[start:start + DP_ROWS])
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T] int64: each row's first column of the maximum of `forward(x)`,
        as argmax(forward(x).float()) gives it, without the fp32 copy of the product
        (greedy decoding's head: 15 MB a decode step of 115 rows over 32,000 in bf16)."""
        from fusegen.kernels.argmax import argmax

        return argmax(self.forward(x))

    def _matmul(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        result = torch.ops.mkldnn._linear_pointwise(rows, self.weight, None, "none", [], "")
        return result if out is None else out.copy_(result)

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        raise TypeError("a packed linear's weight is fixed at load; streamed layers use Linear")


class NativeLinear(Linear):
    """An fp32 CPU linear on fusegen's own GEMM (kernels/csrc/gemm.c): the weight packed
    once into panels of 16 output columns, [ceil(out / 16) * 16 * in] floats. Faster
    than oneDNN's packed product at every row count the engine runs (decode batches
    most of all), and batch-invariant by construction: a row's result does not depend
    on the other rows of the call, so deterministic mode needs no row tiles here
    (`row_tile` is kept for the record and not used)."""

    @classmethod
    def pack(cls, linear: Linear) -> "NativeLinear":
        from fusegen.kernels import native

        weight = linear.weight.contiguous()
        out_features, in_features = weight.shape
        packed = cls(bias=linear.bias is not None)
        packed.weight = torch.empty(-(-out_features // 16) * 16 * in_features)
        native.library().gemm_pack_f32(weight.data_ptr(), packed.weight.data_ptr(),
                                       out_features, in_features, torch.get_num_threads())
        packed.bias = None if linear.bias is None else linear.bias.contiguous()
        packed.row_tile = linear.row_tile
        packed.out_features, packed.in_features = out_features, in_features
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fusegen.kernels import native

        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        native.library().gemm_f32(
            rows.data_ptr(), rows.shape[0], rows.stride(0), self.weight.data_ptr(),
            self.out_features, self.in_features,
            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
            self.out_features, torch.get_num_threads())
        return out.view(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T] int64: each row's first column of the maximum of `forward(x)`,
        bit for bit argmax(forward(x)) without writing the [T, out] product (greedy
        decoding's head over a large vocabulary)."""
        from fusegen.kernels import native

        rows = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty(rows.shape[0], dtype=torch.int64)
        if native.library().gemm_argmax_f32(
                rows.data_ptr(), rows.shape[0], rows.stride(0), self.weight.data_ptr(),
                self.out_features, self.in_features,
                None if self.bias is None else self.bias.data_ptr(), out.data_ptr(),
                torch.get_num_threads()):
            raise MemoryError("the CPU GEMM could not allocate its argmax scratch")
        return out

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        raise TypeError("a packed linear's weight is fixed at load; streamed layers use Linear")


# oneDNN's blocking over the input channels per (dtype, out, in, bias) shape and the
# (batch hint, threads) it was packed with, which choose oneDNN's layout: found once
_DP_BLOCKS: dict[tuple, tuple[int, int] | None] = {}


def _dp_blocks(packed: PackedLinear) -> tuple[int, int] | None:
    """The channels per block of sums with which fusegen's kernel gives `packed`'s
    oneDNN result to the bit, for one row and for more, or None where it does not serve
    (tiles over DP_MAX_TILE, no kernel for the dtype on this CPU, a layout other than
    oneDNN's 64-column tiles, no block that matches)."""
    dtype, out_features, in_features = packed.dtype, packed.out_features, packed.in_features
    if in_features * 64 * dtype.itemsize > DP_MAX_TILE:
        return None
    key = (dtype, out_features, in_features, packed.bias is not None, packed.layout)
    if key not in _DP_BLOCKS:
        _DP_BLOCKS[key] = _probe_dp_blocks(packed) if _dp_gemm(dtype) else None
    return _DP_BLOCKS[key]


def _probe_dp_blocks(packed: PackedLinear) -> tuple[int, int] | None:
    dtype, out_features, in_features = packed.dtype, packed.out_features, packed.in_features
    pad = _DP_DTYPES[dtype][2]
    tiled = -(-out_features // 64) * 64 * -(-in_features // pad) * pad * dtype.itemsize
    bias = packed.bias
    if torch.ops.mkldnn._nbytes(packed.weight) != tiled or bias is not None and (
            bias.dtype != dtype or not bias.is_contiguous()):
        return None
    gen = torch.Generator().manual_seed(0)
    whole = in_features + in_features % 2
    candidates = [k for k in dict.fromkeys((whole, 1024, 512, 2048, 256)) if k <= whole]

    def block(rows: tuple[int, ...]) -> int | None:
        probes = [torch.randn(n, in_features, generator=gen).to(dtype) for n in rows]
        wants = [torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], "")
                 for x in probes]
        return next((k for k in candidates if all(torch.equal(packed._dp(x, k), want)
                                                    for x, want in zip(probes, wants))), None)

    blocks = block((1, 1, 1)), block((2, 5, 64))
    if None in blocks:
        log.info("fusegen's %s kernel does not match oneDNN on a [%d, %d] weight; oneDNN "
                 "serves it", str(dtype).removeprefix("torch."), out_features, in_features)
        return None
    return blocks


@functools.cache
def _dp_gemm(dtype: torch.dtype) -> bool:
    """Whether calls of decode size in `dtype` may take fusegen's kernel: built for this
    CPU (AVX-512; AVX512_BF16 for bf16), and for bf16 no AMX, whose tiles oneDNN uses
    and which are faster."""
    from fusegen.kernels import native

    lib = native.library()
    if lib is None or not lib.gemm_tiles_available() & _DP_DTYPES[dtype][1]:
        return False
    amx = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", lambda: False)()
    return dtype != torch.bfloat16 or not amx


def pack_linear(linear: Linear, batch_hint: int) -> Linear:
    """`linear` packed for this CPU: fusegen's own GEMM for fp32 on AVX2 CPUs where the
    C kernels build, else oneDNN's packed weight (`batch_hint`: the row count it blocks
    for)."""
    if linear.weight.dtype == torch.float32 and _native_gemm():
        return NativeLinear.pack(linear)
    return PackedLinear.pack(linear, batch_hint)


@functools.cache
def _native_gemm() -> bool:
    """Whether fp32 weights go to fusegen's GEMM: on CPUs whose widest vectors are AVX2's
    (its micro-kernel's), where it is faster than oneDNN at every row count; on AVX-512
    CPUs oneDNN's 16-lane kernels are the faster choice."""
    from fusegen.kernels import native

    return torch.backends.cpu.get_cpu_capability() == "AVX2" and native.library() is not None


def can_pack(dtype: torch.dtype) -> bool:
    """Whether resident CPU weights of `dtype` are packed: unless FUSEGEN_KERNELS asks
    for the reference, for fp32 by fusegen's GEMM (where the C kernels build) and for
    any dtype oneDNN packs on this CPU."""
    if os.environ.get("FUSEGEN_KERNELS", "auto") != "auto":
        return False
    return (dtype == torch.float32 and _native_gemm()) or _onednn_packs(dtype)


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
    """Replace every dense `Linear` among `module`'s children (recursively) by a packed
    one of the same weight (`pack_linear`)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Linear and child.weight.device.type == "cpu":
                setattr(parent, name, pack_linear(child, batch_hint))
