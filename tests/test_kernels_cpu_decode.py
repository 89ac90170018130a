"""The C decode-attention kernel for CPUs (kernels/csrc/paged_decode.c) against the
dense per-sequence attention and the torch reference, and its build cache."""
import math
import os
import subprocess
import sys

import pytest
import torch

from fusegen.kernels import native
from fusegen.kernels.kv_cache import write_kv_cache_reference
from fusegen.kernels.paged_attention import (paged_attention, paged_attention_cpu,
                                     paged_attention_reference, paged_decode_native)
from tests.test_kernels_paged_attention import CASES, _dense_attention, _make_batch

if native.library() is None:  # the suite's machines have a C compiler; say why if not
    pytest.fail("the CPU kernels did not build here; see the warning above", pytrace=False)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (seq_lens, Hq, Hkv, head_dim, block_size, sliding_window), decode only: head_dim 64
# and 128 take the 8-lane path, 80 and 36 the scalar one; 3 sequences split KV heads
# over threads, 40 give one item per sequence.
DECODE = {
    "gqa2_d64": ([1, 16, 17, 300, 45], 8, 4, 64, 16, 0),
    "mqa_d128": ([5, 64, 129], 8, 1, 128, 16, 0),
    "mha_d80_window": ([9, 30, 14, 100], 2, 2, 80, 5, 6),
    "gqa4_d36_block1": ([1, 2, 33], 8, 2, 36, 1, 0),
    "many_seqs": (list(range(1, 400, 10)), 4, 2, 64, 8, 0),
    "window_over_blocks": ([64, 200, 3], 8, 2, 64, 16, 33),
    "gqa3_d128_window": ([7, 90, 250], 12, 4, 128, 16, 40),  # an odd group: a lone query
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", DECODE)
def test_decode_matches_dense_attention(case, threads):
    seq_lens, hq, hkv, d, bs, window = DECODE[case]
    batch = _make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs)
    out = torch.full_like(batch["q"], float("nan"))
    paged_decode_native(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"],
                        batch["seq_lens"], batch["query_start_loc"], out, scale=batch["scale"],
                        sliding_window=window, num_threads=threads)
    torch.testing.assert_close(out.double(), _dense_attention(batch, window),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, case", [
    (dtype, case) for dtype in (torch.bfloat16, torch.float16)
    for case in ("gqa2_d64", "mha_d80_window")] + [
    # bf16 at head_dim 64 and 128: on CPUs with AVX512_BF16, groups of 3 query heads and
    # more take the scores by vdpbf16ps (mqa_d128, window_over_blocks, gqa3_d128_window)
    (torch.bfloat16, case) for case in ("mqa_d128", "many_seqs", "window_over_blocks",
                                        "gqa3_d128_window")], ids=str)
def test_half_precision_caches(case, dtype):
    # Same inputs rounded to the dtype; the kernel accumulates in fp32 and rounds once.
    seq_lens, hq, hkv, d, bs, window = DECODE[case]
    batch = _make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs, dtype=dtype)
    out = paged_attention_cpu(**batch, sliding_window=window)
    assert out.dtype == dtype
    exact = {k: v.float() if v.is_floating_point() else v for k, v in batch.items()
             if isinstance(v, torch.Tensor)}
    expected = paged_attention_reference(**{**batch, **exact}, sliding_window=window)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES)
def test_mixed_steps_match_reference(case):
    # Decode rows through the kernel (by sequence id), prefill rows through torch.
    q_lens, seq_lens, hq, hkv, d, bs, window = CASES[case]
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, bs)
    out = paged_attention_cpu(**batch, sliding_window=window)
    torch.testing.assert_close(out, paged_attention_reference(**batch, sliding_window=window),
                               atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


def test_strided_queries_from_the_fused_projection():
    # The model hands over q as a view of the qkv projection: rows strided by q + 2 kv.
    seq_lens, hq, hkv, d, bs, window = DECODE["gqa2_d64"]
    batch = _make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs)
    qkv = torch.randn(len(seq_lens), (hq + 2 * hkv) * d)
    qkv[:, :hq * d] = batch["q"].reshape(len(seq_lens), -1)
    q = qkv[:, :hq * d].view(len(seq_lens), hq, d)
    assert not q.is_contiguous()
    out = paged_attention_cpu(**{**batch, "q": q}, sliding_window=window)
    torch.testing.assert_close(out, paged_attention_reference(**batch), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["gqa2_d64", "mha_d80_window"])
def test_keys_and_values_side_by_side_in_one_cache(case):
    # The engine keeps a block's keys and values next to each other ([blocks, 2, ...]):
    # writing and attending through the two strided views equals separate caches.
    seq_lens, hq, hkv, d, bs, window = DECODE[case]
    q_lens = [1] * (len(seq_lens) - 1) + [3]  # a mixed step: the last row is prefill
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, bs)
    both = torch.stack([batch["k_cache"], batch["v_cache"]], dim=1)
    k_view, v_view = both.unbind(1)
    new_k, new_v = torch.randn(2, 4, hkv, d).unbind(0)
    slots = torch.tensor([0, bs + 1, 2 * bs - 1, bs * (both.shape[0] - 1)])
    write_kv_cache_reference(new_k, new_v, batch["k_cache"], batch["v_cache"], slots)
    write_kv_cache_reference(new_k, new_v, k_view, v_view, slots)
    assert torch.equal(k_view, batch["k_cache"]) and torch.equal(v_view, batch["v_cache"])
    separate = paged_attention_cpu(**batch, sliding_window=window)
    interleaved = paged_attention_cpu(**{**batch, "k_cache": k_view, "v_cache": v_view},
                                      sliding_window=window)
    assert torch.equal(interleaved, separate)
    torch.testing.assert_close(interleaved, paged_attention_reference(**batch, sliding_window=window),
                               atol=2e-5, rtol=2e-5)


