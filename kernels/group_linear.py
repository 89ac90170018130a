"""A linear layer whose weight stays group-quantized (int8 / int4, docs/quantization.md):
x @ W.T with W expanded only inside the product.

Shapes (G = in_features // group_size):
  x        [..., in_features] fp32 or bf16 (fp16: the reference only), taken as rows [T, in]
  qweight  uint8 [out, in] (int8 codes 0..255) or [out, in / 2] (int4: two codes a byte,
           in runs of 32 channels byte k holds channel k low and channel k + 16 high)
  scales   fp16 [out, G]
  zeros    uint8 [out, G], or None: symmetric, the zero point is 128 (int8) / 8 (int4)
  returns  [..., out] in x.dtype

  weight[o, i] = (q[o, i] - zero[o, i // g]) * scale[o, i // g]   (exact in fp32)

On CPUs the C kernel (kernels/csrc/quant_group.c) multiplies up to MAX_KERNEL_ROWS rows
of x a call, expanding the codes in registers (few rows) or into a thread's scratch (many),
fp32 x against the fp32 weights, bf16 x against the weights as bf16 rounds them; larger T
runs in calls of 64 rows, and every output element is summed in one order, so a row's
result is the same whatever its batch and the thread count. Every other device, and
FUSEGEN_KERNELS=reference, take the reference: a tile of output rows dequantized to fp32
and multiplied with torch in fp32 (never a dense copy of the whole layer).

bf16 x, on CPUs with AVX512_VNNI or AVX2 (kernels/group_vnni.py, csrc/quant_group_vnni.c): x is
quantized to int8 per block of 32 values (one fp32 scale each, as llama.cpp's Q8_0) and
multiplied with the codes in integers, every row count in one call, each row's result
independent of the batch. It reads the codes once a call and multiplies 64 byte pairs an
instruction (vdpbf16ps: 32 bf16 pairs, after expanding each code), faster than the bf16
kernel at every row count (docs/performance.md). A bf16 model kept as codes then differs
from one dequantized to bf16 by the activations' int8 rounding. fp32 x keeps the exact
kernel; without VNNI bf16 x takes the bf16 kernel above.
"""
from __future__ import annotations

import functools

import torch

from fusegen.kernels import use_native
from fusegen.kernels.group_codes import (  # noqa: F401 - callers name them here too
    BITS, GROUP_SIZES, MAX_CODE, RUN, SYMMETRIC_ZERO, _check_format, check, pack_int4,
    unpack_int4)
from fusegen.kernels.group_vnni import group_linear_q8, q8_available

# Rows of x per kernel call (the C entry points refuse more), as quant_linear's.
MAX_KERNEL_ROWS = 64
REFERENCE_TILE_ROWS = 256  # output rows dequantized at a time by the reference
_NATIVE = {torch.float32: ("quant_group_f32", 1), torch.bfloat16: ("quant_group_bf16", 2)}
_FP16_MAX = 65504.0


def group_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, bits: int, group_size: int, out_features: int,
                 in_features: int) -> torch.Tensor:
    """Dispatcher: bf16 x on a CPU with AVX512_VNNI or AVX2 takes the int8 product (any row
    count); otherwise the C kernel where this build has one for (bits, x.dtype), else the
    reference. x [..., in_features] is taken as rows [T, in_features]."""
    check(qweight, scales, zeros, bits, group_size, out_features, in_features, x)
    if x.dim() != 2:
        rows = group_linear(x.reshape(-1, in_features), qweight, scales, zeros, bits,
                            group_size, out_features, in_features)
        return rows.view(*x.shape[:-1], out_features)
    native = x.shape[0] and x.dtype in _NATIVE and use_native(x) and has_kernel(bits, x.dtype)
    if native and x.dtype == torch.bfloat16 and q8_available(bits):
        out = group_linear_q8(x if x.stride(-1) == 1 else x.contiguous(), _contiguous(qweight),
                              _contiguous(scales), _contiguous(zeros), bits, group_size,
                              out_features)
        if out is not None:
            return out
    if native:
        out = _group_linear_native(x, qweight, scales, zeros, bits, group_size, out_features,
                                   in_features)
        if out is not None:
            return out
    return group_linear_reference(x, qweight, scales, zeros, bits, group_size, out_features,
                                  in_features)


