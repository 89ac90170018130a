"""bf16 rows of x against GGUF blocks by int8 products (kernels/csrc/quant_vnni.c):
x quantized per block of 32 values to int8 with one fp32 scale, as llama.cpp's Q8_0,
each block's dot product taken in integers (AVX512_VNNI's vpdpbusd, or on AVX2 CPUs
vpmaddubsw + vpmaddwd with the same bits), then scaled in fp32.

Shapes: x [T, in_features] bf16, blocks uint8 [out_features, row_bytes] (as
kernels/quant_linear.py), returns [T, out_features] bf16.

Numerics (the C kernel's and this module's reference): per row and block of 32 values
d = amax / 127 in fp32 and q = round(x * (1 / d)), ties to even, d = 0 giving q = 0. The
product is then exact integer arithmetic per block, scaled by the weight's fp32 factors;
the kernel sums the scaled blocks in fp32 (in a fixed order: each element's value depends
only on its row of x and its weight row) and rounds once to bf16.

Repacked blocks (pack_blocks, in place): each group of 16 weight rows
interleaved field by field as the kernel's registers hold them (16 rows' fp16 scales side
by side, their codes 4 bytes a row at a time), so a call loads them as they lie instead
of transposing 16 rows' bytes and gathering their scales; the same bytes, the same bits
(quant_linear_q8_packed). A resident GGUFLinear repacks its own blocks
(engine/weights/quantized.py).
"""
from __future__ import annotations

import functools

import torch

from fusegen.kernels.gguf_blocks import (BLOCK_SIZES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K,
                                         Q8_0, SUPPORTED, check, dequantize_rows)

BLOCK = 32  # activation values per int8 block
GROUP = 16  # rows (output columns) a repacked group holds: one a 32-bit lane of a zmm
# A block's fields as (byte offset, bytes, interleave width) in the repacked layout: each
# group of GROUP rows holds, block by block, every field's GROUP copies side by side in
# the field's order, `width` bytes of a row at a time (fp16 scales 2, codes and packed
# scale words 4: the unit the kernel's registers hold a row's values in).
FIELDS = {
    Q4_0: ((0, 2, 2), (2, 16, 4)),
    Q4_1: ((0, 2, 2), (2, 2, 2), (4, 16, 4)),
    Q5_0: ((0, 2, 2), (2, 4, 4), (6, 16, 4)),
    Q5_1: ((0, 2, 2), (2, 2, 2), (4, 4, 4), (8, 16, 4)),
    Q8_0: ((0, 2, 2), (2, 32, 4)),
    Q4_K: ((0, 2, 2), (2, 2, 2), (4, 140, 4)),
    Q5_K: ((0, 2, 2), (2, 2, 2), (4, 172, 4)),
    Q6_K: ((0, 208, 4), (208, 2, 2)),
}


@functools.cache  # on the hot path of every call
def _library():
    from fusegen.kernels import native

    return native.library_with("quant_gguf_q8_available")


@functools.cache
def q8_available(qtype: int) -> bool:
    """Whether this machine's build has the int8 product for `qtype` (AVX512_VNNI or
    AVX2; the C side knows the types quant_linear.SUPPORTED lists)."""
    lib = _library()
    return lib is not None and bool(lib.quant_gguf_q8_available(qtype))


@functools.cache
def q8_packed_available(qtype: int) -> bool:
    """Whether this machine's build multiplies `qtype`'s repacked blocks (pack_blocks):
    wherever it has the int8 product (AVX2 builds read a group of 16 rows as two chunks
    of 8)."""
    lib = _library()
    return lib is not None and bool(lib.quant_gguf_q8_packed_available(qtype))


def pack_blocks(blocks: torch.Tensor, qtype: int, in_features: int) -> None:
    """Repack uint8 [out, row_bytes] blocks as stored in place, by the C kernels: each
    whole group of GROUP rows becomes its blocks in turn, each block's fields (FIELDS)
    interleaved across the group's rows; the last out % GROUP rows stay as they were. Row
    r is then no longer weight row r: only quant_linear_q8_packed and unpack_blocks read
    them. The same bytes (pack_blocks_reference's)."""
    _repack(blocks, qtype, in_features, unpack=False)


