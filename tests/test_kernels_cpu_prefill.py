"""The CPU prefill attention kernel (kernels/csrc/paged_prefill.c) against the torch
reference: whole prompts, chunks after a cached prefix, GQA and MHA, sliding windows,
block sizes that do not divide the lengths, keys scattered over the cache."""
import pytest
import torch

from fusegen.kernels import native
from fusegen.kernels.paged_attention_cpu import (paged_attention_cpu,
                                                 paged_attention_reference,
                                                 paged_prefill_native)

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler here")


def _case(num_heads, num_kv_heads, head_dim, block_size, specs, seed=0):
    """specs: (query rows, tokens in the sequence after the step) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-length // block_size) for _, length in specs]
    total = sum(blocks) + 3
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=gen)
    order = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(len(specs), max(blocks), dtype=torch.int32)
    at = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = torch.tensor(order[at:at + count])
        at += count
    starts = [0]
    for rows, _ in specs:
        starts.append(starts[-1] + rows)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    lens = torch.tensor([length for _, length in specs], dtype=torch.int32)
    return q, k_cache, v_cache, tables, lens, torch.tensor(starts, dtype=torch.int32)


def _reference(q, k_cache, v_cache, tables, lens, starts, window=0):
    return paged_attention_reference(
        q, k_cache, v_cache, tables, lens, starts, max_query_len=int((starts[1:] - starts[:-1]).max()),
        max_seq_len=int(lens.max()), scale=q.shape[-1] ** -0.5, sliding_window=window)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, specs, window", [
    (8, 4, 64, 16, [(5, 5), (17, 40), (33, 33), (2, 100)], 0),  # prompts and chunks
    (8, 4, 64, 16, [(40, 40), (17, 90)], 20),  # sliding window
    (4, 4, 128, 32, [(70, 70), (9, 200)], 0),  # MHA, head_dim 128
    (12, 2, 32, 8, [(50, 60)], 0),  # six query heads per KV head
    (6, 2, 96, 5, [(13, 13), (7, 30)], 0),  # head_dim 96, block 5
    (2, 1, 32, 1, [(3, 3), (4, 9)], 2),  # one token per block, tiny window
    (3, 3, 256, 16, [(21, 21), (1, 5)], 0),  # head_dim 256, an odd query row
])
def test_prefill_kernel_matches_the_reference(heads, kv_heads, head_dim, block_size, specs,
                                              window):
    q, k_cache, v_cache, tables, lens, starts = _case(heads, kv_heads, head_dim, block_size,
                                                      specs)
    out = torch.full_like(q, float("nan"))
    assert paged_prefill_native(q, k_cache, v_cache, tables, lens, starts, out,
                                list(range(len(specs))), scale=head_dim ** -0.5,
                                sliding_window=window)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, tables, lens, starts,
                                               window), rtol=1e-5, atol=1e-5)


def test_only_the_listed_sequences_are_written():
    q, k_cache, v_cache, tables, lens, starts = _case(4, 2, 32, 4, [(6, 6), (5, 11), (3, 3)])
    out = torch.full_like(q, float("nan"))
    assert paged_prefill_native(q, k_cache, v_cache, tables, lens, starts, out, [0, 2],
                                scale=0.25)
    assert torch.isnan(out[6:11]).all() and not torch.isnan(out[:6]).any()
    assert not torch.isnan(out[11:]).any()


def test_shapes_it_does_not_take_are_declined():
    q, k_cache, v_cache, tables, lens, starts = _case(4, 2, 20, 4, [(6, 6)])  # head_dim 20
    out = torch.full_like(q, float("nan"))
    assert not paged_prefill_native(q, k_cache, v_cache, tables, lens, starts, out, [0],
                                    scale=0.25)
    assert torch.isnan(out).all()
    half = q.half()  # fp16: not a dtype it takes
    assert not paged_prefill_native(half, k_cache.half(), v_cache.half(), tables, lens,
                                    starts, half.clone(), [0], scale=0.25)
    bf16 = q.bfloat16()  # one dtype for all: a bf16 query against fp32 caches is declined
    assert not paged_prefill_native(bf16, k_cache, v_cache, tables, lens, starts,
                                    bf16.clone(), [0], scale=0.25)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, specs, window", [
    (8, 4, 64, 16, [(5, 5), (17, 40), (33, 33), (2, 100)], 0),
    (8, 4, 64, 16, [(40, 40), (17, 90)], 20),
    (4, 4, 128, 32, [(70, 70), (9, 200)], 0),
    (6, 2, 96, 5, [(13, 13), (7, 30)], 0),
])
def test_bf16_is_as_close_to_exact_as_torchs_own(heads, kv_heads, head_dim, block_size,
                                                 specs, window):
    """bf16 queries and caches, sums in fp32. Where the CPU has AVX512_BF16 the kernel
    rounds the probabilities to bf16 before the value product, as torch's fused CPU
    attention (and flash attention on GPUs) does; elsewhere it keeps them in fp32. Either
    way its error against the exact fp32 attention of the same bf16 values is no larger
    than that of torch's own bf16 attention on the same inputs."""
    q, k_cache, v_cache, tables, lens, starts = (
        t.bfloat16() if t.is_floating_point() else t
        for t in _case(heads, kv_heads, head_dim, block_size, specs, seed=5))
    out = torch.full_like(q, float("nan"))
    assert paged_prefill_native(q, k_cache, v_cache, tables, lens, starts, out,
                                list(range(len(specs))), scale=head_dim ** -0.5,
                                sliding_window=window)
    exact = _reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, starts,
                       window)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torchs = _reference(q, k_cache, v_cache, tables, lens, starts, window)  # bf16 SDPA
    error, torchs_error = ((x.float() - exact) for x in (out, torchs))
    assert error.norm() <= 1.05 * torchs_error.norm()
    assert error.abs().max() <= 1.5 * torchs_error.abs().max()
    # and never far: within a few bf16 steps of the exact result
    torch.testing.assert_close(out.float(), exact, rtol=2 ** -6, atol=2 ** -6)


def test_mixed_step_uses_both_kernels():
    """A step of decodes, a whole prompt and a chunk, through the CPU dispatcher."""
    specs = [(1, 30), (12, 12), (1, 7), (9, 44)]
    q, k_cache, v_cache, tables, lens, starts = _case(8, 2, 32, 16, specs, seed=3)
    got = paged_attention_cpu(q, k_cache, v_cache, tables, lens, starts, max_query_len=12,
                              max_seq_len=44, scale=32 ** -0.5)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, tables, lens, starts),
                               rtol=1e-5, atol=1e-5)
