"""Linear layers over compressed weights on GPUs, in Triton: x @ W.T with W expanded from
its codes in registers, one [BLOCK_K, BLOCK_N] tile at a time, never as a dense copy.

  group_linear_triton   fusegen's group int4 / int8 (docs/quantization.md's fixed layout)
  gguf_linear_triton    a GGUF file's blocks as stored: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
                        Q4_K, Q5_K, Q6_K (the bytes of each row decoded inside the kernel)
  fp8_linear            e4m3 weights with per-output-channel fp32 scales: torch._scaled_mm
                        on GPUs with FP8 units (capability >= 8.9), else the torch fallback

Shapes:
  x        [M, in_features] fp32, fp16 or bf16, rows contiguous (M may be 0)
  returns  [M, out_features] in x.dtype

Kernel: one program per [BLOCK_M, BLOCK_N] output tile (no split-K): it walks the input
channels in tiles of BLOCK_K, expands the weight tile to fp32 exactly as the reference
does, rounds it to x's dtype (as a model dequantized to that dtype holds it; fp32 x keeps
fp32 and multiplies in IEEE fp32, not TF32) and accumulates tl.dot in fp32.

Batch invariance (deterministic mode): an output element is the sum over k-tiles, in
ascending order, of that tile's dot product, and BLOCK_K is one constant (_BLOCK_K,
whatever M), so the tiles and their order along in_features are the same for a row
alone and inside any batch. That is not enough on a GPU: the tensor-core instruction
that sums a k-tile must be the same too. On an H200 (Triton 3.6, int4 [4096 -> 14336])
every config with BLOCK_M 16 or 32 (mma.sync) gives the same bits, every config with
BLOCK_M 64 or 128 (wgmma) gives the same bits, and the two families differ in most rows;
BLOCK_N, num_warps and num_stages change nothing. So
`batch_invariant=True` (the default) keeps BLOCK_M <= 32 for every M, and a row's result
is bit-identical alone or batched (under the interpreter and on the GPU; tests and
tests/gpu/quant_bench.py check both). `batch_invariant=False` lets M > 64 take
BLOCK_M 128 (wgmma): faster prefill, rows then depend on which bucket their call fell in.
"""
from __future__ import annotations

import os
import warnings

import torch

from fusegen.kernels import _triton_available
from fusegen.kernels.group_linear import SYMMETRIC_ZERO, dequantize_group
from fusegen.kernels.group_linear import check as check_group
from fusegen.kernels.quant_linear import SUPPORTED, check, dequantize_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: the references still serve
    from fusegen.kernels._triton_stub import tl, triton

# The reduction tile along in_features, one for every M (see the header): a multiple of
# 32 (int4's packed runs, GGUF's 32-value blocks) and half a K-quant super-block.
_BLOCK_K = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_MIN_SCALE = 1e-12  # an all-zero row or weight channel: codes 0, scale tiny, not 0/0
_REFERENCE_TILE_ROWS = 256  # output rows the fp8 fallback dequantizes at a time
# The Triton row quantizer ran in the interpreter but not yet on a GPU when written: a
# Triton that fails to compile it turns it off (with a warning) rather than fp8_linear.
_ROW_KERNEL = {"usable": True}


def has_triton_quant(device: str | torch.device = "cuda") -> bool:
    """Whether the Triton kernels here can run on `device`: Triton installed and the
    device a CUDA GPU (or any device under TRITON_INTERPRET=1, the tests' interpreter)."""
    if not _triton_available():
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _config(num_rows: int, out_features: int, batch_invariant: bool) -> dict:
    """The launch parameters of a call (measured on an H200 over int4 / int8 at
    [4096 -> 14336] and [14336 -> 4096]): decode rows a 16-row tile, 32 outputs wide (a
    narrow layer still gets enough programs), four stages of loads in flight; more rows
    32-row tiles 64 wide (BLOCK_N 16 and more warps or stages measured no faster), and
    without `batch_invariant` 128 x 128 tiles past 64 rows; BLOCK_N is halved until the
    grid has 128 programs. BLOCK_M stays <= 32 when `batch_invariant` (see the header).
    BLOCK_K is _BLOCK_K always. `config=` on the launchers overrides this (tests,
    tests/gpu/quant_bench.py)."""
    if num_rows <= 16:
        block_m, block_n, warps, stages = 16, 32, 4, 4
    elif num_rows <= 64 or batch_invariant:
        block_m, block_n, warps, stages = 32, 64, 4, 3
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    row_tiles = triton.cdiv(num_rows, block_m)
    while block_n > 32 and row_tiles * triton.cdiv(out_features, block_n) < 128:
        block_n //= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": _BLOCK_K, "num_warps": warps,
            "num_stages": stages}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_x(x: torch.Tensor, in_features: int, what: str) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{what}: x is {_name(x.dtype)}; the kernel takes float32, float16 "
                         "or bfloat16")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"{what}: x {list(x.shape)} is not rows [M, in_features={in_features}]")
    return x if x.stride(1) == 1 else x.contiguous()


