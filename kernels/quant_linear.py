"""A linear layer whose weight stays in its GGUF blocks: x @ W.T with W expanded only
inside the product.

Shapes:
  x        [T, in_features] fp32 or bf16, rows contiguous (T may be 0)
  blocks   uint8 [out_features, row_bytes]: each row one weight row's GGUF blocks as the
           file stores them; row_bytes = in_features // block_size * type_size
           (gguf.constants.GGML_QUANT_SIZES)
  qtype    int, a gguf.GGMLQuantizationType value (one of SUPPORTED)
  returns  [T, out_features] in x.dtype

On CPUs the C kernel (kernels/csrc/quant_gguf.c) expands a few weight rows at a time
into a thread's scratch and multiplies them with up to MAX_KERNEL_ROWS rows of x, so
each weight byte is read once per 64 rows; larger T runs in calls of 64 rows, which
keeps every row's result the same whatever the batch (prefill and decode rows alike).
fp32 x multiplies the fp32 weights (exactly a dequantized model's numbers).

bf16 x, on CPUs with AVX512_VNNI or AVX2 (kernels/quant_vnni.py, csrc/quant_vnni.c, the
same bits on both): x is
quantized to int8 per block of 32 values (one fp32 scale each, as llama.cpp's Q8_0) and
multiplied with the weight codes in integers, every row count in one call, each row's
result independent of the batch. A kept bf16 model's numbers therefore differ from a
dequantized bf16 model's by the activations' int8 rounding. Without either, bf16 x takes
the kernel above, which multiplies the weights as bf16 rounds them (a model dequantized
to bf16 holds the same values).

Every other device, and FUSEGEN_KERNELS=reference, take the reference: dequantize a tile
of output rows and multiply it with torch in fp32 (never a dense copy of the whole layer).
The choice depends on the CPU's flags, x's dtype and, in calls that need not be
batch-invariant, the row count; never on a timing.
"""
from __future__ import annotations

import functools

import torch

from fusegen.kernels import use_native
from fusegen.kernels.gguf_blocks import (  # noqa: F401 - callers name them here too
    BF16, BLOCK_SIZES, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, SUPPORTED, check,
    dequantize_rows)
from fusegen.kernels.quant_vnni import q8_available, quant_linear_q8

# Rows of x per kernel call (the C entry points refuse more): 64 rows of 2,048 bf16
# channels are 256 KiB, read from L2 for each group of weight rows.
MAX_KERNEL_ROWS = 64
REFERENCE_TILE_ROWS = 256  # output rows dequantized at a time by the reference
# Rows of x from which a call that need not be batch-invariant (`batch_invariant=False`)
# expands the weight to x's dtype, DENSE_TILE_ROWS output rows at a time, and multiplies
# it with torch's GEMM (oneDNN): prefill-sized calls, where the GEMM's blocking beats
# the kernel's 64-row calls and the expansion is a small share of the work. Not for bf16
# x where the int8 product runs: it is faster than expansion + GEMM at 256 and 2,048
# rows on SmolLM2's shapes (docs/performance.md).
DENSE_FROM_ROWS = 256
DENSE_TILE_ROWS = 4096
_NATIVE = {torch.float32: ("quant_gguf_f32", 1), torch.bfloat16: ("quant_gguf_bf16", 2)}


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out_features: int,
                 in_features: int, batch_invariant: bool = True) -> torch.Tensor:
    """Dispatcher: bf16 x on a CPU with AVX512_VNNI or AVX2 takes the int8 product (any row
    count, batch-invariant either way); otherwise the C kernel where this build has one
    for (qtype, x.dtype), else the reference. x [..., in_features] is taken as rows
    [T, in_features]. With `batch_invariant=False` the other C-kernel calls of
    DENSE_FROM_ROWS rows or more multiply expanded tiles of the weight with torch's GEMM
    instead (faster; a row's result then depends on the call's row count, as any BLAS's
    does)."""
    check(blocks, qtype, out_features, in_features, x)
    if x.dim() != 2:
        rows = quant_linear(x.reshape(-1, in_features), blocks, qtype, out_features,
                            in_features, batch_invariant)
        return rows.view(*x.shape[:-1], out_features)
    native = has_kernel(qtype, x.dtype) and use_native(x)  # has_kernel: cached, checks dtype
    if native and x.dtype == torch.bfloat16 and x.shape[0] and q8_available(qtype):
        out = quant_linear_q8(x if x.stride(-1) == 1 else x.contiguous(),
                              blocks if blocks.is_contiguous() else blocks.contiguous(),
                              qtype, out_features)
        if out is not None:
            return out
    if native and not batch_invariant and x.shape[0] >= DENSE_FROM_ROWS:
        return _dense_tiles(x, blocks, qtype, out_features, in_features)
    if x.shape[0] and native:
        out = _quant_linear_native(x, blocks, qtype, out_features, in_features)
        if out is not None:
            return out
    return quant_linear_reference(x, blocks, qtype, out_features, in_features)


