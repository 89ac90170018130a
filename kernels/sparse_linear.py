"""A linear layer whose weight stays in fusegen's sparse tiles (kernels/sparse_format.py):
x @ W.T with W expanded only inside the product ("load as sparse, compute as dense").

Shapes:
  x        [..., in_features] fp32, bf16 or fp16, taken as rows [T, in]
  tiles    SparseTiles of W [out, in]: bitmap uint64 [n_tiles, 64], offsets int64
           [n_tiles + 1], values [nnz] bf16 / fp16 / fp32 / int8, scales fp32 [n_tiles]
           with int8 values
  returns  [..., out] in x.dtype

On CPUs the C kernel (kernels/csrc/sparse_tiles.c) takes fp32 and bf16 x: each column's
mask word expands its packed values into registers and every row of x multiplies them;
above 6 rows a run of tiles is expanded once into a per-thread scratch and every block of
rows runs the dense inner loop over it. Every output element is summed over k in one
order whichever path and thread count (a row's result is the same whatever its batch).
bf16 x against bf16 or int8 values, with AVX512_BF16, takes two channels a step by
vdpbf16ps (pairs of k ascending: other bits than the FMA paths'); int8 values are summed
as codes over a tile, the tile's scale applied once to that sum. CUDA x goes to the
Triton kernel (kernels/triton_sparse.py); fp16 x on CPUs, devices without a kernel and
FUSEGEN_KERNELS=reference take the torch path: a band of row-tiles expanded to fp32 at a
time (never the whole dense weight) and multiplied in fp32. `sparse_linear_into`
writes a product into columns of a wider output; `sparse_linear_parts` multiplies a
fused parameter's parts (q, k, v; gate, up) side by side in one kernel call, their bands
split among the threads as one list. The tiles are trusted here: whoever loads them checks
them once (`sparse_format.check`), not every call; the kernel's description of a weight's
tensors is made once (`SparseTiles.kernel_args`), so a decode call costs little more host
time than a dense one.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fusegen.kernels import use_native, use_triton
from fusegen.kernels.sparse_format import TILE_OUT, SparseTiles, decode, decode_rows

BAND_ROWS = 4 * TILE_OUT  # output rows the torch path expands at a time
MAX_SEGMENTS = 64  # weights a kernel call takes side by side (csrc/sparse_tiles.c's)
_VALUE_TYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.int8: 3}
_NATIVE = {torch.float32: 0, torch.bfloat16: 1}  # x dtypes the C kernel takes: x_bf16


class _Segment(ctypes.Structure):
    """csrc/sparse_tiles.c's segment_t: one weight's tiles in a kernel call."""
    _fields_ = [("bitmap", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("values", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("value_type", ctypes.c_int64)]


def sparse_linear(x: torch.Tensor, tiles: SparseTiles) -> torch.Tensor:
    """Dispatcher: the Triton kernel (kernels/triton_sparse.py) for x on a CUDA GPU with
    the tiles there, the C kernel for fp32 / bf16 x on a CPU where the build has it, else
    the torch path. x [..., in_features] -> [..., out_features] in x.dtype."""
    _check_x(x, tiles)
    if x.dim() != 2:
        rows = sparse_linear(x.reshape(-1, tiles.in_features), tiles)
        return rows.view(*x.shape[:-1], tiles.out_features)
    if use_triton(x) and tiles.bitmap.device == x.device:
        from fusegen.kernels import triton_sparse  # imports Triton: only where it runs

        if triton_sparse.has_triton_sparse(x.device):
            # prefill-sized calls may expand the weight once for cuBLAS; the engine's
            # deterministic mode calls in fixed row tiles (weights/linear.py's row_tiled)
            return triton_sparse.sparse_linear_triton(x, tiles, batch_invariant=False)
    if x.shape[0] and x.dtype in _NATIVE and use_native(x) and has_kernel():
        out = _native_product(x, (tiles,), tiles.out_features)
        if out is not None:
            return out
    return sparse_linear_torch(x, tiles)


def sparse_linear_parts(x: torch.Tensor, parts: Sequence[SparseTiles]) -> torch.Tensor:
    """x [T, in_features] @ [W_0; W_1; ...].T -> [T, sum of the parts' out_features]: a
    fused parameter's parts (all of x's in_features), each product in its columns of one
    output, by one call of the C kernel where it takes x (their bands split among the
    threads together), else part by part through `sparse_linear`. Each part's columns
    have the bits of `sparse_linear(x, part)`."""
    if not parts:
        raise ValueError("sparse_linear_parts takes at least one part")
    first = parts[0]
    width = first.out_features
    if x.dim() != 2 or x.shape[1] != first.in_features or x.dtype not in _NATIVE:
        _check_x(x, first)
        if x.dim() != 2:
            raise ValueError(f"sparse_linear_parts takes rows [T, in], got {list(x.shape)}")
    for tiles in parts[1:]:
        if tiles.in_features != first.in_features:
            raise ValueError(f"sparse_linear_parts: parts of in_features {first.in_features} "
                             f"and {tiles.in_features}; a fused parameter's parts share x")
        width += tiles.out_features
    if (x.shape[0] and x.dtype in _NATIVE and len(parts) <= MAX_SEGMENTS and use_native(x)
            and has_kernel()):
        out = _native_product(x, parts, width)
        if out is not None:
            return out
    if len(parts) == 1:
        return sparse_linear(x, first)
    out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    start = 0
    for tiles in parts:
        stop = start + tiles.out_features
        out[:, start:stop] = sparse_linear(x, tiles)
        start = stop
    return out


def sparse_linear_into(x: torch.Tensor, tiles: SparseTiles, out: torch.Tensor) -> None:
    """x [T, in_features] @ W.T written into `out` [T, out_features] (x.dtype, on x's
    device): the C kernel writes there directly where it takes the call (out may be a
    column slice of a wider output: unit column stride); elsewhere `sparse_linear`'s
    result is copied in."""
    _check_x(x, tiles)
    if x.dim() != 2 or tuple(out.shape) != (x.shape[0], tiles.out_features) \
            or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"sparse_linear_into takes x [T, {tiles.in_features}] and out "
                         f"[T, {tiles.out_features}] of x's dtype and device, got x "
                         f"{list(x.shape)} {x.dtype} and out {list(out.shape)} {out.dtype} "
                         f"on {x.device} / {out.device}")
    if (x.shape[0] and x.dtype in _NATIVE and out.stride(-1) == 1 and use_native(x)
            and has_kernel()
            and _native_product(x, (tiles,), tiles.out_features, out=out) is not None):
        return
    out.copy_(sparse_linear(x, tiles))


def sparse_linear_torch(x: torch.Tensor, tiles: SparseTiles) -> torch.Tensor:
    """BAND_ROWS output rows expanded to fp32 at a time, multiplied in fp32, rounded once
    to x.dtype."""
    _check_x(x, tiles)
    xf = x.float()
    out = torch.empty(*x.shape[:-1], tiles.out_features, dtype=torch.float32,
                      device=x.device)
    for start in range(0, tiles.out_features, BAND_ROWS):
        stop = min(start + BAND_ROWS, tiles.out_features)
        out[..., start:stop] = xf @ decode_rows(tiles, start, stop).to(x.device).T
    return out.to(x.dtype)


def sparse_linear_reference(x: torch.Tensor, tiles: SparseTiles) -> torch.Tensor:
    """The whole weight decoded to dense fp32, F.linear in fp32, rounded to x.dtype
    (tests)."""
    _check_x(x, tiles)
    return F.linear(x.float(), decode(tiles).to(x.device)).to(x.dtype)


def sparse_linear_native(x: torch.Tensor, tiles: SparseTiles | Sequence[SparseTiles],
                         plain: bool = False, lib=None) -> torch.Tensor:
    """The C kernel alone (tests): x [T, in] fp32 or bf16 against one weight's tiles or
    parts side by side (as `sparse_linear_parts`); `plain` takes its plain-C path; `lib`
    another build of csrc/sparse_tiles.c (another CPU's instruction set). RuntimeError
    where this build has no kernel or it declines the call."""
    parts = (tiles,) if isinstance(tiles, SparseTiles) else tuple(tiles)
    _check_x(x, parts[0])
    if x.dim() != 2:
        raise ValueError(f"sparse_linear_native takes rows [T, in], got {list(x.shape)}")
    if x.dtype not in _NATIVE or (lib is None and not has_kernel()):
        raise RuntimeError(f"no C sparse tile kernel for {x.dtype} x in this build")
    out = _native_product(x, parts, sum(t.out_features for t in parts), plain=plain,
                          lib=lib or _library())
    if out is None:
        raise RuntimeError(f"the C sparse tile kernel declined {x.dtype} x of "
                           f"{x.shape[0]} rows with {parts[0].values.dtype} values")
    return out


@functools.cache
def has_kernel() -> bool:
    """Whether this machine's build has the C sparse tile kernel."""
    return _library() is not None


@functools.cache
def kernel_paths() -> int:
    """The build's paths (csrc/sparse_tiles.c's `sparse_tiles_available`): 1 the kernel,
    | 2 AVX-512, | 4 VBMI2's expanding loads, | 8 AVX2, | 16 bf16 x against bf16 values
    by vdpbf16ps, | 32 bf16 x against int8 values by vdpbf16ps; 0 without a build."""
    lib = _library()
    return int(lib.sparse_tiles_available()) if lib is not None else 0


@functools.cache  # on the hot path of every call
def _library():
    from fusegen.kernels import native

    return native.library_with("sparse_tiles_available")


def _check_x(x: torch.Tensor, tiles: SparseTiles) -> None:
    if x.dim() < 1 or x.shape[-1] != tiles.in_features:
        raise ValueError(f"x of shape {list(x.shape)} against a sparse weight "
                         f"[{tiles.out_features}, {tiles.in_features}]: x's last size must "
                         f"be in_features = {tiles.in_features}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"sparse_linear takes fp32, bf16 or fp16 x, got {x.dtype}")


def _kernel_args(tiles: SparseTiles) -> bytes | None:
    """The kernel's `segment_t` of `tiles` (made once, kept on the frozen tiles), or None
    where the kernel cannot read them (not contiguous CPU tensors, as the format encodes
    and loads them)."""
    args = tiles.kernel_args
    if args is None:
        values, scales = tiles.values, tiles.scales
        tensors = (tiles.bitmap, tiles.offsets, values) + (() if scales is None else (scales,))
        if not all(t.is_cpu and t.is_contiguous() for t in tensors):
            return None
        args = bytes(_Segment(tiles.bitmap.data_ptr(), tiles.offsets.data_ptr(),
                              values.data_ptr(), None if scales is None else scales.data_ptr(),
                              tiles.out_features, _VALUE_TYPES[values.dtype]))
        object.__setattr__(tiles, "kernel_args", args)  # frozen: the tensors never change
    return args


def _native_product(x: torch.Tensor, parts: Sequence[SparseTiles], width: int,
                    plain: bool = False, lib=None, out: torch.Tensor | None = None):
    """The C kernel's product of x [T, in] (T >= 0) and the parts side by side into `out`
    ([T, width] of x.dtype, unit column stride, any row stride: columns of a wider
    output) or a new tensor; None where the kernel declines the call."""
    if len(parts) == 1:
        args = _kernel_args(parts[0])
    else:
        each = [_kernel_args(t) for t in parts]
        args = None if None in each else b"".join(each)
    if args is None:
        return None
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], width, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    status = (lib or _library()).sparse_tiles(
        x.data_ptr(), _NATIVE[x.dtype], x.shape[0], x.stride(0), args, len(parts),
        parts[0].in_features, out.data_ptr(), out.stride(0), torch.get_num_threads(),
        int(plain))
    return out if status == 0 else None