def _launch_plan(x: torch.Tensor, out_features: int, batch_invariant: bool,
                 config: dict | None) -> tuple[torch.Tensor, dict | None, tuple | None]:
    """A linear launcher's output [M, out_features] in x's dtype, its launch parameters
    (`config`, else _config's) and its grid of output tiles; no parameters and no grid
    for M = 0 (nothing to launch)."""
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out, None, None
    cfg = config or _config(x.shape[0], out_features, batch_invariant)
    grid = (triton.cdiv(x.shape[0], cfg["BLOCK_M"]), triton.cdiv(out_features, cfg["BLOCK_N"]))
    return out, cfg, grid


@triton.jit
def _output_tile(x_ptr, M, N, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] output tile: its row and column indexes, their
    masks ([BM, 1], [1, BN]) and the pointers to its rows of x ([BM, 1])."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m[:, None] < M
    n_mask = offs_n[None, :] < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    return offs_m, offs_n, m_mask, n_mask, x_rows


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b summed in fp32; fp32 inputs multiply in IEEE fp32 (IEEE), not TF32."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


# -- fusegen group int4 / int8 ---------------------------------------------------------

@triton.jit
def _group_scale_zero(s_rows, z_rows, g, g_tile, n_mask, w_mask, ONE_GROUP: tl.constexpr,
                      HAS_ZEROS: tl.constexpr, ZERO_POINT: tl.constexpr):
    """fp32 scales and zero points of a weight tile: [1, BN] where one group covers the
    whole k-tile (ONE_GROUP, group g_tile), else gathered per element [BK, BN] (group g)."""
    if ONE_GROUP:
        s = tl.load(s_rows + g_tile, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_rows + g_tile, mask=n_mask, other=0).to(tl.float32)
        else:
            z = tl.full(s.shape, ZERO_POINT, tl.float32)
    else:
        s = tl.load(s_rows + g, mask=w_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_rows + g, mask=w_mask, other=0).to(tl.float32)
        else:
            z = tl.full(s.shape, ZERO_POINT, tl.float32)
    return s, z


