"""Writing a step's new keys and values into the paged KV cache.

Shapes:
  key/value      [T, Hkv, D]
  k/v_cache      [num_blocks, block_size, Hkv, D]  any block stride (keys and values
                 of a block may sit side by side in one tensor)
  slot_mapping   [T] int64: block_id * block_size + offset for each token

Triton launch: one program per token copies its [Hkv, D] key and value rows into the
slot (any block_size, any row strides, D padded to a power of two with a mask). A
negative slot is skipped by the kernel (padding tokens); the reference requires every
slot to be valid.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from fusegen.kernels import native, use_native, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: the reference still serves
    from fusegen.kernels._triton_stub import tl, triton


def write_kv_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Dispatcher: the Triton kernel on CUDA, the C kernel on CPUs, the torch reference
    elsewhere."""
    if use_triton(key):
        return write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    if key.dtype in _NATIVE_CACHE and use_native(key):
        return rotary_cache_native(None, None, key, value, None, None, k_cache, v_cache,
                                   slot_mapping)
    return write_kv_cache_reference(key, value, k_cache, v_cache, slot_mapping)


class CacheStrides(ctypes.Structure):
    # Mirrors cache_strides_t in csrc/elementwise.c (element strides).
    _fields_ = [(name, ctypes.c_int64) for name in
                ("q_t", "q_h", "k_t", "k_h", "v_t", "v_h", "kc_b", "kc_s", "kc_h",
                 "vc_b", "vc_s", "vc_h", "cs")]


_NATIVE_CACHE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_NATIVE_NAME = {dtype: "rotary_cache_" + suffix for dtype, suffix in _NATIVE_CACHE.items()}


@functools.lru_cache(maxsize=256)  # a few layouts per model: built once, not per call
def _cache_strides(q, k, v, k_cache, v_cache, cos_row: int) -> tuple[CacheStrides, int]:
    """The CacheStrides struct of these tensors' strides, and its address."""
    struct = CacheStrides(*q[:2], *k[:2], *v[:2], *k_cache[:3], *v_cache[:3], cos_row)
    return struct, ctypes.addressof(struct)


def rotary_cache_native(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """On CPUs, in one pass over the step's tokens (kernels/csrc/elementwise.c): rotary
    on q and k in place (as `rotary_embedding`; skipped when `positions` is None), then
    each token's key and value written to its slot of the cache (as `write_kv_cache`; a
    negative slot is padding, not stored). Same dtype everywhere; fp16 without rotary.
    The C side checks every position and slot before it writes anything."""
    num_tokens, num_kv_heads, head_dim = k.shape
    rotate = positions is not None
    dtype = k.dtype  # the checks are one pass: a decode step makes this call once a layer
    k_strides, v_strides = k.stride(), v.stride()
    kc_strides, vc_strides = k_cache.stride(), v_cache.stride()
    q_strides, cos_strides = (q.stride(), cos.stride()) if rotate else ((0, 0, 1), (0, 1))
    layout_ok = (v.dtype == k_cache.dtype == v_cache.dtype == dtype
                 and k.is_cpu and v.is_cpu and k_cache.is_cpu and v_cache.is_cpu
                 and k_strides[-1] == v_strides[-1] == kc_strides[-1] == vc_strides[-1] == 1)
    if rotate:
        layout_ok = (layout_ok and q.dtype == cos.dtype == sin.dtype == dtype
                     and q.is_cpu and cos.is_cpu and sin.is_cpu
                     and q_strides[-1] == cos_strides[-1] == sin.stride(-1) == 1)
    if not layout_ok:
        tensors = (k, v, k_cache, v_cache) + ((q, cos, sin) if rotate else ())
        raise AssertionError(f"one CPU dtype for all of "
                             f"{[(tuple(t.shape), t.dtype) for t in tensors]}, each with a "
                             f"contiguous head dimension")
    assert v.shape == k.shape and k_cache.shape == v_cache.shape and \
        k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"key {tuple(k.shape)}, value {tuple(v.shape)}, caches {tuple(k_cache.shape)}"
    assert slot_mapping.shape == (num_tokens,), \
        f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)"
    slots = slot_mapping.to(torch.int64).contiguous()
    half, num_heads = 0, 0
    if rotate:
        assert dtype != torch.float16, "fp16 has no C rotary: rotate with the reference"
        num_heads, half = q.shape[1], cos.shape[-1]
        assert 2 * half <= head_dim and cos_strides == sin.stride(), \
            f"rotary width {2 * half} > head_dim {head_dim}, or cos/sin strides differ"
        positions = positions.to(torch.int64).contiguous()
    strides = _cache_strides(q_strides, k_strides, v_strides, kc_strides, vc_strides,
                             cos_strides[0])
    block_size = k_cache.shape[1]
    failed = getattr(native.library(), _NATIVE_NAME[dtype])(
        positions.data_ptr() if rotate else None, q.data_ptr() if rotate else None,
        k.data_ptr(), v.data_ptr(), cos.data_ptr() if rotate else None,
        sin.data_ptr() if rotate else None, k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), num_tokens, num_heads, num_kv_heads, half, head_dim,
        strides[1], cos.shape[0] if rotate else 0,
        k_cache.shape[0] * block_size, block_size, torch.get_num_threads())
    if failed == 1:
        raise IndexError(f"positions {int(positions.min())}..{int(positions.max())} outside "
                         f"the rotary table's {cos.shape[0]} rows")
    if failed == 2:
        raise IndexError(f"slot {int(slots.max())} outside a KV cache of "
                         f"{k_cache.shape[0]} blocks of {block_size}")


@triton.jit
def _write_kv_cache_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    row = token.to(tl.int64)
    k = tl.load(key_ptr + row * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + row * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h * stride_kch
             + offs_d, k, mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h * stride_vch
             + offs_d, v, mask=mask)


def write_kv_cache_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Launcher: checks shapes, strides and dtypes, then one program per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"value {tuple(value.shape)} != key {tuple(key.shape)}"
    assert k_cache.shape == v_cache.shape, f"k_cache {k_cache.shape} != v_cache {v_cache.shape}"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"cache [.., .., Hkv, D] = {tuple(k_cache.shape)} does not fit key {tuple(key.shape)}"
    assert key.dtype == value.dtype == k_cache.dtype == v_cache.dtype, \
        f"dtypes key {key.dtype}, value {value.dtype}, cache {k_cache.dtype}, {v_cache.dtype}"
    assert slot_mapping.shape == (num_tokens,), \
        f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping is {slot_mapping.dtype}"
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name}: the head dimension must be contiguous"
        assert t.device == slot_mapping.device, \
            f"{name} is on {t.device}, slot_mapping on {slot_mapping.device}"
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        num_warps=4)


def write_kv_cache_reference(key, value, k_cache, v_cache, slot_mapping) -> None:
    for cache, rows in ((k_cache, key), (v_cache, value)):
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)
        else:  # a view into a cache that keeps each block's keys and values side by side
            block_size = cache.shape[1]
            cache[slot_mapping // block_size, slot_mapping % block_size] = rows
