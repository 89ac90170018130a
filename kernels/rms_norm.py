"""RMSNorm, optionally fused with the residual add before it.

Semantics are Hugging Face Llama's exactly: with a residual, h = x + residual in the
input dtype (the decoder layer's add) and h is also returned as the next residual; then
out = weight * (h.float() * rsqrt(mean(h.float()^2) + eps)).to(dtype).

Shapes:
  x, residual   [..., H]     same dtype as weight
  weight        [H]
  returns       out [..., H], or (out, h) with a residual

Triton launch: one program per row, the whole row in one block (H padded to a power of
two), fp32 math with the two roundings to the input dtype that the reference makes.
"""
from __future__ import annotations

import torch

from fusegen.kernels import as_rows, elementwise_threads, native, use_native, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: the reference still serves
    from fusegen.kernels._triton_stub import tl, triton


# The C kernels' storage types: fp32, and bf16 rounded where the reference rounds.
_NATIVE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_NATIVE_NAME = {dtype: "rms_norm_" + suffix for dtype, suffix in _NATIVE_SUFFIX.items()}
# torch sums a row of floats in vectors of 8 and then across the lanes; the C kernel adds
# in the same order, so its mean of squares, and every bf16 rounding after it, is the
# reference's to the bit. 8 on AVX-512 CPUs too: ATen registers sum_stub with
# REGISTER_DISPATCH, which leaves the AVX-512 slot empty, so torch runs its AVX2 sum there
# (the C kernel's 16-lane order is no torch order; tests reach it by patching this).
_SUM_LANES = 8


def rms_norm(x, weight, eps: float, residual=None):
    """Dispatcher: the Triton kernel on CUDA, the C kernel for fp32 and bf16 on CPUs,
    the torch reference elsewhere."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    same_dtype = weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
    if x.dtype in _NATIVE_SUFFIX and same_dtype and use_native(x):
        return rms_norm_native(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def rms_norm_native(x, weight, eps: float, residual=None):
    """fp32 or bf16 CPU tensors, rows contiguous along the hidden dimension
    (kernels/csrc/elementwise.c)."""
    hidden = x.shape[-1]
    if not (x.dtype == weight.dtype and x.dtype in _NATIVE_SUFFIX and weight.is_contiguous()):
        raise AssertionError(f"x {x.dtype} and a contiguous weight {weight.dtype}: one of "
                             f"fp32 or bf16")
    x2 = as_rows(x, hidden)
    x_strides = x2.stride()
    assert x_strides[1] == 1, "the hidden dimension must be contiguous"
    # outputs in x's shape, rows `hidden` apart: no view back at the end
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    kernel = getattr(native.library(), _NATIVE_NAME[x.dtype])
    threads = elementwise_threads(out.numel())
    if residual is None:
        kernel(x2.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, x2.shape[0],
               hidden, eps, x_strides[0], 0, hidden, hidden, _SUM_LANES, threads)
        return out
    res2 = as_rows(residual, hidden)
    res_strides = res2.stride()
    assert res2.shape == x2.shape and res2.dtype == x.dtype and res_strides[1] == 1, \
        f"residual {res2.dtype}{tuple(res2.shape)} does not fit x {x.dtype}{tuple(x2.shape)}"
    res_out = torch.empty_like(out)
    kernel(x2.data_ptr(), res2.data_ptr(), weight.data_ptr(), out.data_ptr(),
           res_out.data_ptr(), x2.shape[0], hidden, eps, x_strides[0], res_strides[0], hidden,
           hidden, _SUM_LANES, threads)
    return out, res_out


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, weight_ptr, residual_ptr, residual_out_ptr, eps,
                     stride_out, stride_x, stride_res, stride_res_out,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + offs, mask=mask, other=0.0)
        h = (x + res.to(tl.float32)).to(dtype)  # the add happens in the model dtype
        tl.store(residual_out_ptr + row * stride_res_out + offs, h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    normed = (x * rstd).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * weight).to(dtype), mask=mask)


def rms_norm_triton(x, weight, eps: float, residual=None):
    """Launcher: checks shapes, strides and dtypes, then one program per row."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight {tuple(weight.shape)} != ({hidden},)"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
    assert x.stride(-1) == 1 and weight.stride(0) == 1, "the hidden dimension must be contiguous"
    x2 = as_rows(x, hidden)
    out = torch.empty_like(x2)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, \
            f"residual {residual.dtype}{tuple(residual.shape)} != x {x.dtype}{tuple(x.shape)}"
        assert residual.stride(-1) == 1, "the residual's hidden dimension must be contiguous"
        res2 = as_rows(residual, hidden)
        res_out = torch.empty_like(x2)
    else:
        res2 = res_out = x2  # unused
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            out, x2, weight, res2, res_out, eps,
            out.stride(0), x2.stride(0), res2.stride(0), res_out.stride(0),
            HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 256, 1), 8))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def rms_norm_reference(x, weight, eps: float, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)