@functools.cache
def has_kernel(qtype: int, dtype: torch.dtype) -> bool:
    """Whether this machine's build has the C kernel for `qtype` with `dtype` rows of x
    (False under FUSEGEN_KERNELS=reference only through the dispatcher's use_native)."""
    if qtype not in SUPPORTED or dtype not in _NATIVE:
        return False
    lib = _library()
    return lib is not None and bool(lib.quant_gguf_available(qtype) & _NATIVE[dtype][1])


@functools.cache
def _kernel(dtype: torch.dtype):
    return getattr(_library(), _NATIVE[dtype][0])


@functools.cache  # on the hot path of every call
def _library():
    from fusegen.kernels import native

    return native.library_with("quant_gguf_available")


def _quant_linear_native(x, blocks, qtype, out_features, in_features, plain=False):
    x = x if x.stride(-1) == 1 else x.contiguous()
    blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
    num_rows = x.shape[0]
    out = torch.empty(num_rows, out_features, dtype=x.dtype)
    kernel, threads = _kernel(x.dtype), torch.get_num_threads()
    # pointers by arithmetic, not x[first].data_ptr(): a decode step makes ~200 of these
    # calls, and a view costs a couple of microseconds each
    x_ptr, w_ptr, out_ptr, ldx = x.data_ptr(), blocks.data_ptr(), out.data_ptr(), x.stride(0)
    size = x.element_size()
    # MAX_KERNEL_ROWS rows a call: each call reads the blocks once more (a quarter to a
    # half of a bf16 weight's bytes) and keeps its rows of x in L2
    for first in range(0, num_rows, MAX_KERNEL_ROWS):
        rows = min(MAX_KERNEL_ROWS, num_rows - first)
        status = kernel(qtype, x_ptr + first * ldx * size, rows, ldx, w_ptr, out_features,
                        in_features, out_ptr + first * out_features * size, out_features,
                        threads, int(plain))
        if status != 0:
            return None
    return out


def _dense_tiles(x, blocks, qtype, out_features, in_features) -> torch.Tensor:
    """x [T, in] @ W.T, W expanded DENSE_TILE_ROWS output rows at a time into x's dtype
    (each weight as a model dequantized to that dtype holds it) for torch's GEMM."""
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    for first in range(0, out_features, DENSE_TILE_ROWS):
        last = min(first + DENSE_TILE_ROWS, out_features)
        w = dequantize_native(blocks[first:last], qtype, in_features).to(x.dtype)
        torch.mm(x, w.T, out=out[:, first:last] if last - first < out_features else out)
    return out


def quant_linear_native(x, blocks, qtype, out_features, in_features,
                        plain: bool = False) -> torch.Tensor:
    """The C kernel alone (tests); `plain` takes its plain-C expansion of the blocks
    instead of the vectorised one. RuntimeError where it declines the call."""
    check(blocks, qtype, out_features, in_features, x)
    assert x.dim() == 2, "rows [T, in_features]"
    if x.shape[0] == 0:
        return torch.empty(0, out_features, dtype=x.dtype)
    out = _quant_linear_native(x, blocks, qtype, out_features, in_features, plain)
    if out is None:
        raise RuntimeError(f"no C kernel for {SUPPORTED[qtype]} with {x.dtype} x and "
                           f"{x.shape[0]} rows in this build")
    return out


def dequantize_native(blocks: torch.Tensor, qtype: int, in_features: int,
                      plain: bool = False) -> torch.Tensor:
    """[rows, row_bytes] uint8 blocks -> [rows, in_features] fp32 by the C expansion
    (`plain`: its plain-C form)."""
    blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
    out = torch.empty(blocks.shape[0], in_features)
    status = _library().quant_gguf_dequantize_f32(
        qtype, blocks.data_ptr(), blocks.shape[0], in_features, out.data_ptr(),
        torch.get_num_threads(), int(plain))
    if status != 0:
        raise RuntimeError(f"no C expansion of {SUPPORTED[qtype]} blocks in this build")
    return out


def quant_linear_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                           out_features: int, in_features: int) -> torch.Tensor:
    """Dequantize REFERENCE_TILE_ROWS output rows at a time, multiply in fp32."""
    check(blocks, qtype, out_features, in_features, x)
    xf = x.float()
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    for first in range(0, out_features, REFERENCE_TILE_ROWS):
        last = min(first + REFERENCE_TILE_ROWS, out_features)
        w = dequantize_rows(blocks[first:last], qtype, in_features)  # [tile, in]
        out[..., first:last] = xf @ w.T
    return out.to(x.dtype)
