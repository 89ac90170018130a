"""Attention over a paged KV cache for a ragged batch of queries.

One function serves prefill, chunked prefill and decode: sequence i contributes the
query rows q[query_start_loc[i]:query_start_loc[i+1]]; they are the *last* q_len
tokens of a sequence of seq_lens[i] tokens whose keys and values (the new ones
included) are already in the cache at the blocks listed in block_tables[i]. Query row
j of sequence i sits at position seq_lens[i] - q_len + j and attends causally to
positions 0..that position (and, with a sliding window W > 0, only to the last W).

Shapes:
  q            [T, Hq, D]                 T = total query tokens of the step
  k/v_cache    [num_blocks, block_size, Hkv, D]   Hq % Hkv == 0 (grouped-query)
  block_tables [B, max_blocks] int32      padded with any valid id
  seq_lens     [B] int32
  query_start_loc [B+1] int32             cumulative query lengths, starts at 0
  returns      [T, Hq, D]

Triton launch: one program per (query tile, KV head[, KV split]). A query tile holds
BLOCK_Q consecutive query tokens of one sequence times the G = Hq / Hkv query heads
that share the KV head, so each K/V tile is loaded once for the whole group
(BLOCK_M = BLOCK_Q * G_pad rows). Sequence i owns the tiles from
query_start_loc[i] // BLOCK_Q + i on, which over-counts by at most one per sequence, so
the grid T // BLOCK_Q + B is known from shapes alone: the launcher never syncs with the
device; a program past its sequence's last tile exits at once. Keys are walked in tiles
of TILE_N positions, each gathered through the block table (any block_size), with an
online softmax in fp32. With KV splits (flash-decoding, for decode batches too small to
fill the GPU) each program covers 1/S of the key range and writes a partial result that
`_paged_attention_reduce_kernel` combines.

For cooperative KV placement (kernels/cooperative_attention.py) the launcher also writes
each row's log-sum-exp of its scaled scores (`lse`, natural units, -inf for a row that
saw no key) into the caller's `out`, and ends sequence i's keys at kv_end[i]. A row no
key reaches (a sequence of no keys: the gaps between a part's segments, one empty
program each) ends as zeros and -inf, or keeps what the caller's out and lse hold;
rows of no sequence keep theirs.
"""
from __future__ import annotations

import functools
import math

import torch

