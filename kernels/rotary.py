"""Rotary position embedding, neox style (rotate_half), applied in place to q and k.

Semantics are Hugging Face Llama's exactly: the cos/sin rows of each token's position
are cast to the input dtype, then with x1, x2 the two halves of the rotated part,
  out_first  = x1 * cos - x2 * sin
  out_second = x2 * cos + x1 * sin
each product and sum rounded to the input dtype. Dimensions past the rotary width
(2 * cos.shape[-1], partial rotary) pass through.

Shapes:
  positions  [T] int
  q          [T, Hq, D]     any token and head strides (views of a fused qkv work)
  k          [T, Hkv, D]
  cos, sin   [max_positions, R / 2] half-width tables, R <= D (the engine's are in the
             model dtype)

Triton launch: one program per token rotates all its q and k heads, reading the
token's cos/sin row once.
"""
from __future__ import annotations

import torch

from fusegen.kernels import use_native, use_triton
from fusegen.kernels.kv_cache import rotary_cache_native, write_kv_cache

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: the reference still serves
    from fusegen.kernels._triton_stub import tl, triton


# The C kernels' storage types: fp32, and bf16 rounded where the reference rounds.
_NATIVE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def rotary_embedding(positions, q, k, cos, sin) -> None:
    """Dispatcher: the Triton kernel on CUDA, the C kernel on CPUs when q, k and the
    tables are all fp32 or all bf16 (the engine's tables are in the model dtype), the
    torch reference elsewhere."""
    if use_triton(q):
        return rotary_embedding_triton(positions, q, k, cos, sin)
    same_dtype = q.dtype == k.dtype == cos.dtype == sin.dtype
    if same_dtype and q.dtype in _NATIVE_SUFFIX and use_native(q):
        return rotary_embedding_native(positions, q, k, cos, sin)
    return rotary_embedding_reference(positions, q, k, cos, sin)


def rotary_and_cache(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """`rotary_embedding` on q and k, then `write_kv_cache` of k and v: on CPUs in one
    C pass over the tokens (kv_cache.rotary_cache_native), elsewhere one after the
    other. Same results either way, to the bit."""
    if q.dtype in _NATIVE_SUFFIX and \
            q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype == k_cache.dtype == \
            v_cache.dtype and not use_triton(q) and use_native(q):
        return rotary_cache_native(positions, q, k, v, cos, sin, k_cache, v_cache,
                                   slot_mapping)
    rotary_embedding(positions, q, k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)


def rotary_embedding_native(positions, q, k, cos, sin) -> None:
    """In place on fp32 or bf16 CPU q [T, Hq, D] and k [T, Hkv, D], the tables in the
    same dtype (kernels/csrc/elementwise.c)."""
    from fusegen.kernels import native

    num_tokens, num_heads, head_dim = q.shape
    half = cos.shape[-1]
    assert q.dtype == k.dtype == cos.dtype == sin.dtype and q.dtype in _NATIVE_SUFFIX, \
        f"q {q.dtype}, k {k.dtype}, cos {cos.dtype}, sin {sin.dtype}: one of fp32 or bf16"
    assert 2 * half <= head_dim, f"rotary width {2 * half} > head_dim {head_dim}"
    assert cos.stride() == sin.stride() and cos.stride(1) == 1, \
        "cos and sin must have the same strides, contiguous along R/2"
    assert q.stride(2) == 1 and k.stride(2) == 1, "the head dimension must be contiguous"
    positions = positions if positions.dtype == torch.int64 else positions.long()
    positions = positions.contiguous()
    if num_tokens and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
        # The C kernel indexes the table unchecked.
        raise IndexError(f"positions {int(positions.min())}..{int(positions.max())} outside "
                         f"the rotary table's {cos.shape[0]} rows")
    kernel = getattr(native.library(), f"rotary_{_NATIVE_SUFFIX[q.dtype]}")
    kernel(positions.data_ptr(), q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(),
           num_tokens, num_heads, k.shape[1], half, q.stride(0), q.stride(1), k.stride(0),
           k.stride(1), cos.stride(0), torch.get_num_threads())


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, token, cos, sin, offs_r, NUM_HEADS: tl.constexpr,
            HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, HEADS_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_r[None, :] < HALF)
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_r[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # Round every product and sum to the input dtype, as torch does in that dtype.
    x1c = (x1 * cos).to(dtype).to(tl.float32)
    x2s = (x2 * sin).to(dtype).to(tl.float32)
    x2c = (x2 * cos).to(dtype).to(tl.float32)
    x1s = (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, (x1c - x2s).to(dtype), mask=mask)
    tl.store(first + HALF, (x2c + x1s).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                   Q_HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, HALF_PAD)
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_cos + offs_r, mask=offs_r < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_r, mask=offs_r < HALF, other=0.0)
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]
    _rotate(q_ptr, stride_qt, stride_qh, token, cos, sin, offs_r, NUM_Q_HEADS, Q_HEADS_PAD,
            HALF, HALF_PAD)
    _rotate(k_ptr, stride_kt, stride_kh, token, cos, sin, offs_r, NUM_KV_HEADS, KV_HEADS_PAD,
            HALF, HALF_PAD)


def rotary_embedding_triton(positions, q, k, cos, sin) -> None:
    """Launcher: checks shapes, strides and dtypes, then one program per token."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos.shape[-1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), \
        f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}"
    assert q.dtype == k.dtype, f"q is {q.dtype}, k is {k.dtype}"
    assert positions.shape == (num_tokens,), \
        f"positions {tuple(positions.shape)} != ({num_tokens},)"
    assert cos.shape == sin.shape and cos.dim() == 2, \
        f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be one [max_positions, R/2]"
    assert 2 * half <= head_dim, f"rotary width {2 * half} > head_dim {head_dim}"
    assert cos.stride() == sin.stride() and cos.stride(1) == 1, \
        "cos and sin must have the same strides, contiguous along R/2"
    assert q.stride(2) == 1 and k.stride(2) == 1, "the head dimension must be contiguous"
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), num_warps=4,
        # Each product and sum is rounded as torch rounds it. With fusion on, the compiler
        # turns x1 * cos - x2s into one fma.rn.bf16, which rounds once where torch rounds
        # twice: one ulp off transformers' rotation in some elements (seen on an H100).
        enable_fp_fusion=False)


def rotary_embedding_reference(positions, q, k, cos, sin) -> None:
    half = cos.shape[-1]
    cos_t = cos[positions].unsqueeze(1)  # [T, 1, R/2]
    sin_t = sin[positions].unsqueeze(1)
    for x in (q, k):
        c, s = cos_t.to(x.dtype), sin_t.to(x.dtype)
        x1 = x[..., :half].clone()
        x2 = x[..., half:2 * half].clone()
        x[..., :half] = x1 * c - x2 * s
        x[..., half:2 * half] = x2 * c + x1 * s
