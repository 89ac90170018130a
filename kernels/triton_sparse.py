"""A linear layer over fusegen's sparse bitmap tiles on GPUs, in Triton (Flash-LLM's "load
as sparse, compute as dense"): x @ W.T with each 64 x 64 tile of W expanded to dense in
registers right before a tensor-core dot, never as a dense copy of the weight.

Shapes:
  x        [M, in_features] fp32, fp16 or bf16, rows contiguous (M may be 0)
  tiles    SparseTiles of W [out, in] (kernels/sparse_format.py) on x's device: bitmap
           uint64 [n_tiles, 64], offsets int64 [n_tiles + 1], values [nnz] bf16 / fp16 /
           fp32 / int8, scales fp32 [n_tiles] with int8 values
  returns  [M, out_features] in x.dtype
Its torch reference is kernels/sparse_linear.py's `sparse_linear_reference` (the whole
weight decoded to fp32); `sparse_linear` there sends CUDA x here.

Kernel: one program per (BLOCK_M rows of x, one row-tile of W: 64 outputs, one split of
the column-tiles), in two variants that expand a tile the same way. A tile has 64 mask
words (word c: local column c, an input channel; bit j: local row j, an output); element
(c, j) is kept iff bit j of word c is set, and its value is packed at
    offsets[t] + popcount(words 0 .. c-1) + popcount(word c's bits below j)
(a column's values are contiguous, rows ascending). Counts are 32-bit popcounts (the
GPU's POPC; SWAR under the interpreter). Values widen to fp32 (int8 codes times the
tile's scale), round to x's dtype (fp32 stays fp32 and multiplies in IEEE fp32, not
TF32) and tl.dot accumulates in fp32. The format keeps bits past the matrix's edge 0, so
the weight needs no edge masks; x's columns do.

- "packed" (the default, `_sparse_packed_kernel`): a tile's values are one contiguous
  run, so they are read as a few aligned 16-byte vectors (at most the tile's values and
  an alignment's worth more) into a CAP-long register vector, then expanded on chip:
  the mask halves' prefix counts once a tile (a cumsum over its 128 halves), then one
  shift, POPC, add and compare an element and one shared-memory read (tl.gather) of
  its value. Only the offsets decide where the values lie, not the mask: the loop
  loads the next tile's mask, values, scale and x while this one is expanded and
  multiplied (PREFETCH). Tiles whose values do not fit CAP (nearly dense ones) and the
  storage's last values (an aligned read could pass its end) are left to a second pass
  that loads them element by element.
- "gather" (`_sparse_tiles_kernel`): each element's value is a load of its own from
  global memory at its computed index (32 lanes of a warp on 32 columns: a warp's load
  touches many cache lines), after the tile's words arrive; PREFETCH there loads the
  next tile's words, offset, scale and x.

Split-K: a decode step has one block of rows, and a layer of 4096 outputs has only 64
row-tiles, fewer than a GPU has SMs; so the column-tiles are cut into `splits` runs whose
fp32 partial sums a second small kernel adds in ascending order. `splits` follows from
the weight's shape and the device's SM count (and, without `batch_invariant`, the
call's row blocks).

Batch invariance (as kernels/triton_quant.py): an output element is the sum over its
splits, in order, of the sum over their tiles, in an order the weight alone fixes (the
packed variant's second pass after the others), of each tile's dot; with
`batch_invariant=True` (the default) BLOCK_M stays <= 32 (one family of tensor-core
instructions) and `splits` is the same for every M, so a row's result is bit-identical
alone or inside any batch (at M > 64 the partial sums cost bytes: splits * M * out * 8).
`batch_invariant=False` lets M > 64 take 128-row blocks and splits by the call's row
blocks (faster prefill; rows then depend on their call's bucket). The engine's
deterministic mode multiplies fixed row tiles (weights/linear.py's `row_tiled`) either way.

Prefill: every row block expands the tiles it multiplies again, so expansion costs grow
with M / BLOCK_M; the kernel pays most at decode shapes (M up to a few hundred), where
the bytes read dominate. Without `batch_invariant`, calls of _DENSE_FROM_ROWS rows or
more expand the weight once instead, a band of output rows at a time (`_expand_kernel`,
the gather variant's expansion), and multiply each band by torch (cuBLAS).
"""
from __future__ import annotations

