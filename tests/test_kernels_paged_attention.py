"""Paged attention and the KV cache write: the Triton kernels (Triton's interpreter on
CPU, compiled on CUDA) against the torch reference, and the reference itself against a
dense causal attention written out per sequence."""
import functools
import math

import numpy as np
import pytest
import torch

from fusegen.kernels.kv_cache import write_kv_cache_reference, write_kv_cache_triton
from fusegen.kernels.paged_attention import (paged_attention, paged_attention_reference,
                                     paged_attention_triton)
from fusegen.kernels.testing import triton_on

triton = pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                dtype=torch.float32, device="cpu", seed=0):
    """Random cache whose blocks are handed out in shuffled order, block tables padded
    with block 0, and queries for the last q_lens[i] tokens of each sequence."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used:used + n]
        used += n
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    to = functools.partial(torch.Tensor.to, device=device)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return dict(q=to(q), k_cache=to(k_cache), v_cache=to(v_cache),
                block_tables=to(block_tables), seq_lens=to(seq_lens_t),
                query_start_loc=to(query_start_loc), max_query_len=max(q_lens),
                max_seq_len=max(seq_lens), scale=1 / math.sqrt(head_dim))


def _dense_attention(batch, sliding_window):
    """Per sequence: the contiguous keys/values, the causal (and window) mask written
    out position by position, softmax in float64."""
    out = torch.empty(batch["q"].shape, dtype=torch.float64)
    starts = batch["query_start_loc"].tolist()
    block_size, num_kv_heads = batch["k_cache"].shape[1:3]
    group = batch["q"].shape[1] // num_kv_heads
    for i, seq_len in enumerate(batch["seq_lens"].tolist()):
        slots = [(batch["block_tables"][i, p // block_size].item(), p % block_size)
                 for p in range(seq_len)]
        k = torch.stack([batch["k_cache"][b, o] for b, o in slots]).double()  # [L, Hkv, D]
        v = torch.stack([batch["v_cache"][b, o] for b, o in slots]).double()
        q = batch["q"][starts[i]:starts[i + 1]].double()  # [n, Hq, D]
        n = q.shape[0]
        mask = torch.zeros(n, seq_len, dtype=torch.bool)
        for j in range(n):
            pos = seq_len - n + j
            low = pos - sliding_window + 1 if sliding_window else 0
            mask[j, max(low, 0):pos + 1] = True
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * batch["scale"]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out


# (q_lens, seq_lens, Hq, Hkv, head_dim, block_size, sliding_window): every batch mixes
# decode rows (q_len 1) with prefill or chunked-prefill rows in one call.
CASES = {
    "mixed_gqa2": ([1, 7, 1, 20], [1, 7, 33, 45], 4, 2, 32, 8, 0),
    "gqa4_block_edges": ([3, 1, 16], [16, 17, 32], 8, 2, 64, 16, 0),
    "mha_head80_window": ([9, 1, 4], [9, 30, 14], 2, 2, 80, 5, 6),
    "long_prefill_gqa2": ([40, 1, 2], [50, 12, 2], 4, 2, 32, 16, 0),
    "gqa4_window_chunked": ([1, 18, 1], [64, 40, 3], 8, 2, 32, 8, 16),
}


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_dense_attention(case):
    q_lens, seq_lens, hq, hkv, d, bs, window = CASES[case]
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, bs)
    out = paged_attention_reference(**batch, sliding_window=window)
    torch.testing.assert_close(out.double(), _dense_attention(batch, window),
                               atol=1e-5, rtol=1e-5)


def _check_triton(device, batch, window, dtype, **overrides):
    out = triton_on(device, paged_attention_triton)(**batch, sliding_window=window, **overrides)
    assert out.dtype == dtype and out.shape == batch["q"].shape
    exact = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()
             if isinstance(v, torch.Tensor)}
    expected = paged_attention_reference(**{**batch, **exact}, sliding_window=window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, dtype, device):
    q_lens, seq_lens, hq, hkv, d, bs, window = CASES[case]
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, device)
    # Small key tiles so that every sequence spans several tiles of the online softmax.
    _check_triton(device, batch, window, dtype, tile_n=16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [0, 20])
def test_triton_kv_splits_match_reference(window, device):
    # Decode rows with 0..5 key tiles per split, some splits empty, plus a prefill chunk.
    batch = _make_batch([1, 1, 1, 6], [70, 1, 33, 40], 4, 1, 32, 8, device=device)
    _check_triton(device, batch, window, torch.float32, tile_n=16, num_kv_splits=4)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_float16_and_default_tiles(device):
    batch = _make_batch([1, 24, 1], [90, 24, 5], 4, 1, 32, 16, torch.float16, device)
    _check_triton(device, batch, 0, torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_empty_batch(device):
    batch = _make_batch([1], [3], 2, 1, 32, 4, device=device)
    batch.update(q=batch["q"][:0], seq_lens=batch["seq_lens"][:0],
                 block_tables=batch["block_tables"][:0],
                 query_start_loc=batch["query_start_loc"][:1])
    assert triton_on(device, paged_attention_triton)(**batch).shape == (0, 2, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (28, 4, 128), (16, 16, 64), (8, 1, 256)])
def test_cuda_model_shapes_without_host_sync(hq, hkv, d, dtype):
    # Real head counts and lengths, through the dispatcher, with any device->host sync
    # in the launcher turned into an error.
    q_lens = [1] * 6 + [300, 57, 1]
    seq_lens = [1, 17, 255, 256, 1000, 2049, 300, 400, 4000]
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, 16, dtype, "cuda")
    for window in (0, 256):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = paged_attention(**batch, sliding_window=window)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        expected = paged_attention_reference(**batch, sliding_window=window)
        torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_cache_matches_reference(dtype, device):
    num_tokens, num_kv_heads, head_dim, block_size = 11, 3, 80, 5
    gen = torch.Generator().manual_seed(0)
    # key and value are strided views into one fused projection output, as in a model.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1:]
    slots = torch.randperm(7 * block_size, generator=gen)[:num_tokens]
    slots[:2] = torch.tensor([block_size - 1, block_size])  # both sides of a block edge
    cache = torch.randn(7, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected_k, expected_v = cache.clone(), cache.clone() + 1
    write_kv_cache_reference(key, value, expected_k, expected_v, slots)
    k_cache, v_cache = cache.clone().to(device), (cache.clone() + 1).to(device)
    triton_on(device, write_kv_cache_triton)(key.to(device), value.to(device), k_cache, v_cache,
                                 slots.to(device))
    assert torch.equal(k_cache.cpu(), expected_k) and torch.equal(v_cache.cpu(), expected_v)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_cache_skips_negative_slots(device):
    key = torch.ones(3, 2, 32, device=device)
    k_cache = torch.zeros(2, 4, 2, 32, device=device)
    v_cache = torch.zeros_like(k_cache)
    triton_on(device, write_kv_cache_triton)(key, key * 2, k_cache, v_cache,
                                 torch.tensor([5, -1, 0], device=device))
    written = k_cache.flatten(0, 1)[:, 0, 0].tolist()
    assert written == [1, 0, 0, 0, 0, 1, 0, 0]
    assert v_cache.flatten(0, 1)[5].eq(2).all()
