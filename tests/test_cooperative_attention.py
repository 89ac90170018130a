"""Attention over KV split between the device's blocks and the host pool's
(engine/cooperative.py, kernels/cooperative_attention.py): split at every block, the
merged result equals attention over the same keys in one cache."""
import pytest
import torch

from fusegen.engine.cooperative import split_step
from fusegen.kernels import native
from fusegen.kernels.cooperative_attention import (attention_part, empty_partial,
                                                   merge_partials, part_reference)
from fusegen.kernels.paged_attention import paged_attention_reference
from fusegen.kernels.paged_attention_cpu import paged_attention_cpu, paged_decode_native

BS, HQ, HKV, D = 4, 4, 2, 32
NUM_DEVICE = 40  # device blocks; host block h has id NUM_DEVICE + h


def _caches(seed: int, num: int):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num, 2, BS, HKV, D, generator=g)
    return kv, kv[:, 0], kv[:, 1]


def _split_attention(q, requests, split_at, deterministic=False, native_kernels=True,
                     bases=None):
    """requests: [(L, n)] in row order; request i's logical block j is block bases[i] + j
    (default 8 i) of the device cache below split_at[i], of the host cache from it on."""
    dev_kv, dev_k, dev_v = _caches(1, NUM_DEVICE)
    host_kv, host_k, host_v = _caches(2, NUM_DEVICE)
    whole_k = torch.empty(NUM_DEVICE, BS, HKV, D)
    whole_v = torch.empty_like(whole_k)
    tables, whole_tables, lens, starts = [], [], [], [0]
    bases = bases or [8 * i for i in range(len(requests))]
    for (length, n), cut, base in zip(requests, split_at, bases):
        table = [base + j if j < cut else NUM_DEVICE + base + j
                 for j in range(-(-length // BS))]
        for j in range(len(table)):
            whole_k[base + j] = (dev_k if j < cut else host_k)[base + j]
            whole_v[base + j] = (dev_v if j < cut else host_v)[base + j]
        tables.append(table)
        whole_tables.append([base + j for j in range(len(table))])
        lens.append(length)
        starts.append(starts[-1] + n)
    # one quota for all: the requests here each use their own split, so pass each alone
    out, lse = empty_partial(q)
    host_out, host_lse = empty_partial(q)
    for i, cut in enumerate(split_at):
        sub = split_step([tables[i]], [lens[i]], [starts[i], starts[i + 1]], [], NUM_DEVICE,
                         cut, BS, deterministic)
        for part, k, v, o, l in ((sub.device, dev_k, dev_v, out, lse),
                                 (sub.host, host_k, host_v, host_out, host_lse)):
            if native_kernels:
                attention_part(q, k, v, part.tensors(), o, l, scale=D ** -0.5)
            else:
                part_reference(q, k, v, part, o, l, scale=D ** -0.5)
    merged = merge_partials(out, lse, host_out, host_lse)
    width = max(map(len, whole_tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in whole_tables], dtype=torch.int32)
    meta = (bt, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32))
    return merged, (whole_k, whole_v, *meta)


SHAPES = [(13, 1), (13, 13), (13, 5), (16, 16), (16, 4), (9, 2)]


@pytest.mark.parametrize("length, n", SHAPES)
@pytest.mark.parametrize("native_kernels", [True, False])
def test_split_at_every_block_equals_one_cache(length, n, native_kernels):
    if native_kernels and native.library() is None:
        pytest.fail("the C kernels did not build")
    q = torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(length * 100 + n))
    for cut in range(-(-length // BS) + 1):
        merged, (k, v, bt, lens, qsl) = _split_attention(q, [(length, n)], [cut],
                                                         native_kernels=native_kernels)
        expected = paged_attention_reference(q, k, v, bt, lens, qsl, max_query_len=n,
                                             max_seq_len=length, scale=D ** -0.5)
        torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5,
                                   msg=f"split at block {cut}")


def test_mixed_batch_split_per_request():
    requests = [(13, 1), (16, 16), (9, 2), (21, 7)]
    q = torch.randn(sum(n for _, n in requests), HQ, D, generator=torch.Generator().manual_seed(7))
    merged, (k, v, bt, lens, qsl) = _split_attention(q, requests, [2, 0, 3, 1])
    expected = paged_attention_cpu(q, k, v, bt, lens, qsl, max_query_len=16, max_seq_len=21,
                                   scale=D ** -0.5)
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)


def test_lse_of_the_c_kernels_matches_torch():
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(3))
    _, k, v = _caches(1, NUM_DEVICE)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    lens = torch.tensor([13, 5, 16], dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    out, lse = empty_partial(q)
    paged_decode_native(q, k, v, tables, lens, qsl, out, scale=D ** -0.5, lse=lse)
    for i, length in enumerate(lens.tolist()):
        keys = k[tables[i]].flatten(0, 1)[:length].repeat_interleave(HQ // HKV, 1)
        scores = torch.einsum("hd,lhd->hl", q[i] * D ** -0.5, keys)
        torch.testing.assert_close(lse[i], torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


def test_deterministic_rows_do_not_depend_on_the_step():
    """Deterministic mode: a request's rows are bit-identical alone, in a mixed batch, and
    computed as a whole prompt or as chunks (the split fixed per request)."""
    q = torch.randn(13, HQ, D, generator=torch.Generator().manual_seed(11))
    alone, _ = _split_attention(q, [(13, 13)], [2], deterministic=True, bases=[8])
    chunk, _ = _split_attention(q[8:], [(13, 5)], [2], deterministic=True, bases=[8])
    assert torch.equal(alone[8:], chunk)
    other = torch.randn(4, HQ, D, generator=torch.Generator().manual_seed(12))
    mixed, _ = _split_attention(torch.cat([other, q]), [(9, 4), (13, 13)], [1, 2],
                                deterministic=True, bases=[0, 8])
    assert torch.equal(mixed[4:], alone)