import functools
import os

import torch

from fusegen.kernels import _triton_available
from fusegen.kernels.sparse_format import SparseTiles

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # no Triton on this platform: the torch reference still serves
    from fusegen.kernels._triton_stub import tl, triton
    libdevice = None

_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int8)
_PARTIAL_ROWS = 256      # rows a split call takes at a time (bounds the fp32 partials)
# Without `batch_invariant`, calls of this many rows or more expand the weight once, a band
# of output rows at a time, and multiply it by cuBLAS: the kernel would expand every tile
# again for each 128-row block (an estimate of where that costs more than writing and
# reading the dense band; `bench(rows=(256, 1024))` shows both sides of it).
_DENSE_FROM_ROWS = 512
_DENSE_BAND_ROWS = 2048  # output rows expanded at a time on that path
_SPLIT_MIN_TILES = 4     # column-tiles a split covers at least (256 input channels)
_PROGRAMS_PER_SM = 4     # programs split-K aims at per SM
_INTERPRETER_SMS = 132   # the SM count splits assume under the interpreter (an H100's)
_VARIANTS = ("packed", "gather")   # the default expansion, and each element loaded alone
# Warps a program: gather, eight (16 elements of a tile a thread: more loads in flight);
# packed, four up to 32-row blocks (32 elements a thread: fewer instructions a tile, and
# registers for three programs an SM), eight for 128-row blocks (registers)
_NUM_WARPS = {("gather", False): 8, ("gather", True): 8, ("packed", False): 4,
              ("packed", True): 8}
_PACKED_VECTOR_BYTES = 16  # one aligned vector load of packed values
_PACKED_MIN_CAP = 256      # the packed vector's length: at least one value a thread
_PACKED_MAX_CAP = 4096     # ... at most a dense tile's