from fusegen.kernels import use_native, use_triton
from fusegen.kernels.paged_attention_cpu import (  # noqa: F401 - the CPU paths, re-exported
    paged_attention_cpu, paged_attention_reference, paged_attention_rowwise,
    paged_decode_native)

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: the reference still serves
    from fusegen.kernels._triton_stub import tl, triton


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                    max_query_len: int, max_seq_len: int, scale: float,
                    sliding_window: int = 0, softcap: float = 0.0,
                    deterministic: bool = False) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA, the C decode kernel with torch's fused
    attention for prefill on CPUs, the torch reference where neither applies.

    `softcap` c > 0: each scaled score s becomes c * tanh(s / c) before the mask (Gemma
    2); on CPUs only the torch reference does that.
    `deterministic`: every query row reduces over its keys in one fixed order whatever
    else is in the step (batch-invariant): on CUDA one launch shape and no split of the
    keys; elsewhere each row runs as a decode of its own position."""
    if use_triton(q):
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, max_query_len=max_query_len,
                                      max_seq_len=max_seq_len, scale=scale,
                                      sliding_window=sliding_window, softcap=softcap,
                                      deterministic=deterministic)
    native = not softcap and use_native(q)
    # A decode step (one query row per sequence) through the C decode kernel already
    # reduces each row as the row-wise path would, with the same call: no detour.
    if deterministic and not (native and max_query_len == 1):
        return paged_attention_rowwise(q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale=scale,
                                       sliding_window=sliding_window, softcap=softcap)
    if native:
        return paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens,
                                   query_start_loc, max_query_len=max_query_len,
                                   max_seq_len=max_seq_len, scale=scale,
                                   sliding_window=sliding_window)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens,
                                     query_start_loc, max_query_len=max_query_len,
                                     max_seq_len=max_seq_len, scale=scale,
                                     sliding_window=sliding_window, softcap=softcap)


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    # The last sequence whose first tile (query_start_loc[i] // BLOCK_Q + i) is <= tile.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e^(-2|x|)) / (1 + e^(-2|x|)): no overflow at any |x|; Triton has no
    # portable tanh (libdevice's is CUDA / HIP only, not in the interpreter).
    t = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # e^(-2|x|); 2.885... = 2 * log2(e)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, part_out_ptr, part_m_ptr, part_l_ptr, lse_ptr, kv_end_ptr,
        scale_log2, softcap_log2, num_seqs, sliding_window,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
        stride_ps, stride_pt, stride_ph,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
        HAS_LSE: tl.constexpr, HAS_KV_END: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row m of the tile: query token q_tile * BLOCK_Q + m // GROUP_PAD of the sequence,
    # query head kv_head * GROUP + m % GROUP_PAD (rows of padded heads are masked).
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD
    q_head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (q_tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + q_tok).to(tl.int64) * stride_qt + q_head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, D]
    q_pos = context_len + q_tok  # [BLOCK_M]

    # Keys this tile can see: up to its last query's position; from the first query's
    # window start when windowed. Split s takes tiles [s*per_split, (s+1)*per_split).
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    if HAS_KV_END:
        kv_end = tl.minimum(kv_end, tl.load(kv_end_ptr + seq))
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
        kv_start = (kv_start // TILE_N) * TILE_N
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, TILE_N), NUM_SPLITS)
        lo = kv_start + tl.program_id(2) * tiles_per_split * TILE_N
        hi = tl.minimum(lo + tiles_per_split * TILE_N, kv_end)
    else:
        lo = kv_start
        hi = kv_end

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for start in range(lo, hi, TILE_N):
        k_pos = start + offs_n
        k_ok = k_pos < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE,
                        mask=k_ok, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k_off = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                    mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [D, TILE_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        if USE_SOFTCAP:
            # c * tanh(s / c) in natural units is C * tanh(s / C) in log2 units, C = c * log2(e)
            s = softcap_log2 * _tanh(s / softcap_log2)
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + slot * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS > 1:
        # Unnormalized partials; a split that saw nothing for a row reports m = -inf.
        part = (tl.program_id(2) * stride_ps + (q_start + q_tok) * stride_pt
                + q_head * stride_ph).to(tl.int64)
        tl.store(part_m_ptr + part, tl.where(l_i > 0, m_i, float("-inf")), mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=out_mask)
    else:
        acc = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
        o_rows = (q_start + q_tok).to(tl.int64) * stride_ot + q_head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        if HAS_LSE:  # [T, Hq], laid out as one split's partials
            tl.store(lse_ptr + (q_start + q_tok).to(tl.int64) * stride_pt + q_head * stride_ph,
                     _lse(m_i, l_i), mask=row_ok)


@triton.jit
def _lse(m, l):
    # natural log of sum e^(scaled score) from the running max m (log2 units) and sum l
    return tl.where(l > 0, (m + tl.math.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453,
                    float("-inf"))


@triton.jit
def _paged_attention_reduce_kernel(
        out_ptr, part_out_ptr, part_m_ptr, part_l_ptr, lse_ptr, stride_ot, stride_oh,
        stride_ps, stride_pt, stride_ph, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr, HAS_LSE: tl.constexpr):
    # One program per (token, query head): combine the splits' partial softmaxes.
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = offs_s * stride_ps + token * stride_pt + head * stride_ph  # [S]
    m = tl.load(part_m_ptr + part)
    l = tl.load(part_l_ptr + part)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])  # [S, D]
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row no split saw: out 0, lse -inf
    weight = tl.math.exp2(m - top)  # 0 for empty splits
    total = tl.sum(l * weight, 0)
    o = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0, 1.0, total)
    d_ok = offs_d < HEAD_DIM
    if HAS_LSE:
        # Rows of no sequence (before a part's first segment) kept their partials' fill
        # (m -inf, l 0): they keep their values, as without a split.
        named = total > 0
        named_d = (tl.zeros([HEAD_DIM_PAD], tl.float32) + total) > 0  # [D]: & wants a vector
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
                 o.to(out_ptr.dtype.element_ty), mask=d_ok & named_d)
        tl.store(lse_ptr + token * stride_pt + head * stride_ph, _lse(top, total), mask=named)
    else:
        tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
                 o.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                           max_query_len: int, max_seq_len: int, scale: float,
                           sliding_window: int = 0, softcap: float = 0.0,
                           tile_n: int | None = None,
                           num_kv_splits: int | None = None,
                           deterministic: bool = False, out: torch.Tensor | None = None,
                           lse: torch.Tensor | None = None,
                           kv_end: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher. `tile_n` (keys per tile) and `num_kv_splits` (a power of two) override
    the heuristics, for tests and tuning. No host sync: grid sizes come from shapes.
    `deterministic`: the same tile shapes for every step and no split of the keys, so a
    row's reduction order does not depend on the step it is in.
    `out`: where to write (rows no sequence names keep their values); `lse` [T, Hq] fp32:
    each written row's log-sum-exp; `kv_end` [B] int32: sequence i sees only its keys
    before kv_end[i] (both for cooperative KV placement)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape, f"k_cache {k_cache.shape} != v_cache {v_cache.shape}"
    assert k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q {head_dim}"
    assert num_heads % num_kv_heads == 0, f"Hq={num_heads} is not a multiple of Hkv={num_kv_heads}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, f"dtypes {q.dtype}, {k_cache.dtype}"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported {q.dtype}"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, \
        "the head dimension must be contiguous"
    assert query_start_loc.shape == (num_seqs + 1,), \
        f"query_start_loc {tuple(query_start_loc.shape)} != ({num_seqs + 1},)"
    assert block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1, \
        f"block_tables {tuple(block_tables.shape)} needs {num_seqs} contiguous rows"
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        assert t.dtype in (torch.int32, torch.int64), f"{name} must be int32 (or int64), got {t.dtype}"
        assert t.device == q.device, f"{name} is on {t.device}, q on {q.device}"
    assert 16 <= head_dim <= 256, f"head_dim {head_dim} outside 16..256"
    assert softcap >= 0, f"softcap {softcap} must be positive (or 0: off)"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1, \
        f"out {tuple(out.shape)} {out.dtype} must be q's shape {tuple(q.shape)} and dtype"
    if lse is not None:
        assert lse.shape == (num_tokens, num_heads) and lse.dtype == torch.float32 \
            and lse.is_contiguous() and lse.device == q.device, \
            f"lse {tuple(lse.shape)} {lse.dtype} must be contiguous fp32 " \
            f"({num_tokens}, {num_heads})"
    if kv_end is not None:
        assert kv_end.shape == (num_seqs,) and kv_end.dtype == torch.int32 \
            and kv_end.device == q.device, f"kv_end {tuple(kv_end.shape)} {kv_end.dtype} " \
            f"must be int32 ({num_seqs},) on {q.device}"

    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_m = max(64 if deterministic or max_query_len > 16 else 16, group_pad)
    block_q = block_m // group_pad
    # fp32 dots run on FMA units (ieee), and wider key tiles spill registers there.
    tile_n = tile_n or (16 if q.dtype == torch.float32 else 64 if head_dim_pad <= 128 else 32)
    splits = 1 if deterministic else num_kv_splits or _num_kv_splits(
        q.device, num_seqs * num_kv_heads, max_query_len, max_seq_len)
    assert splits & (splits - 1) == 0, f"num_kv_splits {splits} is not a power of two"
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    if splits > 1:
        part_out = torch.empty(splits, num_tokens, num_heads, head_dim_pad,
                               dtype=torch.float32, device=q.device)
        part_m = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        if lse is not None:  # rows no program writes reduce to "no key seen"
            part_m.fill_(float("-inf"))
            part_l.zero_()
    else:
        part_out = part_m = part_l = out  # unused
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        part_out, part_m, part_l, out if lse is None else lse,
        seq_lens if kv_end is None else kv_end, scale * math.log2(math.e),
        softcap * math.log2(math.e), num_seqs, sliding_window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        num_tokens * num_heads, num_heads, 1,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        NUM_SPLITS=splits, USE_WINDOW=sliding_window > 0, USE_SOFTCAP=softcap > 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_LSE=lse is not None, HAS_KV_END=kv_end is not None, num_warps=4)
    if splits > 1:
        _paged_attention_reduce_kernel[(num_tokens, num_heads)](
            out, part_out, part_m, part_l, out if lse is None else lse,
            out.stride(0), out.stride(1), num_tokens * num_heads, num_heads, 1,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=splits,
            HAS_LSE=lse is not None, num_warps=4)
    return out


def decode_kv_splits(device, num_programs: int, max_seq_len: int) -> int:
    """The KV splits the launcher picks for a decode step (one query row per sequence)
    of `num_programs` (sequence, KV head) pairs: a recorded step (engine/graphs.py)
    replays one split, so its graph is chosen by it."""
    return _num_kv_splits(device, num_programs, 1, max_seq_len)


def _num_kv_splits(device, num_programs, max_query_len, max_seq_len):
    # Split the keys only for decode steps whose (sequence, KV head) programs leave SMs
    # idle, and only as far as each split keeps >= 256 keys of work.
    if device.type != "cuda" or max_query_len > 1:
        return 1
    want = min(-(-2 * _num_sms(device) // num_programs), max_seq_len // 256, 16)
    return 1 << (want.bit_length() - 1) if want > 1 else 1


@functools.cache
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
