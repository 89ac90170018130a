"""Rotary and the KV cache write in one C pass (kv_cache.rotary_cache_native) against
the torch references run one after the other, to the bit: fp32 and bf16, GQA, partial
rotary, the engine's interleaved cache layout, padding slots, and refused input that
leaves the cache untouched."""
import pytest
import torch

from fusegen.kernels import native
from fusegen.kernels.kv_cache import rotary_cache_native, write_kv_cache, \
    write_kv_cache_reference
from fusegen.kernels.rotary import rotary_and_cache, rotary_embedding_reference

if native.library() is None:
    pytest.fail("the CPU kernels did not build here; see the warning above", pytrace=False)


def _case(tokens, hq, hkv, d, half, dtype, num_blocks=6, block_size=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as views of one fused projection, the way the decoder splits them
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = (t.view(tokens, -1, d) for t in (q, k, v))
    table = torch.randn(64, 2 * half, generator=gen).to(dtype)
    cos, sin = table.chunk(2, dim=-1)
    # [blocks, k|v, block_size, Hkv, D]: keys and values of a block side by side
    cache = torch.randn(num_blocks, 2, block_size, hkv, d, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    return q, k, v, cos, sin, cache, positions, slots


def _reference(q, k, v, cos, sin, cache, positions, slots):
    q, k, cache = q.clone(), k.clone(), cache.clone()
    rotary_embedding_reference(positions, q, k, cos, sin)
    keep = slots >= 0
    k_cache, v_cache = cache.unbind(1)
    write_kv_cache_reference(k[keep], v[keep], k_cache, v_cache, slots[keep])
    return q, k, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hq, hkv, d, half", [
    (1, 4, 4, 16, 8), (13, 8, 2, 32, 16), (300, 6, 3, 64, 32), (5, 4, 2, 64, 16)])
def test_one_pass_equals_rotary_then_write(dtype, tokens, hq, hkv, d, half):
    # (5, 4, 2, 64, 16): partial rotary, the last 32 channels of each head pass through.
    # 300 tokens run on two threads, the others on one.
    num_blocks = 48 if tokens == 300 else 6
    q, k, v, cos, sin, cache, positions, slots = _case(tokens, hq, hkv, d, half, dtype,
                                                       num_blocks=num_blocks)
    want_q, want_k, want_cache = _reference(q, k, v, cos, sin, cache, positions, slots)
    rotary_and_cache(positions, q, k, v, cos, sin, *cache.unbind(1), slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(cache, want_cache)


def test_padding_slots_are_rotated_not_stored():
    q, k, v, cos, sin, cache, positions, slots = _case(6, 4, 2, 16, 8, torch.float32)
    slots[[1, 4]] = -1
    want_q, want_k, want_cache = _reference(q, k, v, cos, sin, cache, positions, slots)
    rotary_cache_native(positions, q, k, v, cos, sin, *cache.unbind(1), slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(cache, want_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_alone_takes_the_c_kernel(dtype):
    _, k, v, _, _, cache, _, slots = _case(9, 4, 2, 16, 8, dtype)
    want = cache.clone()
    write_kv_cache_reference(k, v, *want.unbind(1), slots)
    write_kv_cache(k, v, *cache.unbind(1), slots)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("bad, message", [
    ("slot", r"slot 48 outside a KV cache of 6 blocks of 8"),
    ("position", r"positions 0\.\.64 outside the rotary table's 64 rows")])
def test_bad_slot_or_position_is_refused_before_any_write(bad, message):
    q, k, v, cos, sin, cache, positions, slots = _case(7, 4, 2, 16, 8, torch.float32)
    positions[0] = 0
    if bad == "slot":
        slots[5] = 6 * 8
    else:
        positions[5] = 64
    before = (q.clone(), k.clone(), cache.clone())
    with pytest.raises(IndexError, match=message):
        rotary_cache_native(positions, q, k, v, cos, sin, *cache.unbind(1), slots)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, cache)))
