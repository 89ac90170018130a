"""Attention over a KV cache kept in two places (FastAttention's CPU-GPU cooperation): each
request's keys [0, S) in the device's blocks and [S, L) in the host's, each part computed
where its blocks lie, the two partial results merged exactly by their log-sum-exp.

A part is a list of segments, each a run of query rows attending to the keys one block
table reaches in one cache (`Segments`): rows [row, row + n) at the last n positions of
`seq_len` keys, causal among them, as the paged kernels take a sequence, the keys from
`kv_end` on (where set) seen by none of them. Which rows see
which keys of which part is the caller's (engine/cooperative.py); this module computes a
part's segments with each row's log-sum-exp, and merges two parts:

    out = (e^(lse_a - M) * out_a + e^(lse_b - M) * out_b) / (e^(lse_a - M) + e^(lse_b - M))

with M = max(lse_a, lse_b): the running-max-and-sum rule of online softmax applied once
more, so the merged row equals attention over both key ranges at once (to fp32 rounding).
A row a part does not reach keeps lse -inf there and takes the other part's output as is.

On CPUs the C kernels compute a part (kernels/csrc/paged_decode.c for one-row segments,
paged_prefill.c for the others, both writing the log-sum-exp, kernels/csrc/lse.h); on
CUDA devices the Triton paged attention kernel (kernels/paged_attention.py, which writes
it too); elsewhere `part_reference` in torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusegen.kernels import use_native, use_triton
from fusegen.kernels.paged_attention import paged_attention_triton
from fusegen.kernels.paged_attention_cpu import paged_decode_native, paged_prefill_native


@dataclass(slots=True)
class Segments:
    """One part's query rows as the paged kernels take sequences, in plain lists: segment
    k is rows [rows[k], rows[k] + counts[k]) (ascending, disjoint), the last counts[k] of
    seq_lens[k] positions, seeing the keys before kv_ends[k] (0: all of theirs) read
    through tables[k] (segments of one request share its list)."""
    rows: list[int]
    counts: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    kv_ends: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def max_count(self) -> int:
        return max(self.counts, default=0)

    @property
    def max_keys(self) -> int:
        return max((end or n for end, n in zip(self.kv_ends, self.seq_lens)), default=0)

    def tensors(self) -> PartTensors:
        return PartTensors.of(self)


@dataclass(slots=True)
class PartTensors:
    """`Segments` as int32 tensors, built once a step for every layer. Sequence 2k is
    segment k and 2k + 1 the gap of rows up to segment k + 1 (never computed), so one
    query_start_loc serves rows that are not contiguous across segments."""
    block_tables: torch.Tensor  # [2K, W]
    seq_lens: torch.Tensor  # [2K]
    query_start_loc: torch.Tensor  # [2K + 1]
    decode_ids: torch.Tensor | None  # even sequences of one row
    prefill_ids: torch.Tensor | None  # even sequences of several rows
    kv_end: torch.Tensor | None  # [2K]: where each sequence's keys end (None: at seq_lens)
    segments: Segments

    @classmethod
    def of(cls, seg: Segments) -> PartTensors:
        # Segments of one request share its table (the same list): each distinct table
        # becomes one row, gathered per sequence in torch (a prefill chunk's rows past
        # the split are a segment each, thousands of rows of the same table).
        distinct: dict[int, int] = {}
        unique = []
        which = []
        for table in seg.tables:
            if id(table) not in distinct:
                distinct[id(table)] = len(unique)
                unique.append(table)
            which.append(distinct[id(table)])
        width = max([len(t) for t in unique] + [1])
        rows = torch.tensor([t + [0] * (width - len(t)) for t in unique] or [[0]],
                            dtype=torch.int32)
        tables = rows[torch.tensor(which, dtype=torch.long).repeat_interleave(2)] \
            if which else rows
        lens, qsl, ends = [], [0], []
        for row, n, length, end in zip(seg.rows, seg.counts, seg.seq_lens, seg.kv_ends):
            lens += [length, 0]
            ends += [end or length, 0]
            qsl[-1] = row  # the previous gap ends here
            qsl += [row + n, row + n]
        kv_end = torch.tensor(ends, dtype=torch.int32) if any(seg.kv_ends) else None
        decode = [2 * k for k, n in enumerate(seg.counts) if n == 1]
        prefill = [2 * k for k, n in enumerate(seg.counts) if n > 1]
        as_ids = (lambda ids: torch.tensor(ids, dtype=torch.int32) if ids else None)
        return cls(tables.contiguous(), torch.tensor(lens, dtype=torch.int32),
                   torch.tensor(qsl, dtype=torch.int32), as_ids(decode), as_ids(prefill), kv_end,
                   seg)

    def to(self, device) -> PartTensors:
        """The tensors on `device` (a CUDA device's part runs the Triton kernel there)."""
        move = (lambda t: None if t is None else t.to(device, non_blocking=True))
        return PartTensors(move(self.block_tables), move(self.seq_lens),
                           move(self.query_start_loc), move(self.decode_ids),
                           move(self.prefill_ids), move(self.kv_end), self.segments)


def attention_part(q, k_cache, v_cache, part: PartTensors, out, lse, *, scale: float,
                   num_threads: int | None = None, deterministic: bool = False) -> None:
    """`part`'s rows of out [T, Hq, D] and lse [T, Hq] (fp32) in place; rows the part
    does not name are left as they are (gaps between its segments are written as a row
    no key reached: zeros and -inf, what `empty_partial` holds). `deterministic`: the
    Triton kernel's launch of one shape, no split of the keys."""
    if not len(part.segments):
        return
    if use_triton(q):
        triton_part(q, k_cache, v_cache, part, out, lse, scale=scale,
                    deterministic=deterministic)
        return
    if not (q.is_cpu and k_cache.is_cpu and use_native(q)):
        part_reference(q, k_cache, v_cache, part.segments, out, lse, scale=scale)
        return
    args = (q, k_cache, v_cache, part.block_tables, part.seq_lens, part.query_start_loc, out)
    if part.decode_ids is not None:
        paged_decode_native(*args, scale=scale, seq_ids=part.decode_ids,
                            num_threads=num_threads, lse=lse)
    if part.prefill_ids is not None and not paged_prefill_native(
            *args, part.prefill_ids, scale=scale, num_threads=num_threads, lse=lse,
            kv_end=part.kv_end):
        # a shape the prefill kernel does not take: each row as a decode of its own keys
        attention_part(q, k_cache, v_cache, _rows_as_decodes(part.segments, part.prefill_ids),
                       out, lse, scale=scale, num_threads=num_threads)


def triton_part(q, k_cache, v_cache, part: PartTensors, out, lse, *, scale: float,
                deterministic: bool = False, num_kv_splits: int | None = None,
                tile_n: int | None = None) -> None:
    """`attention_part` through the Triton kernel, `part`'s tensors on q's device: one
    launch for every segment (decode rows and prefill chunks alike). `num_kv_splits`,
    `tile_n`: the launcher's overrides, for tests."""
    seg = part.segments
    paged_attention_triton(q, k_cache, v_cache, part.block_tables, part.seq_lens,
                           part.query_start_loc, max_query_len=seg.max_count,
                           max_seq_len=seg.max_keys, scale=scale, deterministic=deterministic,
                           num_kv_splits=num_kv_splits, tile_n=tile_n, out=out, lse=lse,
                           kv_end=part.kv_end)


def _rows_as_decodes(seg: Segments, ids: torch.Tensor) -> PartTensors:
    rows, counts, lens, tables = [], [], [], []
    for k in (i // 2 for i in ids.tolist()):
        n, length, end = seg.counts[k], seg.seq_lens[k], seg.kv_ends[k] or seg.seq_lens[k]
        for j in range(n):
            rows.append(seg.rows[k] + j)
            lens.append(min(length - n + j + 1, end))
            tables.append(seg.tables[k])
            counts.append(1)
    return Segments(rows, counts, lens, tables, [0] * len(rows)).tensors()


def part_reference(q, k_cache, v_cache, seg: Segments, out, lse, *, scale: float) -> None:
    """`attention_part` in torch (fp32 scores), one segment at a time: for devices
    without the C kernels, and the tests' reference."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    for row, n, length, table, end in zip(seg.rows, seg.counts, seg.seq_lens, seg.tables,
                                          seg.kv_ends):
        end = end or length  # keys [0, end), the rows at the last n of `length` positions
        ids = torch.tensor(table[:-(-end // block_size)], dtype=torch.long,
                           device=k_cache.device)
        k = k_cache[ids].flatten(0, 1)[:end].float().repeat_interleave(group, 1)  # [E, Hq, D]
        v = v_cache[ids].flatten(0, 1)[:end].float().repeat_interleave(group, 1)
        qs = q[row:row + n].float() * scale  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, k)
        visible = torch.arange(end, device=q.device)[None, :] <= \
            torch.arange(length - n, length, device=q.device)[:, None]  # [n, E]
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, -1)  # [Hq, n]
        probs = torch.exp(scores - row_lse[..., None])
        out[row:row + n] = torch.einsum("hnl,lhd->nhd", probs, v).to(out.dtype)
        lse[row:row + n] = row_lse.transpose(0, 1)


def merge_partials(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """[T, Hq, D] attention over both parts' keys from each part's output and
    log-sum-exp [T, Hq]; computed in fp32, returned in out_a's dtype."""
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows no part saw
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # [T, Hq]
    total = w_a + w_b
    total = torch.where(total > 0, total, torch.ones_like(total))
    merged = (out_a.float() * (w_a / total)[..., None] + out_b.float() * (w_b / total)[..., None])
    return merged.to(out_a.dtype)


def empty_partial(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for a part's rows: zeros and -inf, what a row no segment reaches keeps."""
    return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"), dtype=torch.float32,
                                           device=q.device)
