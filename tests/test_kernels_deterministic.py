"""Batch-invariant attention: a query row's output is bit-identical whether its prompt
came whole, in chunks, one token at a time, or beside other sequences in the step."""
import pytest
import torch

from fusegen.kernels.paged_attention import paged_attention
from tests.test_kernels_paged_attention import _dense_attention, _make_batch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def _rows(batch, seq, start, stop):
    """Sequence `seq`'s query rows [start, stop) as their own step, the cache holding
    its first `stop` tokens: what a chunk of its prefill (or a decode) computes."""
    q = batch["full_q"][seq][start:stop]
    return dict(q=q, block_tables=batch["block_tables"][seq:seq + 1],
                seq_lens=torch.tensor([stop], dtype=torch.int32),
                query_start_loc=torch.tensor([0, stop - start], dtype=torch.int32))


def _attend(batch, steps, window):
    """steps: [(seq, start, stop), ...] run as one fused step -> output rows in order."""
    parts = [_rows(batch, *s) for s in steps]
    q = torch.cat([p["q"] for p in parts])
    width = batch["block_tables"].shape[1]
    tables = torch.cat([p["block_tables"][:, :width] for p in parts])
    lens = torch.cat([p["seq_lens"] for p in parts])
    counts = torch.tensor([0] + [p["q"].shape[0] for p in parts])
    starts = counts.cumsum(0).to(torch.int32)
    return paged_attention(q, batch["k_cache"], batch["v_cache"], tables, lens, starts,
                           max_query_len=int(counts.max()), max_seq_len=int(lens.max()),
                           scale=batch["scale"], sliding_window=window, deterministic=True)


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
def test_every_split_of_a_prompt_gives_the_same_bits(monkeypatch, kernels, dtype, window):
    monkeypatch.setenv("FUSEGEN_KERNELS", kernels)
    lens = [37, 20, 5]
    batch = _make_batch(lens, lens, 8, 2, 64, 4, dtype=dtype)
    starts = batch["query_start_loc"].tolist()
    batch["full_q"] = [batch["q"][a:b] for a, b in zip(starts, starts[1:])]
    whole = _attend(batch, [(0, 0, 37)], window)
    # Against float64 attention: the deterministic path is still attention.
    want = _dense_attention(dict(batch, q=batch["full_q"][0], seq_lens=torch.tensor([37]),
                                 query_start_loc=torch.tensor([0, 37]),
                                 block_tables=batch["block_tables"][:1]), window)
    assert (whole.double() - want).abs().max() < TOLERANCE[dtype]
    chunked = torch.cat([_attend(batch, [(0, a, b)], window)
                         for a, b in ((0, 10), (10, 25), (25, 37))])
    one_by_one = torch.cat([_attend(batch, [(0, p, p + 1)], window) for p in range(37)])
    # The middle chunk beside a decode of sequence 1 and a whole prefill of sequence 2.
    mixed = _attend(batch, [(1, 19, 20), (0, 10, 25), (2, 0, 5)], window)
    assert torch.equal(whole, chunked)
    assert torch.equal(whole, one_by_one)
    assert torch.equal(whole[10:25], mixed[1:16])
    assert torch.equal(mixed[:1], _attend(batch, [(1, 19, 20)], window))
    assert torch.equal(mixed[16:], _attend(batch, [(2, 0, 5)], window))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_step_takes_the_decode_kernel_with_the_row_wise_bits(monkeypatch, dtype,
                                                                       window, threads):
    """A step whose every query is one row goes straight to the C decode kernel in
    deterministic mode: the row-wise path's bits, and each row's bits alone."""
    from fusegen.kernels import native
    from fusegen.kernels.paged_attention_cpu import paged_attention_rowwise

    if native.library() is None:
        pytest.skip("no C compiler here: the row-wise path runs in torch")
    monkeypatch.delenv("FUSEGEN_KERNELS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    lens = [37, 20, 5, 64, 1]
    batch = _make_batch([1] * len(lens), lens, 8, 2, 64, 4, dtype=dtype)
    args = (batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"],
            batch["seq_lens"], batch["query_start_loc"])
    step = paged_attention(*args, max_query_len=1, max_seq_len=64, scale=batch["scale"],
                           sliding_window=window, deterministic=True)
    rowwise = paged_attention_rowwise(*args, scale=batch["scale"], sliding_window=window)
    assert torch.equal(step, rowwise)
    batch["full_q"] = [batch["q"][i:i + 1].expand(n, -1, -1) for i, n in enumerate(lens)]
    for i, n in enumerate(lens):
        alone = _attend(batch, [(i, n - 1, n)], window)
        assert torch.equal(step[i:i + 1], alone)
    # the same rows inside a step with a prefill: the row-wise path
    mixed = _attend(batch, [(0, 36, 37), (3, 60, 64), (4, 0, 1)], window)
    assert torch.equal(mixed[:1], step[:1]) and torch.equal(mixed[4:5], step[3:4])
    assert torch.equal(mixed[5:], step[4:])
