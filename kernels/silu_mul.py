"""The gated MLP activation: silu(gate) * up over the fused gate_up projection.

Semantics are Hugging Face Llama's `act_fn(gate_proj(x)) * up_proj(x)` in the model
dtype: silu is computed in fp32 and rounded, then the product is rounded.

Shapes:
  x        [..., 2 * I]   gate = x[..., :I], up = x[..., I:]
  returns  [..., I]

Triton launch: grid (rows, I / BLOCK); each program one BLOCK-wide slice of a row.
"""
from __future__ import annotations

import torch

from fusegen.kernels import as_rows, elementwise_threads, native, use_native, use_triton
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: the reference still serves
    from fusegen.kernels._triton_stub import tl, triton


# The C kernels' storage types: fp32, and bf16 rounded where the reference rounds.
_NATIVE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_NATIVE_NAME = {dtype: "silu_mul_" + suffix for dtype, suffix in _NATIVE_SUFFIX.items()}


def silu_and_mul(x) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA, the C kernel for fp32 and bf16 on CPUs,
    the torch reference elsewhere."""
    if use_triton(x):
        return silu_and_mul_triton(x)
    if x.dtype in _NATIVE_SUFFIX and use_native(x):
        return silu_and_mul_native(x)
    return silu_and_mul_reference(x)


def silu_and_mul_native(x) -> torch.Tensor:
    """fp32 or bf16 CPU tensors, rows contiguous (kernels/csrc/elementwise.c)."""
    intermediate = x.shape[-1] // 2
    x2 = as_rows(x, 2 * intermediate)
    x_strides = x2.stride()
    assert x2.dtype in _NATIVE_SUFFIX and x_strides[1] == 1, \
        f"rows must be contiguous fp32 or bf16, got {x2.dtype} with strides {x_strides}"
    out = torch.empty((*x.shape[:-1], intermediate), dtype=x.dtype)  # rows I apart
    getattr(native.library(), _NATIVE_NAME[x.dtype])(
        x2.data_ptr(), out.data_ptr(), x2.shape[0], intermediate, x_strides[0], intermediate,
        elementwise_threads(x2.numel()))
    return out


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_out, stride_x, INTERMEDIATE: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTERMEDIATE + offs, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (act * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul_triton(x) -> torch.Tensor:
    """Launcher: checks shapes and strides, then one program per (row, BLOCK slice)."""
    assert x.shape[-1] % 2 == 0, f"last dimension {x.shape[-1]} is not 2 * intermediate"
    assert x.stride(-1) == 1, "the last dimension must be contiguous"
    intermediate = x.shape[-1] // 2
    x2 = as_rows(x, 2 * intermediate)
    out = torch.empty(x2.shape[0], intermediate, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(triton.next_power_of_2(intermediate), 1024)
        grid = (x2.shape[0], triton.cdiv(intermediate, block))
        _silu_and_mul_kernel[grid](out, x2, out.stride(0), x2.stride(0),
                                   INTERMEDIATE=intermediate, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], intermediate)


def silu_and_mul_reference(x) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