def has_triton_sparse(device: str | torch.device = "cuda") -> bool:
    """Whether the Triton sparse-tile kernel can run on `device`: Triton installed and the
    device a CUDA GPU (or any device under TRITON_INTERPRET=1, the tests' interpreter)."""
    if not _triton_available():
        return False
    if _interpreted():
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or _interpreted():
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(row_tiles: int, col_tiles: int, num_sms: int, row_blocks: int = 1) -> int:
    """Runs of column-tiles per row-tile: enough programs for _PROGRAMS_PER_SM on each SM
    (each program's loads wait on one another: words, then values; more programs hide
    that), each run at least _SPLIT_MIN_TILES tiles."""
    wanted = -(-_PROGRAMS_PER_SM * num_sms // (row_tiles * row_blocks))
    return max(1, min(wanted, col_tiles // _SPLIT_MIN_TILES))


def _config(num_rows: int, tiles: SparseTiles, batch_invariant: bool, num_sms: int) -> dict:
    """A call's launch parameters: the packed variant; 16-row blocks for decode, 32 up to
    64 rows (and for every M when `batch_invariant`), else 128; num_warps None: the
    variant's own (_NUM_WARPS); the loop's own prefetch of the next tile (one stage:
    Triton's pipeliner would not overlap the tile's loads with its expansion). Split-K by
    `_splits`: for one row block when `batch_invariant` (the same for every M), else for
    the call's row blocks. `dense`: the weight expanded in bands and multiplied by torch
    (large calls without `batch_invariant`)."""
    if num_rows <= 16:
        block_m = 16
    elif num_rows <= 64 or batch_invariant:
        block_m = 32
    else:
        block_m = 128
    row_blocks = 1 if batch_invariant else -(-num_rows // block_m)
    splits = _splits(tiles.num_row_tiles, tiles.num_col_tiles, num_sms, row_blocks)
    return {"variant": "packed", "BLOCK_M": block_m, "splits": splits, "PREFETCH": True,
            "num_warps": None, "num_stages": 1,
            "dense": not batch_invariant and num_rows >= _DENSE_FROM_ROWS,
            **_packed_shape(tiles)}


@triton.jit
def _popcount(v, HW_POPC: tl.constexpr):
    """Bits set in each int32 of `v`, as int32: POPC on the GPU, SWAR in the interpreter
    (which has no libdevice)."""
    if HW_POPC:
        count = libdevice.popc(v)
    else:
        u = v.to(tl.uint32, bitcast=True)
        u = u - ((u >> 1) & 0x55555555)
        u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F
        count = ((u * 0x01010101) >> 24).to(tl.int32)
    return count


@triton.jit
def _tile_head(words_ptr, offsets_ptr, scales_ptr, t, valid, HAS_SCALES: tl.constexpr):
    """Tile t's 64 mask words (int64; word c = local column c), its first value's index
    and its scale (1.0 without scales); zeros where not `valid` (past the run's end)."""
    c = tl.arange(0, 64)
    word = tl.load(words_ptr + t * 64 + c, mask=c < tl.where(valid, 64, 0), other=0)
    offset = tl.load(offsets_ptr + t, mask=valid, other=0)
    if HAS_SCALES:
        scale = tl.load(scales_ptr + t, mask=valid, other=0.0)
    else:
        scale = 1.0
    return word, offset, scale


@triton.jit
def _gather_tile(values_ptr, word, offset, HW_POPC: tl.constexpr):
    """A tile's kept values in place: [64 (local column c: k), 64 (local row j: n)] in
    the values' dtype, 0 where the bit is clear (nothing loaded for an all-zero word)."""
    j = tl.arange(0, 64)
    high = (j >= 32)[None, :]                       # [1, 64]: row j's bit in the high half
    shift = (j % 32)[None, :]
    below = ~(-1 << shift)                          # the half-word's bits under row j
    lo = word.to(tl.int32)                          # bits 0..31 (truncation)
    hi = (word >> 32).to(tl.int32)                  # bits 32..63
    lo_count = _popcount(lo, HW_POPC)
    count = lo_count + _popcount(hi, HW_POPC)
    start = tl.cumsum(count, 0) - count             # values before column c in the tile
    half = tl.where(high, hi[:, None], lo[:, None])  # [64, 64]
    kept = ((half >> shift) & 1) != 0
    rank = _popcount(half & below, HW_POPC) + tl.where(high, lo_count[:, None], 0)
    return tl.load(values_ptr + offset + (start[:, None] + rank), mask=kept, other=0)


@triton.jit
def _sparse_tiles_kernel(x_ptr, words_ptr, offsets_ptr, values_ptr, scales_ptr, out_ptr,
                         M, N, K, col_tiles, tiles_per_split, stride_xm, stride_om,
                         stride_split, HAS_SCALES: tl.constexpr, PARTIAL: tl.constexpr,
                         IEEE: tl.constexpr, HW_POPC: tl.constexpr, PREFETCH: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    row_tile = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = row_tile * 64 + tl.arange(0, 64)
    m_mask = offs_m[:, None] < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm    # [BM, 1]
    c = tl.arange(0, 64)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, 64), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, col_tiles)
    # The loads of a tile wait on one another (words, then values). PREFETCH loads tile
    # ti + 1's words, offset, scale and x while tile ti is expanded and multiplied (more
    # registers a thread). A run is never empty (the launcher's splits).
    t = row_tile.to(tl.int64) * col_tiles + first
    if PREFETCH:
        word, offset, scale = _tile_head(words_ptr, offsets_ptr, scales_ptr, t, first < last,
                                         HAS_SCALES)
        ch = first * 64 + c
        xt = tl.load(x_rows + ch[None, :], mask=m_mask & (ch[None, :] < K), other=0.0)
    for ti in range(first, last):
        if not PREFETCH:
            word, offset, scale = _tile_head(words_ptr, offsets_ptr, scales_ptr, t, ti < last,
                                             HAS_SCALES)
            ch = ti * 64 + c
            xt = tl.load(x_rows + ch[None, :], mask=m_mask & (ch[None, :] < K), other=0.0)
        w = _gather_tile(values_ptr, word, offset, HW_POPC).to(tl.float32)
        if HAS_SCALES:
            w = w * scale
        if PREFETCH:
            word, offset, scale = _tile_head(words_ptr, offsets_ptr, scales_ptr, t + 1,
                                             ti + 1 < last, HAS_SCALES)
            ch = (ti + 1) * 64 + c
            x_next = tl.load(x_rows + ch[None, :],
                             mask=m_mask & (ch[None, :] < tl.where(ti + 1 < last, K, 0)),
                             other=0.0)
        if IEEE:
            acc = tl.dot(xt, w.to(dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, w.to(dtype), acc)
        if PREFETCH:
            xt = x_next
        t += 1
    mask = m_mask & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if PARTIAL:  # fp32 partial sums of this split: [splits, M, N]
        tl.store(out + split.to(tl.int64) * stride_split, acc, mask=mask)
    else:
        tl.store(out, acc.to(dtype), mask=mask)


@triton.jit
def _packed_head(halves_ptr, values_ptr, scales_ptr, t, num_tiles, start, end, safe_end,
                 HAS_SCALES: tl.constexpr, TILES: tl.constexpr, CAP: tl.constexpr,
                 ALIGN: tl.constexpr):
    """What a group of TILES tiles (t .. t + num_tiles - 1; num_tiles <= 0: none) loads
    before its expansion, none of it waiting on another load of the group:
      halves  int32 [TILES * 128]: the mask words' 32-bit halves (row r = 2c + h: column
              c's rows 32h .. 32h + 31); past num_tiles 0 (TILES > 1: a partial group),
              or unread (TILES = 1: such a group is never expanded);
      packed  [CAP] values from index `base` (start - 1 rounded down to ALIGN, so
              lead = start - base is 1 .. ALIGN): the group's values (start .. end - 1)
              at lead .. lead + end - start - 1, read as aligned vectors of ALIGN values;
              nothing read unless `fits`;
      scale   fp32 [TILES * 64]: each local column's tile scale (1.0 without scales);
      fits    `_fits`: the group's values fit `packed` and its aligned read ends by
              safe_end (a multiple of ALIGN within the values' storage); groups that do
              not (nearly dense ones, the storage's last values) are left to the
              kernel's second pass."""
    r = tl.arange(0, TILES * 128)
    if TILES == 1:  # a single tile's halves are only used where it exists: no fill
        halves = tl.load(halves_ptr + t * 128 + r, mask=r < num_tiles * 128)
    else:           # a partial group's missing tiles are empty
        halves = tl.load(halves_ptr + t * 128 + r, mask=r < num_tiles * 128, other=0)
    base = (start - 1) & -ALIGN
    fits = _fits(start, end, safe_end, CAP, ALIGN)
    count = tl.multiple_of(tl.where(fits, ((end + ALIGN - 1) & -ALIGN) - base, 0), ALIGN)
    skip = tl.multiple_of(tl.where(base < 0, ALIGN, 0), ALIGN)   # before the first value
    i = tl.arange(0, CAP)
    packed = tl.load(values_ptr + tl.multiple_of(base, ALIGN) + i, mask=(i >= skip) & (i < count))
    if HAS_SCALES:
        c = tl.arange(0, TILES * 64)
        scale = tl.load(scales_ptr + t + c // 64, mask=c < num_tiles * 64, other=0.0)
    else:
        scale = 1.0
    return halves, packed, (start - base).to(tl.int32), fits, scale


@triton.jit
def _expand(halves, packed, lead, HW_POPC: tl.constexpr, TILES: tl.constexpr):
    """A group's tiles dense, [TILES * 64 (local column c, tile by tile: k), 64 (local row
    j: n)] in the values' dtype, 0 where the bit is clear. Row r of the halves holds the
    bits of 32 elements (c = r // 2, j = 32 (r % 2) + j'); their values are packed in
    the same order, so element (r, j')'s value is the `before[r] + popcount(half_r's bits
    0 .. j')`-th of the group (counting from 1), before[r] the halves' exclusive prefix
    count: a shift, a POPC, an add and a compare an element, then one shared-memory read
    (tl.gather) from the `packed` vector (the group's values from index lead)."""
    j = tl.arange(0, 32)
    count = _popcount(halves, HW_POPC)
    before = tl.cumsum(count, 0) - count + (lead - 1)      # [R]: -1: ranks count from 1
    shifted = halves[:, None] << (31 - j)[None, :]          # [R, 32]: bit j' on top, below
    kept = tl.reshape(shifted < 0, (TILES * 4096,))
    # the value's index in `packed`; an unkept element's is its kept predecessor's, or
    # lead - 1 >= 0 with none before it
    rank = tl.reshape(before[:, None] + _popcount(shifted, HW_POPC), (TILES * 4096,))
    w = tl.where(kept, tl.gather(packed, rank, 0), 0)
    return tl.reshape(w, (TILES * 64, 64))


@triton.jit
def _fits(start, end, safe_end, CAP: tl.constexpr, ALIGN: tl.constexpr):
    """Whether a group's values (start .. end - 1) fit `_packed_head`'s vector of CAP
    from index (start - 1) rounded down to ALIGN, its aligned read ending by safe_end."""
    base = (start - 1) & -ALIGN
    return (end - base <= CAP) & (((end + ALIGN - 1) & -ALIGN) <= safe_end)


@triton.jit
def _sparse_packed_kernel(x_ptr, halves_ptr, offsets_ptr, values_ptr, scales_ptr, out_ptr,
                          M, N, K, col_tiles, tiles_per_split, safe_end, stride_xm,
                          stride_om, stride_split, HAS_SCALES: tl.constexpr,
                          PARTIAL: tl.constexpr, IEEE: tl.constexpr, HW_POPC: tl.constexpr,
                          PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr,
                          TILES: tl.constexpr, CAP: tl.constexpr, ALIGN: tl.constexpr):
    """`_sparse_tiles_kernel`'s product with each group of TILES column-tiles' values read
    as a few aligned vectors (`_packed_head`) and expanded on chip (`_expand`) for one
    tl.dot over TILES * 64 input channels. Groups whose values do not fit the vector
    are multiplied after the others, tile by tile as `_sparse_tiles_kernel` does (the
    order is the weight's alone: batch invariance holds). Grid and split-K as there."""
    pid_m = tl.program_id(0)
    row_tile = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = row_tile * 64 + tl.arange(0, 64)
    m_mask = offs_m[:, None] < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm    # [BM, 1]
    c = tl.arange(0, TILES * 64)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, 64), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, col_tiles)
    k_end = tl.minimum(K, last * 64)     # x past the run's tiles stays 0 (so its w does)
    row_first = row_tile.to(tl.int64) * col_tiles
    t_end = row_first + last             # the run's tiles: row_first + first .. t_end - 1
    # A group's values start where the previous group's end; PREFETCH loads group g + 1
    # (its offsets loaded a step ahead) while group g is expanded and multiplied.
    t = row_first + first
    start = tl.load(offsets_ptr + t)
    end = tl.load(offsets_ptr + tl.minimum(t + TILES, t_end))
    if PREFETCH:
        next_end = tl.load(offsets_ptr + tl.minimum(t + 2 * TILES, t_end))
        halves, packed, lead, fits, scale = _packed_head(
            halves_ptr, values_ptr, scales_ptr, t, last - first, start, end, safe_end,
            HAS_SCALES, TILES, CAP, ALIGN)
        ch = first * 64 + c
        xt = tl.load(x_rows + ch[None, :], mask=m_mask & (ch[None, :] < k_end), other=0.0)
    left_over = False
    for ti in range(first, last, TILES):
        if not PREFETCH:
            halves, packed, lead, fits, scale = _packed_head(
                halves_ptr, values_ptr, scales_ptr, t, last - ti, start, end, safe_end,
                HAS_SCALES, TILES, CAP, ALIGN)
            ch = ti * 64 + c
            xt = tl.load(x_rows + ch[None, :], mask=m_mask & (ch[None, :] < k_end), other=0.0)
        else:
            halves_n, packed_n, lead_n, fits_n, scale_n = _packed_head(
                halves_ptr, values_ptr, scales_ptr, t + TILES, last - ti - TILES, end,
                next_end, safe_end, HAS_SCALES, TILES, CAP, ALIGN)
            ch = (ti + TILES) * 64 + c
            x_next = tl.load(x_rows + ch[None, :], mask=m_mask & (ch[None, :] < k_end),
                             other=0.0)
            after_end = tl.load(offsets_ptr + tl.minimum(t + 3 * TILES, t_end))
        if fits:
            w = _expand(halves, packed, lead, HW_POPC, TILES)
        else:  # left to the second pass; w 0 (the dot outside the branch: one w layout)
            w = tl.zeros((TILES * 64, 64), dtype=values_ptr.dtype.element_ty)
            left_over = True
        if HAS_SCALES:
            w = (w.to(tl.float32) * scale[:, None]).to(dtype)
        elif values_ptr.dtype.element_ty != dtype:
            w = w.to(tl.float32).to(dtype)
        if IEEE:
            acc = tl.dot(xt, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, w, acc)
        t += TILES
        start = end
        if PREFETCH:
            halves, packed, lead, fits, scale, xt = (halves_n, packed_n, lead_n, fits_n,
                                                     scale_n, x_next)
            end = next_end
            next_end = after_end
        else:
            end = tl.load(offsets_ptr + tl.minimum(t + TILES, t_end))
    if left_over:  # the groups that did not fit, each tile's values loaded one by one
        words_ptr = halves_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
        cols = tl.arange(0, 64)
        for gi in range(first, last, TILES):
            g_start = tl.load(offsets_ptr + row_first + gi)
            g_end = tl.load(offsets_ptr + tl.minimum(row_first + gi + TILES, t_end))
            if not _fits(g_start, g_end, safe_end, CAP, ALIGN):
                for tj in range(gi, tl.minimum(gi + TILES, last)):
                    word, offset, tile_scale = _tile_head(words_ptr, offsets_ptr, scales_ptr,
                                                          row_first + tj, True, HAS_SCALES)
                    w1 = _gather_tile(values_ptr, word, offset, HW_POPC).to(tl.float32)
                    if HAS_SCALES:
                        w1 = w1 * tile_scale
                    ch1 = tj * 64 + cols
                    x1 = tl.load(x_rows + ch1[None, :], mask=m_mask & (ch1[None, :] < K),
                                 other=0.0)
                    if IEEE:
                        acc = tl.dot(x1, w1.to(dtype), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(x1, w1.to(dtype), acc)
    mask = m_mask & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if PARTIAL:  # fp32 partial sums of this split: [splits, M, N]
        tl.store(out + split.to(tl.int64) * stride_split, acc, mask=mask)
    else:
        tl.store(out, acc.to(dtype), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = part[0] + part[1] + ... (ascending, fp32), rounded to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + numel.to(tl.int64) * s + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_kernel(words_ptr, offsets_ptr, values_ptr, scales_ptr, out_ptr, N, K, col_tiles,
                   first_row_tile, stride_o, HAS_SCALES: tl.constexpr, HW_POPC: tl.constexpr):
    """One tile expanded into a dense band of W (out [band rows, K], rows from
    first_row_tile * 64) in out's dtype: program (row-tile in the band, column-tile)."""
    band_tile = tl.program_id(0)
    ti = tl.program_id(1)
    t = (first_row_tile + band_tile).to(tl.int64) * col_tiles + ti
    word, offset, scale = _tile_head(words_ptr, offsets_ptr, scales_ptr, t, ti < col_tiles,
                                     HAS_SCALES)
    w = _gather_tile(values_ptr, word, offset, HW_POPC).to(tl.float32)     # [c, j]
    if HAS_SCALES:
        w = w * scale
    j = tl.arange(0, 64)
    ch = ti * 64 + tl.arange(0, 64)
    rows = band_tile * 64 + j
    mask = ((first_row_tile * 64 + rows)[:, None] < N) & (ch[None, :] < K)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_o + ch[None, :]
    tl.store(out, tl.trans(w).to(out_ptr.dtype.element_ty), mask=mask)


def _dense_bands(x: torch.Tensor, tiles: SparseTiles, out: torch.Tensor,
                 band_rows: int) -> None:
    """out = x @ W.T with W expanded `band_rows` (a multiple of 64) output rows at a time
    (in x's dtype, as the kernel rounds it) and multiplied by torch (cuBLAS on GPUs)."""
    band_tiles = max(1, band_rows // 64)
    values = tiles.values.contiguous()
    scales = tiles.scales.contiguous() if tiles.scales is not None else values
    for first in range(0, tiles.num_row_tiles, band_tiles):
        start = 64 * first
        stop = min(64 * (first + band_tiles), tiles.out_features)
        band = torch.empty(stop - start, tiles.in_features, dtype=x.dtype, device=x.device)
        _expand_kernel[(-(-(stop - start) // 64), tiles.num_col_tiles)](
            tiles.bitmap.contiguous().view(torch.int64), tiles.offsets.contiguous(), values,
            scales, band, tiles.out_features, tiles.in_features, tiles.num_col_tiles, first,
            band.stride(0), HAS_SCALES=tiles.scales is not None, HW_POPC=not _interpreted(),
            num_warps=8)
        out[:, start:stop] = x @ band.T


def _check(x: torch.Tensor, tiles: SparseTiles) -> torch.Tensor:
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"sparse_linear_triton: x is {x.dtype}; the kernel takes "
                         "torch.float32, torch.float16 or torch.bfloat16")
    if x.dim() != 2 or x.shape[1] != tiles.in_features:
        raise ValueError(f"sparse_linear_triton: x {list(x.shape)} is not rows "
                         f"[M, in_features={tiles.in_features}]")
    if tiles.values.dtype not in _VALUE_DTYPES:
        raise ValueError(f"sparse_linear_triton: values are {tiles.values.dtype}; the "
                         "format's are bfloat16, float16, float32 or int8")
    if (tiles.values.dtype == torch.int8) != (tiles.scales is not None):
        raise ValueError("sparse_linear_triton: int8 values need their fp32 scales, and "
                         f"only int8 values have them (values {tiles.values.dtype}, scales "
                         f"{'absent' if tiles.scales is None else 'present'})")
    parts = {"bitmap": tiles.bitmap, "offsets": tiles.offsets, "values": tiles.values,
             "scales": tiles.scales}
    for name, tensor in parts.items():
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"sparse_linear_triton: the tiles' {name} is on {tensor.device}, "
                             f"x on {x.device}; move the tiles to x's device")
    return x if x.stride(1) == 1 else x.contiguous()


def _packed_shape(tiles: SparseTiles) -> dict:
    """The packed variant's constants from the weight alone (never M: batch invariance):
    ALIGN values make one 16-byte vector; one column-tile a step (TILES; two take more
    registers than they save); CAP the vector's length, a power of two holding a whole
    tile's average values (the density times 4096: edge tiles hold fewer) and a quarter
    more (tiles past it take the second pass)."""
    align = _PACKED_VECTOR_BYTES // tiles.values.element_size()
    mean = tiles.values.numel() * 4096 / max(1, tiles.out_features * tiles.in_features)
    cap = triton.next_power_of_2(int(mean * 1.25) + align)
    return {"TILES": 1, "CAP": max(_PACKED_MIN_CAP, min(cap, _PACKED_MAX_CAP)),
            "ALIGN": align}


def _safe_end(values: torch.Tensor, align: int) -> int:
    """Values the storage under `values` holds from its first, rounded down to `align`:
    the packed kernel's aligned vectors may read past the last value up to there."""
    held = values.untyped_storage().nbytes() // values.element_size() - values.storage_offset()
    return held // align * align


def sparse_linear_triton(x: torch.Tensor, tiles: SparseTiles, batch_invariant: bool = True,
                         config: dict | None = None) -> torch.Tensor:
    """x [M, in] @ W.T -> [M, out] in x.dtype, W as bitmap tiles on x's device (trusted:
    whoever loaded them ran `sparse_format.check`). `config` (tests, the benchmark)
    overrides some of `_config`'s launch parameters: variant ("packed" or "gather"),
    BLOCK_M, splits, PREFETCH, num_warps, num_stages, TILES and CAP (packed), dense (and
    its band_rows)."""
    x = _check(x, tiles)
    num_rows, out_features = x.shape[0], tiles.out_features
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    cfg = {**_config(num_rows, tiles, batch_invariant, _num_sms(x.device)), **(config or {})}
    if cfg.pop("dense", False):
        _dense_bands(x, tiles, out, cfg.pop("band_rows", _DENSE_BAND_ROWS))
        return out
    variant = cfg.pop("variant")
    if variant not in _VARIANTS:
        raise ValueError(f"sparse_linear_triton: variant {variant!r} is not one of {_VARIANTS}")
    shape = {name: cfg.pop(name) for name in ("TILES", "CAP", "ALIGN")}
    cfg["num_warps"] = cfg["num_warps"] or _NUM_WARPS[variant, cfg["BLOCK_M"] > 32]
    group = shape["TILES"] if variant == "packed" else 1
    splits = max(1, min(int(cfg.pop("splits", 1)), tiles.num_col_tiles))
    per_split = -(-tiles.num_col_tiles // splits)
    per_split = -(-per_split // group) * group      # whole groups a run
    splits = -(-tiles.num_col_tiles // per_split)   # no empty run
    offsets, values = tiles.offsets.contiguous(), tiles.values.contiguous()
    scales = tiles.scales.contiguous() if tiles.scales is not None else offsets
    static = dict(HAS_SCALES=tiles.scales is not None, IEEE=x.dtype == torch.float32,
                  HW_POPC=not _interpreted(), **cfg)
    if variant == "packed":
        kernel = _sparse_packed_kernel
        bitmap = tiles.bitmap.contiguous().view(torch.int32)
        extra = (_safe_end(values, shape["ALIGN"]),)
        static.update(shape)
    else:
        kernel = _sparse_tiles_kernel
        bitmap = tiles.bitmap.contiguous().view(torch.int64)
        extra = ()
    step = num_rows if splits == 1 else _PARTIAL_ROWS
    for first in range(0, num_rows, step):
        rows = x[first:first + step]
        target = out[first:first + step]
        grid = (triton.cdiv(rows.shape[0], cfg["BLOCK_M"]), tiles.num_row_tiles, splits)
        if splits == 1:
            kernel[grid](rows, bitmap, offsets, values, scales, target, rows.shape[0],
                         out_features, tiles.in_features, tiles.num_col_tiles, per_split,
                         *extra, rows.stride(0), target.stride(0), 0, PARTIAL=False, **static)
            continue
        part = torch.empty(splits, rows.shape[0], out_features, dtype=torch.float32,
                           device=x.device)
        kernel[grid](rows, bitmap, offsets, values, scales, part, rows.shape[0], out_features,
                     tiles.in_features, tiles.num_col_tiles, per_split, *extra,
                     rows.stride(0), part.stride(1), part.stride(0), PARTIAL=True, **static)
        numel = rows.shape[0] * out_features
        _sum_splits_kernel[(triton.cdiv(numel, 1024),)](part, target, numel, SPLITS=splits,
                                                        BLOCK=1024, num_warps=4)
    return out
