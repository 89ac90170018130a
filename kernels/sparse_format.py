"""fusegen's sparse weight format, version 1: bitmap tiles of 64 x 64 (after Flash-LLM).

A weight W [out, in] (y = x @ W.T) is cut into tiles of TILE_OUT output rows x TILE_IN
input columns, numbered row-tile major: t = to * n_ti + ti. Each tile keeps
- a bitmap, uint64 [64]: word c (local column) has bit j set iff W[64*to + j, 64*ti + c]
  is kept (non-zero); bits past the matrix's edge are 0;
- its non-zeros, packed column by column (local column ascending, then local row
  ascending), so one mask word and the next popcount values give a column's 64 rows,
  which a kernel expands into registers 16 lanes at a time;
- an offset into the packed values (offsets[t + 1] - offsets[t] = the tile's popcount);
- with int8 values, a scale: value = code * scale, scale = max |w| over the tile's
  non-zeros / 127 (0 for an empty tile), codes rounded half to even and clamped to
  [-127, 127]. A kept weight whose code rounds to 0 stays in the bitmap: the bitmap is
  the pruning mask, quantization never changes it.

In a checkpoint the components are safetensors tensors named after the dense weight:
`NAME.sparse_bitmap`, `NAME.sparse_offsets`, `NAME.sparse_values`, `NAME.sparse_scales`
(`tensors`, `from_tensors`). Pure torch, no engine imports.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

TILE_OUT = 64
TILE_IN = 64
FORMAT = "fusegen-bitmap-tiles"
VERSION = 1
VALUE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32, "int8": torch.int8}
SUFFIXES = ("sparse_bitmap", "sparse_offsets", "sparse_values", "sparse_scales")
_BITMAP_TILE_BYTES = 8 * TILE_IN     # one uint64 word per local column
_SHIFTS = torch.arange(TILE_OUT, dtype=torch.int64)


@dataclass(frozen=True, eq=False)
class SparseTiles:
    """One weight's tiles: bitmap uint64 [n_tiles, 64], offsets int64 [n_tiles + 1],
    values [nnz] (bf16 / fp16 / fp32 / int8), scales fp32 [n_tiles] with int8 values
    (else None), and the dense shape. Frozen: the tensors a SparseTiles holds are its
    for life, so a kernel may keep what it derives from them (`kernel_args`)."""
    bitmap: torch.Tensor
    offsets: torch.Tensor
    values: torch.Tensor
    scales: torch.Tensor | None
    out_features: int
    in_features: int
    # the C kernel's description of these tensors, made on its first call
    # (kernels/sparse_linear.py); not part of the format
    kernel_args: bytes | None = field(default=None, init=False, repr=False)

    @property
    def num_row_tiles(self) -> int:
        return -(-self.out_features // TILE_OUT)

    @property
    def num_col_tiles(self) -> int:
        return -(-self.in_features // TILE_IN)

    @property
    def num_tiles(self) -> int:
        return self.num_row_tiles * self.num_col_tiles

    @property
    def nnz(self) -> int:
        return int(self.values.numel())


def _grid(out_features: int, in_features: int) -> tuple[int, int]:
    return -(-out_features // TILE_OUT), -(-in_features // TILE_IN)


def _value_dtype(values_dtype) -> torch.dtype:
    if isinstance(values_dtype, str):
        if values_dtype not in VALUE_DTYPES:
            raise ValueError(f"sparse values dtype {values_dtype!r} is not one of "
                             f"{sorted(VALUE_DTYPES)}")
        return VALUE_DTYPES[values_dtype]
    if values_dtype not in VALUE_DTYPES.values():
        raise ValueError(f"sparse values dtype {values_dtype} is not one of "
                         f"{sorted(VALUE_DTYPES)}")
    return values_dtype


def _to_tiles(w: torch.Tensor, n_to: int, n_ti: int) -> torch.Tensor:
    """w [out, in] -> [n_tiles, 64 (local column c), 64 (local row j)], zero past the edge."""
    out_features, in_features = w.shape
    padded = w.new_zeros(n_to * TILE_OUT, n_ti * TILE_IN)
    padded[:out_features, :in_features] = w
    return (padded.view(n_to, TILE_OUT, n_ti, TILE_IN).permute(0, 2, 3, 1)
            .reshape(n_to * n_ti, TILE_IN, TILE_OUT))


def _from_tiles(tiles: torch.Tensor, n_to: int, n_ti: int) -> torch.Tensor:
    """[n_tiles, c, j] -> [n_to * 64, n_ti * 64] (the inverse of `_to_tiles`, uncropped)."""
    return (tiles.view(n_to, n_ti, TILE_IN, TILE_OUT).permute(0, 3, 1, 2)
            .reshape(n_to * TILE_OUT, n_ti * TILE_IN))


def _words_to_mask(words: torch.Tensor) -> torch.Tensor:
    """uint64 words [...] -> bool [..., 64], element j = bit j."""
    return ((words.view(torch.int64).unsqueeze(-1) >> _SHIFTS) & 1).bool()


def _popcount(words: torch.Tensor) -> torch.Tensor:
    """Bits set in each uint64 word, as int64 (SWAR; the arithmetic shifts of int64 are
    masked off before they matter)."""
    x = words.view(torch.int64)
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return (x * 0x0101010101010101) >> 56


def encode(w: torch.Tensor, values_dtype) -> SparseTiles:
    """The tiles of w [out, in] (its zeros are the pruned weights), values stored as
    `values_dtype` (torch.bfloat16 / float16 / float32 / int8, or its name)."""
    dtype = _value_dtype(values_dtype)
    if w.dim() != 2 or min(w.shape) < 1:
        raise ValueError(f"encode takes a 2-D weight [out, in] with both sizes >= 1, "
                         f"got shape {tuple(w.shape)}")
    if not w.dtype.is_floating_point:
        raise ValueError(f"encode takes a floating-point weight, got {w.dtype}")
    out_features, in_features = w.shape
    n_to, n_ti = _grid(out_features, in_features)
    dense = _to_tiles(w.detach().cpu().float(), n_to, n_ti)      # [n_tiles, c, j]
    mask = dense != 0
    bitmap = (mask.to(torch.int64) << _SHIFTS).sum(-1)            # disjoint bits: no carry
    counts = mask.sum((1, 2))
    offsets = torch.zeros(n_to * n_ti + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    kept = dense[mask]                                           # tile, c, j ascending
    scales = None
    if dtype == torch.int8:
        amax = torch.where(mask, dense.abs(), 0.0).amax((1, 2))
        scales = amax / 127
        per_value = scales.repeat_interleave(counts)
        safe = torch.where(per_value > 0, per_value, 1.0)
        values = torch.round(kept / safe).clamp(-127, 127).to(torch.int8)
    else:
        values = kept.to(dtype)       # w's bf16 / fp16 values pass through fp32 exactly
    return SparseTiles(bitmap.view(torch.uint64), offsets, values.contiguous(), scales,
                       out_features, in_features)



def _expand(tiles: SparseTiles, first: int, last: int) -> torch.Tensor:
    """Tiles [first, last) (whole row-tiles) expanded to fp32 [last - first, 64 c, 64 j]."""
    mask = _words_to_mask(tiles.bitmap[first:last])
    lo, hi = int(tiles.offsets[first]), int(tiles.offsets[last])
    values = tiles.values[lo:hi].float()
    if tiles.scales is not None:
        counts = tiles.offsets[first + 1:last + 1] - tiles.offsets[first:last]
        values = values * tiles.scales[first:last].repeat_interleave(counts)
    dense = torch.zeros(mask.shape, dtype=torch.float32)
    dense[mask] = values
    return dense


def decode(tiles: SparseTiles) -> torch.Tensor:
    """The dense fp32 weight [out, in]."""
    return decode_rows(tiles, 0, tiles.out_features)


def decode_rows(tiles: SparseTiles, start: int, stop: int) -> torch.Tensor:
    """Output rows [start, stop) as dense fp32 [stop - start, in]: a band of whole
    row-tiles, so start is a multiple of 64 and stop a multiple of 64 or out_features."""
    out_features = tiles.out_features
    if not (0 <= start < stop <= out_features) or start % TILE_OUT \
            or (stop % TILE_OUT and stop != out_features):
        raise ValueError(f"decode_rows takes a band of whole row-tiles: start a multiple of "
                         f"{TILE_OUT}, stop a multiple of {TILE_OUT} or out_features "
                         f"({out_features}), start < stop; got [{start}, {stop})")
    n_ti = tiles.num_col_tiles
    first, last = start // TILE_OUT, -(-stop // TILE_OUT)
    dense = _from_tiles(_expand(tiles, first * n_ti, last * n_ti), last - first, n_ti)
    return dense[:stop - start, :tiles.in_features]


def nbytes(tiles: SparseTiles) -> int:
    """A layer's bytes: values + bitmap (512 B a tile) + offsets (8 B a tile + 8) +
    scales (4 B a tile, int8 values only)."""
    n = tiles.num_tiles
    scale_bytes = 4 * n if tiles.values.dtype == torch.int8 else 0
    return (tiles.values.numel() * tiles.values.element_size() + _BITMAP_TILE_BYTES * n
            + 8 * n + 8 + scale_bytes)


def _edge_words(out_features: int, in_features: int) -> torch.Tensor:
    """uint64-as-int64 [n_tiles, 64]: the bits inside the matrix for each tile column."""
    n_to, n_ti = _grid(out_features, in_features)
    rows = (out_features - TILE_OUT * torch.arange(n_to)).clamp(max=TILE_OUT)   # [n_to]
    cols = (in_features - TILE_IN * torch.arange(n_ti)).clamp(max=TILE_IN)      # [n_ti]
    row_words = torch.where(rows == 64, -1, (1 << rows.clamp(max=63)) - 1)      # all 64: ~0
    inside = torch.arange(TILE_IN)[None, :] < cols[:, None]                     # [n_ti, c]
    return torch.where(inside[None], row_words[:, None, None], 0).reshape(n_to * n_ti, TILE_IN)


def check(tiles: SparseTiles, out_features: int, in_features: int) -> None:
    """Raise ValueError naming the component, the tile and what is wrong when `tiles` is
    not a well-formed tile table of a weight [out_features, in_features]."""
    if (tiles.out_features, tiles.in_features) != (out_features, in_features):
        raise ValueError(f"sparse tiles describe a weight [{tiles.out_features}, "
                         f"{tiles.in_features}], expected [{out_features}, {in_features}]")
    if out_features < 1 or in_features < 1:
        raise ValueError(f"sparse weight shape [{out_features}, {in_features}] must be >= 1")
    n_to, n_ti = _grid(out_features, in_features)
    n = n_to * n_ti
    _check_tensor("sparse_bitmap", tiles.bitmap, (torch.uint64,), (n, TILE_IN))
    _check_tensor("sparse_offsets", tiles.offsets, (torch.int64,), (n + 1,))
    values = tiles.values
    if values.dtype not in VALUE_DTYPES.values() or values.dim() != 1:
        raise ValueError(f"sparse_values: expected a 1-D tensor of one of "
                         f"{sorted(VALUE_DTYPES)}, got {values.dtype} of shape "
                         f"{tuple(values.shape)}")
    if values.dtype == torch.int8:
        if tiles.scales is None:
            raise ValueError("sparse_scales: missing; int8 values need one fp32 scale a tile")
        _check_tensor("sparse_scales", tiles.scales, (torch.float32,), (n,))
        bad = ~(torch.isfinite(tiles.scales) & (tiles.scales >= 0))
        if bad.any():
            t = int(bad.nonzero()[0])
            raise ValueError(f"sparse_scales: tile {t} has scale {float(tiles.scales[t])}, "
                             f"expected a finite value >= 0")
    elif tiles.scales is not None:
        raise ValueError(f"sparse_scales: present with {values.dtype} values; scales go "
                         f"only with int8 values")
    offsets, words = tiles.offsets, tiles.bitmap.view(torch.int64)
    outside = words & ~_edge_words(out_features, in_features)
    if outside.any():
        t, c = (int(i) for i in outside.nonzero()[0])
        raise ValueError(f"sparse_bitmap: tile {t} (row-tile {t // n_ti}, column-tile "
                         f"{t % n_ti}) column {c} sets bits past the matrix's edge "
                         f"[{out_features}, {in_features}]")
    if int(offsets[0]) != 0:
        raise ValueError(f"sparse_offsets: offsets[0] is {int(offsets[0])}, expected 0")
    steps = offsets[1:] - offsets[:-1]
    if (steps < 0).any():
        t = int((steps < 0).nonzero()[0])
        raise ValueError(f"sparse_offsets: not monotone at tile {t}: offsets[{t}] = "
                         f"{int(offsets[t])} > offsets[{t + 1}] = {int(offsets[t + 1])}")
    counts = _popcount(tiles.bitmap).sum(-1)
    if (steps != counts).any():
        t = int((steps != counts).nonzero()[0])
        raise ValueError(f"sparse_offsets: tile {t} spans {int(steps[t])} values but its "
                         f"bitmap sets {int(counts[t])} bits")
    if int(offsets[-1]) != values.numel():
        raise ValueError(f"sparse_values: {values.numel()} values, but the offsets and "
                         f"bitmaps count nnz = {int(offsets[-1])}")
    if values.is_floating_point():  # a kept weight that is inf or NaN poisons every token
        bad = ~torch.isfinite(values)
        if bad.any():
            i = int(bad.nonzero()[0])
            t = int(torch.searchsorted(offsets, i, right=True)) - 1
            raise ValueError(f"sparse_values: value {i} (tile {t}) is {float(values[i])}; "
                             "every kept weight must be finite")


def _check_tensor(name: str, tensor: torch.Tensor, dtypes: tuple, shape: tuple) -> None:
    if tensor.dtype not in dtypes or tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected {'/'.join(str(d) for d in dtypes)} of shape "
                         f"{list(shape)}, got {tensor.dtype} of shape {list(tensor.shape)}")


def tensors(name: str, tiles: SparseTiles) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a dense weight `name` stored sparse."""
    out = {f"{name}.sparse_bitmap": tiles.bitmap, f"{name}.sparse_offsets": tiles.offsets,
           f"{name}.sparse_values": tiles.values}
    if tiles.scales is not None:
        out[f"{name}.sparse_scales"] = tiles.scales
    return out


def from_tensors(name: str, found: dict, out_features: int, in_features: int) -> SparseTiles:
    """The tiles of weight `name` from its checkpoint tensors, checked (`check`)."""
    missing = [s for s in SUFFIXES[:3] if f"{name}.{s}" not in found]
    if missing:
        raise ValueError(f"{name}: sparse weight without its {', '.join(missing)}")
    tiles = SparseTiles(found[f"{name}.sparse_bitmap"], found[f"{name}.sparse_offsets"],
                        found[f"{name}.sparse_values"], found.get(f"{name}.sparse_scales"),
                        out_features, in_features)
    try:
        check(tiles, out_features, in_features)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return tiles