@functools.cache
def has_kernel(bits: int, dtype: torch.dtype) -> bool:
    """Whether this machine's build has the C kernel for `bits` with `dtype` rows of x
    (False under FUSEGEN_KERNELS=reference only through the dispatcher's use_native)."""
    if bits not in BITS or dtype not in _NATIVE:
        return False
    lib = _library()
    return lib is not None and bool(lib.quant_group_available(bits) & _NATIVE[dtype][1])


@functools.cache
def _kernel(dtype: torch.dtype):
    return getattr(_library(), _NATIVE[dtype][0])


@functools.cache  # on the hot path of every call
def _library():
    from fusegen.kernels import native

    return native.library_with("quant_group_available")


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.is_contiguous() else t.contiguous()


def _group_linear_native(x, qweight, scales, zeros, bits, group_size, out_features,
                         in_features, plain=False):
    x = x if x.stride(-1) == 1 else x.contiguous()
    qweight, scales, zeros = _contiguous(qweight), _contiguous(scales), _contiguous(zeros)
    zeros_ptr = None if zeros is None else zeros.data_ptr()
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    kernel, threads = _kernel(x.dtype), torch.get_num_threads()
    # pointers by arithmetic: indexing x[first] would make a tensor a call (~1 us each)
    ldx, size = x.stride(0), x.element_size()
    x_ptr, out_ptr, q_ptr, s_ptr = x.data_ptr(), out.data_ptr(), qweight.data_ptr(), \
        scales.data_ptr()
    # MAX_KERNEL_ROWS rows a call: each call reads the codes once more and keeps its rows
    # of x in L2; a row's sums never depend on the call it came in
    for first in range(0, x.shape[0], MAX_KERNEL_ROWS):
        rows = min(MAX_KERNEL_ROWS, x.shape[0] - first)
        status = kernel(bits, group_size, x_ptr + first * ldx * size, rows, ldx, q_ptr, s_ptr,
                        zeros_ptr, out_features, in_features,
                        out_ptr + first * out_features * size, out_features, threads,
                        int(plain))
        if status != 0:
            return None
    return out


def group_linear_native(x, qweight, scales, zeros, bits, group_size, out_features,
                        in_features, plain: bool = False) -> torch.Tensor:
    """The C kernel alone (tests); `plain` takes its plain-C expansion and product instead
    of the vectorised ones. RuntimeError where it declines the call."""
    check(qweight, scales, zeros, bits, group_size, out_features, in_features, x)
    assert x.dim() == 2, "rows [T, in_features]"
    if not has_kernel(bits, x.dtype):
        raise RuntimeError(f"no C kernel for int{bits} with {x.dtype} x in this build")
    if x.shape[0] == 0:
        return torch.empty(0, out_features, dtype=x.dtype)
    out = _group_linear_native(x, qweight, scales, zeros, bits, group_size, out_features,
                               in_features, plain)
    if out is None:
        raise RuntimeError(f"no C kernel for int{bits} with {x.dtype} x and "
                           f"{x.shape[0]} rows in this build")
    return out


def dequantize_native(qweight, scales, zeros, bits, group_size, in_features,
                      plain: bool = False) -> torch.Tensor:
    """[rows, in_features] fp32 by the C kernel's expansion (`plain`: its plain-C form)."""
    rows = qweight.shape[0]
    check(qweight, scales, zeros, bits, group_size, rows, in_features)
    qweight, scales, zeros = _contiguous(qweight), _contiguous(scales), _contiguous(zeros)
    out = torch.empty(rows, in_features)
    status = _library().quant_group_dequantize_f32(
        bits, group_size, qweight.data_ptr(), scales.data_ptr(),
        None if zeros is None else zeros.data_ptr(), rows, in_features, out.data_ptr(),
        torch.get_num_threads(), int(plain))
    if status != 0:
        raise RuntimeError(f"no C expansion of int{bits} codes in this build")
    return out


# ---- the torch side: codes <-> values --------------------------------------------------

def dequantize_group(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     bits: int, group_size: int, in_features: int) -> torch.Tensor:
    """The weight fp32 [rows, in_features]: (q - zero) * scale per group, exact in fp32
    (an 8-bit difference times an fp16 scale fits fp32's 24-bit significand)."""
    rows = qweight.shape[0]
    check(qweight, scales, zeros, bits, group_size, rows, in_features)
    codes = unpack_int4(qweight) if bits == 4 else qweight
    groups = in_features // group_size
    q = codes.reshape(rows, groups, group_size).float()
    zero = (zeros.float() if zeros is not None
            else torch.full((rows, groups), float(SYMMETRIC_ZERO[bits]), device=scales.device))
    return ((q - zero[:, :, None]) * scales.float()[:, :, None]).reshape(rows, in_features)