def unpack_blocks(blocks: torch.Tensor, qtype: int, in_features: int) -> None:
    """pack_blocks undone in place: the blocks as stored."""
    _repack(blocks, qtype, in_features, unpack=True)


def _repack(blocks, qtype, in_features, unpack):
    check(blocks, qtype, blocks.shape[0], in_features)
    if qtype not in FIELDS or not blocks.is_cpu or not blocks.is_contiguous():
        raise ValueError(f"no repacked layout for {SUPPORTED.get(qtype, qtype)} blocks "
                         f"({blocks.device}, contiguous: {blocks.is_contiguous()}); "
                         f"contiguous CPU blocks of {', '.join(SUPPORTED[q] for q in FIELDS)}")
    lib = _library()
    if lib is None or lib.quant_gguf_q8_repack(qtype, blocks.data_ptr(), blocks.shape[0],
                                               in_features, int(unpack)) != 0:
        raise RuntimeError(f"no C repacking of {SUPPORTED[qtype]} blocks in this build")


def packed_rows(blocks: torch.Tensor, qtype: int, in_features: int,
                ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64, any shape, flattened) of pack_blocks' layout as stored: uint8
    [ids.numel(), row_bytes], each row gathered from its lane of its group's interleaved
    fields (the last out % GROUP rows copied), by the C kernels. An embedding table tied
    to a repacked head is looked up so: one copy of the blocks serves both. IndexError
    naming an id outside the table's rows."""
    rows, row_bytes = blocks.shape
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.numel(), row_bytes, dtype=torch.uint8)
    lib = _library()
    if lib is None or not hasattr(lib, "quant_gguf_q8_packed_rows"):
        raise RuntimeError(f"no C lookup of repacked {SUPPORTED.get(qtype, qtype)} rows in "
                           "this build")
    if lib.quant_gguf_q8_packed_rows(qtype, blocks.data_ptr(), rows, in_features,
                                     flat.data_ptr(), flat.numel(), out.data_ptr()) != 0:
        bad = flat[(flat < 0) | (flat >= rows)]
        if bad.numel():
            raise IndexError(f"row {int(bad[0])} is outside the {rows} rows of the blocks")
        check(blocks, qtype, rows, in_features)  # names a bad type or in_features
        raise ValueError(f"no repacked layout for {SUPPORTED.get(qtype, qtype)} blocks")
    return out


