"""The device part of cooperative attention through the Triton paged attention kernel
(kernels/paged_attention.py with its log-sum-exp; Triton's interpreter on CPU, compiled
on CUDA): merged with a host part split at every block, it equals attention over the
same keys in one cache; its log-sum-exp and the rows it does not reach match the torch
reference part."""
import pytest
import torch

from fusegen.engine.cooperative import split_step
from fusegen.kernels.cooperative_attention import (Segments, empty_partial, merge_partials,
                                                   part_reference, triton_part)
from fusegen.kernels.paged_attention import paged_attention_reference
from fusegen.kernels.testing import triton_on

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]
BS, HQ, HKV, D = 4, 4, 2, 32
NUM = 64  # blocks in each pool; request i's logical block j is block 8 i + j in its pool


def _batch(length: int, n: int, cuts: list[int]):
    """One request of `length` tokens (its last n query rows) per cut: block j of request
    i in the device pool when j < cuts[i], else in the host pool. Returns the step's
    split (each request split at its own cut), the pools, and one cache holding all."""
    g = torch.Generator().manual_seed(length * 100 + n)
    dev_k, dev_v, host_k, host_v = torch.randn(4, NUM, BS, HKV, D, generator=g).unbind(0)
    whole_k, whole_v = torch.zeros(NUM, BS, HKV, D), torch.zeros(NUM, BS, HKV, D)
    q = torch.randn(n * len(cuts), HQ, D, generator=g)
    dev, host = Segments([], [], [], [], []), Segments([], [], [], [], [])
    tables = []
    for i, cut in enumerate(cuts):
        blocks = [8 * i + j for j in range(-(-length // BS))]
        for j, b in enumerate(blocks):
            whole_k[b] = (dev_k if j < cut else host_k)[b]
            whole_v[b] = (dev_v if j < cut else host_v)[b]
        table = [b if j < cut else NUM + b for j, b in enumerate(blocks)]
        tables.append(blocks)
        sub = split_step([table], [length], [n * i, n * (i + 1)], [], NUM, cut, BS, False)
        for mine, theirs in ((dev, sub.device), (host, sub.host)):
            for field in Segments.__slots__:
                getattr(mine, field).extend(getattr(theirs, field))
    bt = torch.tensor(tables, dtype=torch.int32)
    expected = paged_attention_reference(
        q, whole_k, whole_v, bt, torch.full((len(cuts),), length, dtype=torch.int32),
        torch.arange(0, n * len(cuts) + 1, n, dtype=torch.int32), max_query_len=n,
        max_seq_len=length, scale=D ** -0.5)
    return q, dev, host, (dev_k, dev_v), (host_k, host_v), expected


def _device_part(device, q, seg, k, v, **launch):
    part = seg.tensors().to(device)
    out, lse = empty_partial(q.to(device))
    triton_on(device, triton_part)(q.to(device), k.to(device), v.to(device), part, out, lse,
                                   scale=D ** -0.5, **launch)
    return out.cpu(), lse.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("length, n", [(13, 1), (13, 5), (9, 9), (16, 3)])
def test_triton_device_part_merged_at_every_split(device, length, n):
    cuts = list(range(-(-length // BS) + 1))  # 0: all on the host, last: all on the device
    q, dev, host, (dev_k, dev_v), (host_k, host_v), expected = _batch(length, n, cuts)
    out, lse = _device_part(device, q, dev, dev_k, dev_v)
    ref_out, ref_lse = empty_partial(q)
    part_reference(q, dev_k, dev_v, dev, ref_out, ref_lse, scale=D ** -0.5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)  # -inf where unreached
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)  # zeros there
    host_out, host_lse = empty_partial(q)
    part_reference(q, host_k, host_v, host, host_out, host_lse, scale=D ** -0.5)
    merged = merge_partials(out, lse, host_out, host_lse)
    for i, cut in enumerate(cuts):
        torch.testing.assert_close(merged[n * i:n * (i + 1)], expected[n * i:n * (i + 1)],
                                   rtol=1e-5, atol=1e-5, msg=f"split at block {cut}")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_device_part_with_split_keys_and_deterministic(device):
    """Decode rows with the keys split across programs (the reduce kernel writes the
    log-sum-exp), and deterministic mode's one-row segments."""
    length, cuts = 29, [0, 2, 5, 8]
    q, dev, host, (dev_k, dev_v), (host_k, host_v), expected = _batch(length, 1, cuts)
    ref_out, ref_lse = empty_partial(q)
    part_reference(q, dev_k, dev_v, dev, ref_out, ref_lse, scale=D ** -0.5)
    for launch in ({"num_kv_splits": 4, "tile_n": 16}, {"deterministic": True}):
        out, lse = _device_part(device, q, dev, dev_k, dev_v, **launch)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5, msg=str(launch))
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5, msg=str(launch))
    host_out, host_lse = empty_partial(q)
    part_reference(q, host_k, host_v, host, host_out, host_lse, scale=D ** -0.5)
    torch.testing.assert_close(merge_partials(out, lse, host_out, host_lse), expected,
                               rtol=1e-5, atol=1e-5)


def cooperative_step_output(kernels: str, q, k, v, positions, tables, seq_lens, starts, slots,
                            device_kv, host_kv, deterministic):
    """One layer of a cooperative step (engine/cooperative.py) with FUSEGEN_KERNELS set to
    `kernels`: the output, and the pools with the step's new keys and values written."""
    import os
    from types import SimpleNamespace

    from fusegen.engine.cooperative import CooperativeStep
    before = os.environ.get("FUSEGEN_KERNELS")
    os.environ["FUSEGEN_KERNELS"] = kernels
    try:
        split = split_step(tables, seq_lens, starts, slots, NUM, 2, BS, deterministic)
        host = dict(zip([device_kv[0].data_ptr()], [host_kv]))
        step = CooperativeStep(split, torch.device("cpu"), host, None, 1, 1)
        rope = (torch.ones(64, D // 2), torch.zeros(64, D // 2))  # no rotation
        out = step.attention(SimpleNamespace(scale=D ** -0.5), positions, q, k, v, rope,
                             device_kv)
    finally:
        if before is None:
            del os.environ["FUSEGEN_KERNELS"]
        else:
            os.environ["FUSEGEN_KERNELS"] = before
    return out, device_kv, host_kv


@pytest.mark.parametrize("deterministic", [False, True])
def test_cooperative_step_through_triton(deterministic):
    """A mixed step (a decode past the split, a chunk across it, a prompt before it) with
    the Triton path's kernels (the KV write, the device part; the interpreter on CPU)
    against the torch reference's: the same output and the same pools."""
    g = torch.Generator().manual_seed(7)
    # quota 2 blocks (8 tokens); request lengths 14 (decode), 12 (4 rows: 8..11), 6
    seq_lens, counts = [14, 12, 6], [1, 4, 6]
    tables = [[0, 1, NUM + 0, NUM + 1], [8, 9, NUM + 8], [16, 17]]
    starts = [0, 1, 5, 11]
    positions = torch.tensor([13, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5])
    slots = []
    for table, length, n in zip(tables, seq_lens, counts):
        slots += [table[p // BS] * BS + p % BS for p in range(length - n, length)]
    q, k, v = (torch.randn(11, h, D, generator=g) for h in (HQ, HKV, HKV))
    device_kv = tuple(torch.randn(NUM, BS, HKV, D, generator=g) for _ in range(2))
    host_kv = tuple(torch.randn(NUM, BS, HKV, D, generator=g) for _ in range(2))
    results = []
    for kernels in ("reference", "triton"):
        args = [t.clone() for t in (q, k, v, positions)]
        dev = tuple(t.clone() for t in device_kv)
        host = tuple(t.clone() for t in host_kv)
        run = cooperative_step_output if kernels == "reference" else \
            triton_on("cpu", cooperative_step_output)
        results.append(run(kernels, *args, tables, seq_lens, starts, slots, dev, host,
                           deterministic))
    (ref, ref_dev, ref_host), (out, dev, host) = results
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the new keys went to their pools: request 0's decode (position 13) to host block 1,
    # request 1's rows 8..11 to host block 8, request 2's prompt to device blocks 16, 17
    for pool, old, changed in ((dev[0], device_kv[0], [16, 17]), (host[0], host_kv[0], [1, 8])):
        touched = [b for b in range(NUM) if not torch.equal(pool[b], old[b])]
        assert touched == changed
    for a, b in zip(ref_dev + ref_host, dev + host):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_deterministic_device_part_is_batch_invariant(device):
    """Deterministic mode's one-row segments through the Triton kernel: a request's rows
    come out bit for bit the same alone as beside others (their split point is fixed by
    the request's length alone)."""
    length, n = 13, 3  # three requests, each with its first 2 blocks on the device
    q, _, _, (dev_k, dev_v), _, _ = _batch(length, n, [2, 2, 2])
    tables = [[8 * i + j if j < 2 else NUM + 8 * i + j for j in range(4)] for i in range(3)]
    batch = split_step(tables, [length] * 3, [0, n, 2 * n, 3 * n], [], NUM, 2, BS,
                       True).device
    out, lse = _device_part(device, q, batch, dev_k, dev_v, deterministic=True)
    assert len(batch) == 3 * n  # every row a segment of its own
    for i in range(3):
        alone = split_step([tables[i]], [length], [0, n], [], NUM, 2, BS, True).device
        rows = slice(n * i, n * (i + 1))
        one_out, one_lse = _device_part(device, q[rows].contiguous(), alone, dev_k, dev_v,
                                        deterministic=True)
        assert torch.equal(one_out, out[rows]) and torch.equal(one_lse, lse[rows])
