"""bf16 rows of x against a group-quantized int8 / int4 weight by int8 products
(kernels/csrc/quant_group_vnni.c): x quantized per block of 32 values to int8 with one
fp32 scale (as llama.cpp's Q8_0, bit for bit kernels/quant_vnni.py's quantization), each
block's dot product with the weight codes taken in integers (AVX512_VNNI, or AVX2 with
the same bits), then scaled in fp32.

Shapes: x [T, in_features] bf16; qweight, scales, zeros as kernels/group_linear.py;
returns [T, out_features] bf16.

Numerics (the kernel's, and group_linear_q8_reference's bit for bit): per row of x and
block b of 32 channels in group g,
  isum = sum (code - zero) * q_x              exact integers
  acc  = fma(float(isum), scale_g * d_b, acc)  fp32, blocks in ascending order from 0
and acc is rounded once to bf16. An element's value depends only on its row of x and its
weight row: the same whatever the batch, the row's place in it and the thread count.
"""
from __future__ import annotations

import functools

import torch

from fusegen.kernels.group_codes import SYMMETRIC_ZERO, check, unpack_int4
from fusegen.kernels.quant_vnni import BLOCK, quantize_rows


@functools.cache  # on the hot path of every call
def _library():
    from fusegen.kernels import native

    return native.library_with("quant_group_q8_available")


@functools.cache
def q8_available(bits: int) -> bool:
    """Whether this machine's build has the int8 product for int`bits` codes
    (AVX512_VNNI or AVX2)."""
    lib = _library()
    return lib is not None and bool(lib.quant_group_q8_available(bits))


def group_linear_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None, bits: int, group_size: int,
                    out_features: int) -> torch.Tensor | None:
    """The C kernel, unchecked (the dispatcher's hot path): x [T >= 1, in] bf16 with unit
    stride along in, the weight's tensors contiguous. None where the kernel declines."""
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    status = _library().quant_group_q8_bf16(
        bits, group_size, x.data_ptr(), rows, x.stride(0), qweight.data_ptr(),
        scales.data_ptr(), None if zeros is None else zeros.data_ptr(), out_features,
        in_features, out.data_ptr(), out_features, torch.get_num_threads())
    return out if status == 0 else None


def group_linear_q8_native(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor | None, bits: int, group_size: int,
                           out_features: int, in_features: int) -> torch.Tensor:
    """The C kernel alone (tests, benchmarks); RuntimeError where this build has none."""
    check(qweight, scales, zeros, bits, group_size, out_features, in_features, x)
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 rows [T, {in_features}]; got {x.dtype} "
                         f"{list(x.shape)}")
    if x.shape[0] == 0:
        return torch.empty(0, out_features, dtype=torch.bfloat16)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = None
    if q8_available(bits):
        out = group_linear_q8(x, qweight.contiguous(), scales.contiguous(),
                              None if zeros is None else zeros.contiguous(), bits, group_size,
                              out_features)
    if out is None:
        raise RuntimeError(f"no int8 (AVX512_VNNI or AVX2) kernel for int{bits} weights in "
                           "this build")
    return out


def group_linear_q8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                              zeros: torch.Tensor | None, bits: int, group_size: int,
                              out_features: int, in_features: int) -> torch.Tensor:
    """The kernel's numbers in torch, bit for bit (see the top of this file): x [T, in]
    bf16 -> [T, out_features] bf16."""
    check(qweight, scales, zeros, bits, group_size, out_features, in_features, x)
    rows, blocks = x.shape[0], in_features // BLOCK
    q, d = quantize_rows(x.reshape(rows, in_features))  # int8 [T, K], fp32 [T, B]
    codes = (unpack_int4(qweight) if bits == 4 else qweight).int()
    zero = (zeros.int() if zeros is not None
            else torch.full_like(scales, SYMMETRIC_ZERO[bits], dtype=torch.int32))
    w = codes - zero.repeat_interleave(group_size, dim=1)  # [N, K], code - zero
    # every block's integer dot product, exact in fp64 (|isum| < 2^21): [T, N, B]
    isum = torch.einsum("tbi,nbi->tnb", q.double().reshape(rows, blocks, BLOCK),
                        w.double().reshape(out_features, blocks, BLOCK)).float()
    per_block = scales.float().repeat_interleave(group_size // BLOCK, dim=1)  # [N, B]
    sd = per_block[None] * d[:, None, :]  # fp32 products, [T, N, B]
    acc = torch.zeros(rows, out_features)
    for b in range(blocks):
        acc = fma_f32(isum[:, :, b], sd[:, :, b], acc)
    return acc.bfloat16()


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c for fp32 tensors rounded once to fp32, as a fused multiply-add does: the
    product is exact in fp64, the sum's rounding error is kept (TwoSum) and the fp64 sum
    rounded to odd, which then rounds to fp32 as the exact value would."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    t = s - p
    e = (p - (s - t)) + (c - t)  # s + e == p + c exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(e > 0, torch.full_like(s, float("inf")), torch.full_like(s, -float("inf")))
    s = torch.where((e != 0) & even, torch.nextafter(s, toward), s)
    return s.float()