def pack_blocks_reference(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """pack_blocks' layout by torch (tests): a new tensor."""
    return _regroup(blocks, qtype, pack=True)


def _regroup(blocks: torch.Tensor, qtype: int, pack: bool) -> torch.Tensor:
    rows, row_bytes = blocks.shape
    bytes_ = BLOCK_SIZES[qtype][1]
    groups, nb = rows // GROUP, row_bytes // bytes_
    out = blocks.clone(memory_format=torch.contiguous_format)
    # [groups, GROUP rows, nb, bytes] -> per field [groups, nb, words, GROUP rows, width]
    per_row = blocks[:groups * GROUP].reshape(groups, GROUP, nb, bytes_).permute(0, 2, 1, 3)
    parts = [per_row[..., off:off + size].reshape(groups, nb, GROUP, size // width, width)
             .transpose(2, 3).reshape(groups, nb, GROUP * size)
             for off, size, width in FIELDS[qtype]]
    out[:groups * GROUP] = torch.cat(parts, dim=-1).reshape(groups * GROUP, row_bytes)
    return out


def quant_linear_q8_packed(x: torch.Tensor, packed: torch.Tensor, qtype: int,
                           out_features: int) -> torch.Tensor:
    """quant_linear_q8 over pack_blocks' layout, unchecked (a GGUFLinear's hot path):
    the same bits. None where the kernel declines the call."""
    return _call(_library().quant_gguf_q8_packed_bf16, x, packed, qtype, out_features)


def quant_linear_q8(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                    out_features: int) -> torch.Tensor:
    """The C kernel, unchecked (the dispatcher's hot path): x [T >= 1, in] bf16 with unit
    stride along in, blocks contiguous. None where the kernel declines the call."""
    return _call(_library().quant_gguf_q8_bf16, x, blocks, qtype, out_features)


def _call(kernel, x: torch.Tensor, w: torch.Tensor, qtype: int,
          out_features: int) -> torch.Tensor | None:
    """`kernel` (one of the two entry points, the same arguments) on all the threads."""
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    status = kernel(qtype, x.data_ptr(), rows, x.stride(0), w.data_ptr(), out_features,
                    in_features, out.data_ptr(), out_features, torch.get_num_threads())
    return out if status == 0 else None


def quant_linear_q8_native(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out_features: int,
                           in_features: int, packed: bool = False) -> torch.Tensor:
    """The C kernel alone (tests, benchmarks), `packed`: over pack_blocks' layout;
    RuntimeError where this build has none."""
    check(blocks, qtype, out_features, in_features, x)
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 rows [T, {in_features}]; got {x.dtype} {list(x.shape)}")
    if x.shape[0] == 0:
        return torch.empty(0, out_features, dtype=torch.bfloat16)
    x = x if x.stride(-1) == 1 else x.contiguous()
    kernel, available = ((quant_linear_q8_packed, q8_packed_available) if packed
                         else (quant_linear_q8, q8_available))
    out = kernel(x, blocks.contiguous(), qtype, out_features) if available(qtype) else None
    if out is None:
        raise RuntimeError(f"no int8 (AVX512_VNNI or AVX2) kernel for "
                           f"{'repacked ' if packed else ''}{SUPPORTED[qtype]} in this build")
    return out


def quantize_rows_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernel's quantization of bf16 x [T, K]: codes int8 [T, K], d fp32 [T, K/32]."""
    rows, k = x.shape
    if k % BLOCK:
        raise ValueError(f"x's rows are quantized per {BLOCK} values; {k} is not a multiple")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(rows, k, dtype=torch.int8)
    d = torch.empty(rows, k // BLOCK)
    lib = _library()
    if lib is None or lib.quant_gguf_q8_quantize_bf16(x.data_ptr(), rows, x.stride(0), k,
                                                      q.data_ptr(), d.data_ptr()) != 0:
        raise RuntimeError("no int8 (AVX512_VNNI or AVX2) quantization in this build")
    return q, d


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the kernel's quantization (the same bits): x [T, K] -> codes int8
    [T, K] and d fp32 [T, K/32]."""
    rows, k = x.shape
    if k % BLOCK:
        raise ValueError(f"x's rows are quantized per {BLOCK} values; {k} is not a multiple")
    xf = x.float().reshape(rows, k // BLOCK, BLOCK)
    d = xf.abs().amax(-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xf * inverse[..., None])  # ties to even, as vcvtps2dq
    return q.to(torch.int8).reshape(rows, k), d


def quant_linear_q8_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: int,
                              out_features: int, in_features: int) -> torch.Tensor:
    """The exact value the kernel approximates, fp64 [T, out_features]: x quantized as the
    kernel does (quantize_rows), times the weights as the file defines them, summed in
    fp64 (each product of an int8 code, its fp32 d and an fp32 weight is exact there but
    for the last of 53 bits). The kernel's fp32 sums of the blocks differ from it by their
    rounding only, then by one rounding to bf16."""
    check(blocks, qtype, out_features, in_features, x)
    q, d = quantize_rows(x.reshape(-1, in_features))
    xq = (q.double().reshape(q.shape[0], -1, BLOCK) * d.double()[..., None]).reshape(q.shape)
    w = dequantize_rows(blocks, qtype, in_features).double()
    return xq @ w.T
