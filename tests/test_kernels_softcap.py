"""Attention logit soft-capping (Gemma 2): scores s become c * tanh(s / c) before the
mask. The torch reference against a dense float64 attention written out per sequence,
the Triton kernel (interpreter on CPU) against the reference, and the CPU dispatcher's
routing (the C kernels do not cap: capped layers take the reference)."""
import pytest
import torch

from fusegen.kernels.paged_attention import (paged_attention, paged_attention_reference,
                                             paged_attention_rowwise, paged_attention_triton)
from fusegen.kernels.testing import triton_on
from test_kernels_paged_attention import DEVICES, TOLERANCE, _make_batch

# (q_lens, seq_lens, Hq, Hkv, head_dim, block_size, sliding_window, softcap): decode rows
# mixed with prefill and chunked-prefill rows; caps well inside the scores' range
# (random q, k give |s| up to ~4), so they change the result.
CASES = {
    "gqa2_cap1": ([1, 7, 1, 20], [1, 7, 33, 45], 4, 2, 32, 8, 0, 1.0),
    "gqa4_window_cap2": ([1, 18, 1], [64, 40, 3], 8, 2, 32, 8, 16, 2.0),
    "mha_head80_window_cap05": ([9, 1, 4], [9, 30, 14], 2, 2, 80, 5, 6, 0.5),
}


def _dense(batch, window, softcap):
    """Per sequence and head: scores over the sequence's keys in float64, capped, then
    masked (causal, windowed) and softmaxed."""
    out = torch.empty(batch["q"].shape, dtype=torch.float64)
    starts, lens = batch["query_start_loc"].tolist(), batch["seq_lens"].tolist()
    block_size, num_kv_heads = batch["k_cache"].shape[1:3]
    group = batch["q"].shape[1] // num_kv_heads
    for i, seq_len in enumerate(lens):
        blocks = batch["block_tables"][i, :-(-seq_len // block_size)].long()
        k = batch["k_cache"][blocks].flatten(0, 1)[:seq_len].double()  # [L, Hkv, D]
        v = batch["v_cache"][blocks].flatten(0, 1)[:seq_len].double()
        q = batch["q"][starts[i]:starts[i + 1]].double()  # [n, Hq, D]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * batch["scale"]
        scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_dense_capped_attention(case):
    q_lens, seq_lens, hq, hkv, d, bs, window, cap = CASES[case]
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, bs)
    out = paged_attention_reference(**batch, sliding_window=window, softcap=cap)
    torch.testing.assert_close(out.double(), _dense(batch, window, cap), atol=1e-5, rtol=1e-5)
    uncapped = paged_attention_reference(**batch, sliding_window=window)
    assert (out - uncapped).abs().max() > 0.05  # the cap bites


def test_cpu_dispatch_and_rowwise_cap_like_the_reference():
    q_lens, seq_lens, hq, hkv, d, bs, window, cap = CASES["gqa4_window_cap2"]
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, bs)
    expected = paged_attention_reference(**batch, sliding_window=window, softcap=cap)
    assert torch.equal(paged_attention(**batch, sliding_window=window, softcap=cap), expected)
    rowwise = paged_attention(**batch, sliding_window=window, softcap=cap, deterministic=True)
    torch.testing.assert_close(rowwise, expected, atol=1e-6, rtol=1e-6)
    direct = paged_attention_rowwise(batch["q"], batch["k_cache"], batch["v_cache"],
                                     batch["block_tables"], batch["seq_lens"],
                                     batch["query_start_loc"], scale=batch["scale"],
                                     sliding_window=window, softcap=cap)
    assert torch.equal(direct, rowwise)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, dtype, device):
    pytest.importorskip("triton")
    q_lens, seq_lens, hq, hkv, d, bs, window, cap = CASES[case]
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, bs, dtype, device)
    out = triton_on(device, paged_attention_triton)(**batch, sliding_window=window,
                                                    softcap=cap, tile_n=16)
    exact = {k: v.float().cpu() if v.is_floating_point() else v.cpu() for k, v in batch.items()
             if isinstance(v, torch.Tensor)}
    expected = paged_attention_reference(**{**batch, **exact}, sliding_window=window,
                                         softcap=cap)
    torch.testing.assert_close(out.float().cpu(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_triton_kv_splits_cap_like_the_reference(device):
    pytest.importorskip("triton")
    batch = _make_batch([1, 1, 1, 6], [70, 1, 33, 40], 4, 1, 32, 8, device=device)
    out = triton_on(device, paged_attention_triton)(**batch, softcap=1.5, tile_n=16,
                                                    num_kv_splits=4)
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    torch.testing.assert_close(out.cpu(), paged_attention_reference(**cpu, softcap=1.5),
                               atol=2e-5, rtol=2e-5)