def quantize_group(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """weight [out, in] (any float dtype, computed in fp32) -> (qweight, scales, zeros or
    None), round to nearest (half to even, torch.round), per group of `group_size` channels:

      symmetric:  scale = max|w| / 127 (int8) or / 7 (int4), stored as fp16;
                  q = clamp(round(w / scale), -127..127 | -7..7) + 128 | 8
      asymmetric: lo = min(min w, 0), hi = max(max w, 0) (the range holds zero, so the
                  zero point is a code); scale = (hi - lo) / 255 (int8) or / 15 (int4) as
                  fp16; zero = clamp(round(-lo / scale), 0, 255 | 15);
                  q = clamp(round(w / scale) + zero, 0, 255 | 15)

    Codes divide by the fp16 scale as stored. A group whose scale is 0 in fp16 (all zero,
    or too small for fp16) gets scale 0, zero point 0 (asymmetric) and every code equal to
    its zero point: it dequantizes to zeros. dequantize_group(quantize_group(w)) == w
    exactly when each group of w is n * s for an fp16 s and integers n spanning the whole
    code range (symmetric: max |n| = 127 | 7; asymmetric: max n - min n = 255 | 15 with
    min n <= 0 <= max n), since then every step above is exact in fp32."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight to quantize is {weight.dtype} {list(weight.shape)}; "
                         f"expected a float [out_features, in_features] matrix")
    out_features, in_features = weight.shape
    _check_format(bits, group_size, in_features)
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    if not torch.isfinite(w).all():
        row = int(torch.nonzero(~torch.isfinite(w))[0, 0])
        raise ValueError(f"weight row {row} holds inf or NaN; cannot quantize it")
    top = MAX_CODE[bits]
    # divisions by tensors, not Python numbers: CUDA multiplies by a scalar divisor's
    # reciprocal, which would give other scales (and codes) than the CPU's on some values
    if symmetric:
        steps = top // 2
        zero = torch.full((out_features, w.shape[1]), SYMMETRIC_ZERO[bits], device=w.device)
        amax = w.abs().amax(dim=2)
        scale = _fp16_scale(amax / torch.full_like(amax, steps), bits, group_size)
        sf = scale.float()[:, :, None]
        q = torch.round(w / sf).clamp(-steps, steps) + zero[:, :, None]
        zeros = None
    else:
        lo = w.amin(dim=2).clamp(max=0.0)
        hi = w.amax(dim=2).clamp(min=0.0)
        scale = _fp16_scale((hi - lo) / torch.full_like(lo, top), bits, group_size)
        sf = scale.float()
        zero = torch.where(sf > 0, torch.round(-lo / sf), 0.0).clamp(0, top)
        sf = sf[:, :, None]
        q = (torch.round(w / sf) + zero[:, :, None]).clamp(0, top)
        zeros = zero.to(torch.uint8)
    q = torch.where(sf > 0, q, zero[:, :, None].float())  # scale 0: the zero point
    codes = q.to(torch.uint8).reshape(out_features, in_features)
    qweight = pack_int4(codes) if bits == 4 else codes
    return qweight, scale, zeros


def _fp16_scale(scale: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    if (scale > _FP16_MAX).any():
        row, group = (int(i) for i in torch.nonzero(scale > _FP16_MAX)[0])
        raise ValueError(
            f"weight row {row}, channels {group * group_size}..{(group + 1) * group_size - 1}: "
            f"its int{bits} scale {float(scale[row, group]):.6g} exceeds fp16's {_FP16_MAX:g}; "
            f"such a weight cannot be kept group-quantized")
    return scale.to(torch.float16)


def group_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor | None, bits: int, group_size: int,
                           out_features: int, in_features: int) -> torch.Tensor:
    """Dequantize REFERENCE_TILE_ROWS output rows at a time to fp32, multiply in fp32,
    round to x.dtype."""
    check(qweight, scales, zeros, bits, group_size, out_features, in_features, x)
    xf = x.float()
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32, device=x.device)
    for first in range(0, out_features, REFERENCE_TILE_ROWS):
        tile = slice(first, min(first + REFERENCE_TILE_ROWS, out_features))
        w = dequantize_group(qweight[tile], scales[tile],
                             None if zeros is None else zeros[tile], bits, group_size,
                             in_features)  # [tile, in]
        out[..., tile] = xf @ w.T
    return out.to(x.dtype)