@triton.jit
def _group_linear_kernel(x_ptr, q_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K,
                         stride_xm, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                         HAS_ZEROS: tl.constexpr, ZERO_POINT: tl.constexpr,
                         IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, m_mask, n_mask, x_rows = _output_tile(x_ptr, M, N, stride_xm, BLOCK_M,
                                                          BLOCK_N)
    dtype = x_ptr.dtype.element_ty
    num_groups = K // GROUP
    s_rows = scales_ptr + offs_n[None, :].to(tl.int64) * num_groups  # [1, BN]
    z_rows = zeros_ptr + offs_n[None, :].to(tl.int64) * num_groups
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 8:
        q_rows = q_ptr + offs_n[None, :].to(tl.int64) * K
        for k0 in range(0, K, BLOCK_K):
            ch = k0 + tl.arange(0, BLOCK_K)  # [BK] input channels
            k_mask = ch[:, None] < K
            w_mask = k_mask & n_mask
            q = tl.load(q_rows + ch[:, None], mask=w_mask, other=0).to(tl.float32)
            s, z = _group_scale_zero(s_rows, z_rows, ch[:, None] // GROUP, k0 // GROUP,
                                     n_mask, w_mask, GROUP % BLOCK_K == 0, HAS_ZEROS, ZERO_POINT)
            w = ((q - z) * s).to(dtype)  # [BK, BN]
            xt = tl.load(x_rows + ch[None, :], mask=m_mask & (ch[None, :] < K), other=0.0)
            acc = _dot(xt, w, acc, IEEE)
    else:
        # int4: byte j of a 32-channel run holds channel j (low nibble) and j + 16 (high),
        # so a tile of BLOCK_K channels is BLOCK_K // 2 consecutive bytes, multiplied as
        # two dots (low nibbles, then high) against x's matching channels.
        q_rows = q_ptr + offs_n[None, :].to(tl.int64) * (K // 2)
        for k0 in range(0, K, BLOCK_K):
            j = tl.arange(0, BLOCK_K // 2)
            ch_lo = k0 + (j // 16) * 32 + j % 16  # [BK/2]; ch_lo + 16 is the high nibble's
            k_mask = ch_lo[:, None] < K
            w_mask = k_mask & n_mask
            b = tl.load(q_rows + (k0 // 2 + j)[:, None], mask=w_mask, other=0)
            # a byte's two channels share their group
            s, z = _group_scale_zero(s_rows, z_rows, ch_lo[:, None] // GROUP, k0 // GROUP,
                                     n_mask, w_mask, GROUP % BLOCK_K == 0, HAS_ZEROS, ZERO_POINT)
            w_lo = (((b & 0xF).to(tl.float32) - z) * s).to(dtype)
            w_hi = (((b >> 4).to(tl.float32) - z) * s).to(dtype)
            x_mask = m_mask & (ch_lo[None, :] < K)
            x_lo = tl.load(x_rows + ch_lo[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (ch_lo + 16)[None, :], mask=x_mask, other=0.0)
            acc = _dot(x_lo, w_lo, acc, IEEE)
            acc = _dot(x_hi, w_hi, acc, IEEE)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(dtype), mask=m_mask & n_mask)


def group_linear_triton(x, qweight, scales, zeros, bits: int, group_size: int,
                        out_features: int, in_features: int, batch_invariant: bool = True,
                        config: dict | None = None) -> torch.Tensor:
    """x [M, in] @ W.T for W in fusegen's group int4/int8 (zeros None: symmetric)."""
    check_group(qweight, scales, zeros, bits, group_size, out_features, in_features, x)
    x = _check_x(x, in_features, f"int{bits} group linear")
    out, cfg, grid = _launch_plan(x, out_features, batch_invariant, config)
    if grid is None:
        return out
    _group_linear_kernel[grid](
        x, qweight.contiguous(), scales.contiguous(),
        (zeros if zeros is not None else scales).contiguous(), out,
        x.shape[0], out_features, in_features, x.stride(0), out.stride(0),
        BITS=bits, GROUP=group_size, HAS_ZEROS=zeros is not None,
        ZERO_POINT=float(SYMMETRIC_ZERO[bits]),
        IEEE=x.dtype == torch.float32, **cfg)
    return out


def group_linear_reference(x, qweight, scales, zeros, bits: int, group_size: int,
                           out_features: int, in_features: int) -> torch.Tensor:
    """The kernel's arithmetic in torch: the weight in fp32, rounded to x's dtype, the
    product summed in fp32, rounded to x's dtype."""
    check_group(qweight, scales, zeros, bits, group_size, out_features, in_features, x)
    w = dequantize_group(qweight, scales, zeros, bits, group_size, in_features).to(x.device)
    return (x.float() @ w.to(x.dtype).float().T).to(x.dtype)


# -- GGUF blocks -----------------------------------------------------------------------

@triton.jit
def _f16_at(ptr, mask):
    """The little-endian float16 at byte pointer(s) `ptr`, as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(ptr, index, mask):
    """Value `index` % 32 of a 32-value run of nibbles at `ptr` (16 bytes: byte j holds
    value j low, value j + 16 high), as int32."""
    byte = tl.load(ptr + index % 16, mask=mask, other=0).to(tl.int32)
    return (byte >> ((index % 32) // 16 * 4)) & 0xF


@triton.jit
def _k_scale_min(base, sub, mask):
    """Q4_K / Q5_K: sub-block `sub`'s 6-bit scale and min from the 12 bytes at base + 4
    (gguf's Q4_K.get_scale_min)."""
    i = sub % 4
    a = tl.load(base + 4 + i, mask=mask, other=0).to(tl.int32)
    b = tl.load(base + 8 + i, mask=mask, other=0).to(tl.int32)
    c = tl.load(base + 12 + i, mask=mask, other=0).to(tl.int32)
    sc = tl.where(sub < 4, a & 63, (c & 0xF) | ((a >> 2) & 0x30))
    mn = tl.where(sub < 4, b & 63, (c >> 4) | ((b >> 2) & 0x30))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _gguf_weights(rows, ch, mask, QTYPE: tl.constexpr):
    """fp32 weights [BK, BN] of input channels `ch` [BK, 1] in the block rows starting
    at byte pointers `rows` [1, BN]; each formula is gguf/quants.py's dequantizer's."""
    if QTYPE == 8:  # Q8_0: 34 bytes / 32: d, int8 q[32]
        base = rows + (ch // 32) * 34
        q = tl.load(base + 2 + ch % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = q.to(tl.float32) * _f16_at(base, mask)
    elif QTYPE == 2:  # Q4_0: 18 bytes / 32: d, nibbles[16]; (q - 8) * d
        base = rows + (ch // 32) * 18
        w = _f16_at(base, mask) * (_nibble(base + 2, ch, mask) - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1: 20 bytes / 32: d, m, nibbles[16]; d * q + m
        base = rows + (ch // 32) * 20
        q = _nibble(base + 4, ch, mask).to(tl.float32)
        w = _f16_at(base, mask) * q + _f16_at(base + 2, mask)
    elif QTYPE == 6 or QTYPE == 7:  # Q5_0 (22 bytes): d, qh[4], nibbles; Q5_1 (24): d, m, ...
        size = 22 + (QTYPE - 6) * 2  # constexpr arithmetic: 22 or 24
        high = 2 + (QTYPE - 6) * 2  # qh's offset: 2 or 4
        base = rows + (ch // 32) * size
        v = ch % 32
        hb = (tl.load(base + high + v // 8, mask=mask, other=0).to(tl.int32) >> (v % 8)) & 1
        q = (_nibble(base + high + 4, ch, mask) | (hb << 4)).to(tl.float32)
        if QTYPE == 6:
            w = _f16_at(base, mask) * (q - 16.0)
        else:
            w = _f16_at(base, mask) * q + _f16_at(base + 2, mask)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K (144 bytes / 256), Q5_K (176)
        size = 144 + (QTYPE - 12) * 32  # 144 or 176
        base = rows + (ch // 256) * size
        v = ch % 256
        sub = v // 32  # 8 sub-blocks of 32, each with a 6-bit scale and min
        sc, mn = _k_scale_min(base, sub, mask)
        qs = 16 + (QTYPE - 12) * 32  # the nibbles' offset: 16 or 48
        byte = tl.load(base + qs + (v // 64) * 32 + v % 32, mask=mask, other=0).to(tl.int32)
        q = (byte >> ((sub % 2) * 4)) & 0xF
        if QTYPE == 13:  # the fifth bit: bit `sub` of qh[v % 32] (qh at base + 16)
            hb = tl.load(base + 16 + v % 32, mask=mask, other=0).to(tl.int32)
            q = q | (((hb >> sub) & 1) << 4)
        w = (_f16_at(base, mask) * sc) * q.to(tl.float32) - _f16_at(base + 2, mask) * mn
    else:  # Q6_K: 210 bytes / 256: ql[128], qh[64], int8 scales[16], d
        base = rows + (ch // 256) * 210
        v = ch % 256
        half = v // 128
        r = v % 128
        lo = tl.load(base + half * 64 + r % 64, mask=mask, other=0).to(tl.int32)
        lo = (lo >> ((r // 64) * 4)) & 0xF
        hi = tl.load(base + 128 + half * 32 + r % 32, mask=mask, other=0).to(tl.int32)
        hi = (hi >> ((r // 32) * 2)) & 3
        scale = tl.load(base + 192 + v // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        d = _f16_at(base + 208, mask) * scale.to(tl.float32)
        w = d * ((lo | (hi << 4)) - 32).to(tl.float32)
    return tl.where(mask, w, 0.0)


@triton.jit
def _gguf_linear_kernel(x_ptr, blocks_ptr, out_ptr, M, N, K, row_bytes, stride_xm,
                        stride_om, QTYPE: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, m_mask, n_mask, x_rows = _output_tile(x_ptr, M, N, stride_xm, BLOCK_M,
                                                          BLOCK_N)
    dtype = x_ptr.dtype.element_ty
    rows = blocks_ptr + offs_n[None, :].to(tl.int64) * row_bytes  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ch = k0 + tl.arange(0, BLOCK_K)
        w = _gguf_weights(rows, ch[:, None], (ch[:, None] < K) & n_mask, QTYPE).to(dtype)
        xt = tl.load(x_rows + ch[None, :], mask=m_mask & (ch[None, :] < K), other=0.0)
        acc = _dot(xt, w, acc, IEEE)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(dtype), mask=m_mask & n_mask)


def gguf_linear_triton(x, blocks, qtype: int, out_features: int, in_features: int,
                       batch_invariant: bool = True, config: dict | None = None
                       ) -> torch.Tensor:
    """x [M, in] @ W.T for W as GGUF blocks uint8 [out, row_bytes] of type `qtype`."""
    row_bytes = check(blocks, qtype, out_features, in_features)
    x = _check_x(x, in_features, f"{SUPPORTED[qtype]} linear")
    out, cfg, grid = _launch_plan(x, out_features, batch_invariant, config)
    if grid is None:
        return out
    _gguf_linear_kernel[grid](
        x, blocks.contiguous(), out, x.shape[0], out_features, in_features, row_bytes,
        x.stride(0), out.stride(0), QTYPE=int(qtype), IEEE=x.dtype == torch.float32,
        **cfg)
    return out


def gguf_linear_reference(x, blocks, qtype: int, out_features: int, in_features: int
                          ) -> torch.Tensor:
    """The kernel's arithmetic in torch: gguf's dequantizer to fp32, rounded to x's
    dtype, the product summed in fp32 (quant_linear_reference without the rounding)."""
    check(blocks, qtype, out_features, in_features, x)
    w = dequantize_rows(blocks.cpu(), qtype, in_features).to(x.device)
    return (x.float() @ w.to(x.dtype).float().T).to(x.dtype)


# -- FP8 (e4m3) weights ----------------------------------------------------------------

def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    # amax / 448 by a tensor: CUDA divides a tensor by a Python number as a product with
    # its reciprocal (an ulp off at times), which would make the GPU's codes differ from
    # the CPU's where a value lands on a tie between two e4m3 values
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(_FP8_MIN_SCALE)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense weight [out, in] -> (float8_e4m3fn codes [out, in], fp32 scales [out]) with
    weight ~= codes * scale[:, None]; each output channel's largest |value| maps to 448."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_fp8 takes a float weight [out, in]; got {weight.dtype} "
                         f"{list(weight.shape)}")
    amax = weight.float().abs().amax(dim=1)
    if not torch.isfinite(amax).all():
        row = int(torch.nonzero(~torch.isfinite(amax))[0, 0])
        raise ValueError(f"quantize_fp8: weight row {row} holds inf or NaN; cannot quantize it")
    scale = _fp8_scale(amax)
    codes = (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return codes.to(torch.float8_e4m3fn), scale


def quantize_fp8_rows(x: torch.Tensor, per_tensor: bool = False):
    """Activations [M, in] -> (e4m3 codes, fp32 scales [M, 1]): one scale per row
    (a row's codes depend on it alone) or, `per_tensor`, one for all rows."""
    amax = x.float().abs().amax(dim=1, keepdim=True)
    if per_tensor:
        amax = amax.amax().expand_as(amax).contiguous()
    scale = _fp8_scale(amax)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, BLOCK: tl.constexpr):
    """One row of x: its largest |value| / 448 as the scale (IEEE division, as torch's
    division by a tensor), then x / scale clamped to +-448 and rounded to e4m3."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), 448.0), 1e-12)  # FP8_MAX, _FP8_MIN_SCALE
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=offs < K)


def quantize_fp8_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_rows(x) in one Triton launch, one program per row: the same scales
    and (on the GPU, whose conversion rounds to nearest even) the same codes."""
    x = _check_x(x, x.shape[-1], "fp8 row quantization")
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        block = min(triton.next_power_of_2(x.shape[1]), 2048)
        _fp8_rows_kernel[(x.shape[0],)](x, codes, scale, x.shape[1], x.stride(0), BLOCK=block,
                                        num_warps=4)
    return codes, scale


def has_fp8_units(device: torch.device | str) -> bool:
    """A CUDA device of capability 8.9 or later (Ada, Hopper, Blackwell)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def check_fp8(weight_fp8, weight_scale, bias, in_features: int | None = None) -> None:
    if weight_fp8.dtype != torch.float8_e4m3fn or weight_fp8.dim() != 2:
        raise ValueError(f"weight_fp8 is float8_e4m3fn [out, in]; got {weight_fp8.dtype} "
                         f"{list(weight_fp8.shape)}")
    out_features = weight_fp8.shape[0]
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (out_features,):
        raise ValueError(f"weight_scale is float32 [{out_features}] (one per output channel); "
                         f"got {weight_scale.dtype} {list(weight_scale.shape)}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias is [{out_features}]; got {list(bias.shape)}")
    if in_features is not None and weight_fp8.shape[1] != in_features:
        raise ValueError(f"x [.., {in_features}] does not match weight_fp8 "
                         f"{list(weight_fp8.shape)}")


def fp8_linear(x, weight_fp8, weight_scale, bias=None, per_tensor: bool = False
               ) -> torch.Tensor:
    """x [M, in] @ (weight_fp8 * weight_scale[:, None]).T + bias, in x.dtype. x is
    quantized to e4m3 per row (or `per_tensor`) and both scales applied to the fp32 sums:
    by torch._scaled_mm (cuBLASLt) on GPUs with FP8 units, by `fp8_linear_reference`
    (the same arithmetic in torch) elsewhere. cuBLASLt picks its algorithm by M, so on
    the GPU a row's result may depend on the batch; deterministic mode calls this in
    fixed row tiles (FP8Linear does)."""
    check_fp8(weight_fp8, weight_scale, bias, x.shape[-1])
    x = _check_x(x, weight_fp8.shape[1], "fp8 linear")
    if not has_fp8_units(x.device) or x.shape[0] == 0:
        return fp8_linear_reference(x, weight_fp8, weight_scale, bias, per_tensor)
    x_fp8 = None
    if not per_tensor and _ROW_KERNEL["usable"] and _triton_available():
        # one launch, not torch's nine small ones (the whole GEMM of a decode step is tens
        # of microseconds)
        try:
            x_fp8, x_scale = quantize_fp8_rows_triton(x)
        except Exception as exc:  # noqa: BLE001 - a Triton build that cannot compile it
            _ROW_KERNEL["usable"] = False
            warnings.warn(f"fp8_linear: the Triton row quantizer failed ({exc!r:.300}); "
                          "quantizing x with torch from now on", RuntimeWarning)
    if x_fp8 is None:
        x_fp8, x_scale = quantize_fp8_rows(x, per_tensor)
    # rowwise scaling: scale_a [M, 1], scale_b [1, N], bf16 out; weight column-major
    out = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=x_scale,
                           scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)
    out = out.to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def fp8_linear_reference(x, weight_fp8, weight_scale, bias=None, per_tensor: bool = False
                         ) -> torch.Tensor:
    """The fallback: x quantized as on the GPU, codes times codes summed in fp32, both
    scales applied to the sums, a tile of output rows dequantized at a time (never a
    dense copy of the layer); rounded to bf16 as _scaled_mm's output, then to x.dtype."""
    check_fp8(weight_fp8, weight_scale, bias, x.shape[-1])
    x_fp8, x_scale = quantize_fp8_rows(x, per_tensor)
    xf = x_fp8.float()
    out = torch.empty(x.shape[0], weight_fp8.shape[0], dtype=torch.float32, device=x.device)
    for first in range(0, weight_fp8.shape[0], _REFERENCE_TILE_ROWS):
        last = min(first + _REFERENCE_TILE_ROWS, weight_fp8.shape[0])
        sums = xf @ weight_fp8[first:last].float().T
        out[:, first:last] = sums * x_scale * weight_scale[first:last]
    out = out.to(torch.bfloat16).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)