def test_subset_leaves_other_rows_untouched():
    seq_lens, hq, hkv, d, bs, _ = DECODE["many_seqs"]
    batch = _make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs)
    out = torch.zeros_like(batch["q"])
    ids = torch.tensor([3, 0, 17], dtype=torch.int32)
    paged_decode_native(batch["q"], batch["k_cache"], batch["v_cache"], batch["block_tables"],
                        batch["seq_lens"], batch["query_start_loc"], out, scale=batch["scale"],
                        seq_ids=ids)
    expected = paged_attention_reference(**batch)
    torch.testing.assert_close(out[ids.long()], expected[ids.long()], atol=2e-5, rtol=2e-5)
    others = torch.ones(len(seq_lens), dtype=torch.bool)
    others[ids.long()] = False
    assert torch.count_nonzero(out[others]) == 0


def test_dispatcher_takes_the_kernel_on_cpu(monkeypatch):
    seq_lens, hq, hkv, d, bs, window = DECODE["gqa2_d64"]
    batch = _make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, bs)
    calls = []
    import fusegen.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "paged_attention_cpu",
                        lambda *a, **k: calls.append(1) or paged_attention_cpu(*a, **k))
    monkeypatch.delenv("FUSEGEN_KERNELS", raising=False)
    paged_attention(**batch)
    assert calls == [1]
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    paged_attention(**batch)
    assert calls == [1]


def test_unsupported_shapes_are_refused():
    batch = _make_batch([1, 1], [3, 9], 2, 2, 320, 4)
    out = torch.empty_like(batch["q"])
    with pytest.raises(ValueError, match="head_dim <= 256.*got head_dim 320"):
        paged_decode_native(batch["q"], batch["k_cache"], batch["v_cache"],
                            batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
                            out, scale=0.1)


def test_build_is_cached_per_source_and_reported_when_it_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEGEN_CACHE_DIR", str(tmp_path))
    first = native.build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    broken = tmp_path / "broken.c"
    broken.write_text("int f( {")
    with pytest.raises(RuntimeError, match="failed on broken.c"):
        native.build([broken])
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [first.name]
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        native.build()


def test_without_a_compiler_the_engine_falls_back_to_the_reference(tmp_path):
    # A fresh process with no compiler and an empty cache: a warning, then torch.
    code = ("import torch, fusegen.kernels.native as n, fusegen.kernels.paged_attention as pa\n"
            "assert n.library() is None\n"
            "from tests.test_kernels_paged_attention import _make_batch\n"
            "b = _make_batch([1, 1], [3, 9], 4, 2, 32, 4)\n"
            "torch.testing.assert_close(pa.paged_attention(**b), pa.paged_attention_reference(**b))\n")
    env = {**os.environ, "FUSEGEN_CACHE_DIR": str(tmp_path), "CC": str(tmp_path / "none")}
    env.pop("FUSEGEN_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    assert "CPU kernels unavailable, using the torch reference" in done.stderr


def test_tables_outside_the_cache_are_refused():
    batch = _make_batch([1, 1], [3, 9], 2, 2, 32, 4)
    out = torch.empty_like(batch["q"])
    args = lambda tables, lens: (batch["q"], batch["k_cache"], batch["v_cache"], tables, lens,
                                 batch["query_start_loc"], out)
    tables = batch["block_tables"].clone()
    tables[1, 0] = batch["k_cache"].shape[0]  # one past the last block
    with pytest.raises(IndexError, match="do not cover"):
        paged_decode_native(*args(tables, batch["seq_lens"]), scale=0.1)
    longer = torch.tensor([3, 13], dtype=torch.int32)  # 13 tokens need 4 blocks of 4; 3 listed
    with pytest.raises(IndexError, match="sequences of up to 13 tokens"):
        paged_decode_native(*args(batch["block_tables"], longer), scale=0.1)


def test_loading_the_kernels_keeps_subnormals(tmp_path):
    """-ffast-math at link time would add crtfastmath.o, whose constructor turns on
    flush-to-zero in the loading thread: torch's own results would change there."""
    script = ("import torch\n"
              "from fusegen.kernels import native\n"
              "assert native.library() is not None\n"
              "print(float(torch.tensor([1e-40]) * 1.0))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "FUSEGEN_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == pytest.approx(1e-40, rel=1e-3)


def test_tables_changed_in_place_are_checked_again():
    # The bounds check runs once per step's tables (not per layer); a table changed in
    # place after a call is a new table and must be checked again.

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(4, 2, 8, 2, 16, generator=gen)
    k_cache, v_cache = cache.unbind(1)
    q = torch.randn(2, 4, 16, generator=gen)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([9, 16], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    args = dict(max_query_len=1, max_seq_len=16, scale=0.25)
    paged_attention_cpu(q, k_cache, v_cache, tables, lens, starts, **args)
    tables[1, 1] = 4  # one past the cache's last block
    with pytest.raises(IndexError, match=r"ids 0\.\.4\] do not cover .* cache of 4 blocks"):
        paged_attention_cpu(q, k_cache, v_cache, tables, lens, starts, **args)
