"""A step's attention with cooperative KV placement (engine/split_blocks.py): which query
rows attend to which keys in which pool, and the per-layer call that computes the device
part where the device's blocks lie and the host part on the host's cores, at once, then
merges them (kernels/cooperative_attention.py).

Per request, with its keys [0, S) on the device (S = device_quota * block_size, or all
of them when it has no host block) and [S, L) in the host pool, and its step's query rows
at positions L - n .. L - 1:
  - device part: the rows before S see their causal prefix of [0, S) (one segment, as a
    prefill of min(L, S) keys), the rows from S on all of [0, S) (one segment at their
    positions of L whose keys end at S);
  - host part: the rows from S on see [S, their position] (one segment of L - S keys,
    reached through the host blocks alone, so positions count from S).
In deterministic mode every row is a segment of its own (each a decode over its keys):
a row's reduction then depends only on its position and S, never on the step. On a CUDA
device the device part runs the Triton paged attention kernel, which returns each row's
log-sum-exp as the C kernels do (kernels/paged_attention.py), in one launch a layer.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from fusegen.kernels.cooperative_attention import (Segments, attention_part, empty_partial,
                                                   merge_partials)
from fusegen.kernels.kv_cache import write_kv_cache
from fusegen.kernels.rotary import rotary_embedding


@dataclass(slots=True)
class StepSplit:
    """A step's rows and new tokens' slots by pool, in plain lists."""
    device: Segments
    host: Segments
    device_rows: list[int]  # rows whose new KV goes to the device's blocks
    device_slots: list[int]
    host_rows: list[int]  # and to the host pool's (slots in the host pool)
    host_slots: list[int]
    deterministic: bool = False  # every row a segment of its own (the module's docstring)


def split_step(tables: list[list[int]], seq_lens: list[int], query_start: list[int],
               slots: list[int], num_blocks: int, device_quota: int, block_size: int,
               deterministic: bool) -> StepSplit:
    """`tables` hold one id space (split_blocks.py: ids from num_blocks on are host
    blocks); `slots` each new token's slot in it."""
    dev, host = Segments([], [], [], [], []), Segments([], [], [], [], [])
    for table, length, a, b in zip(tables, seq_lens, query_start, query_start[1:]):
        table = table[:-(-length // block_size)]  # past them: the padding to one width
        device_ids = table[:device_quota]
        host_ids = [x - num_blocks for x in table[device_quota:]]
        n, first = b - a, length - (b - a)
        split = len(device_ids) * block_size if host_ids else length
        causal = max(0, min(n, min(length, split) - first))  # rows before the split
        if deterministic:
            for j in range(n):
                _add(dev, a + j, 1, min(first + j + 1, split), device_ids)
            for j in range(causal, n):
                _add(host, a + j, 1, first + j + 1 - split, host_ids)
        else:
            if causal:
                _add(dev, a, causal, min(length, split), device_ids)
            if n - causal == 1:
                _add(dev, a + causal, 1, split, device_ids)
            elif n > causal and split:
                _add(dev, a + causal, n - causal, length, device_ids, kv_end=split)
            if n > causal:
                _add(host, a + causal, n - causal, length - split, host_ids)
    first_host = num_blocks * block_size
    device_rows = [r for r, s in enumerate(slots) if s < first_host]
    host_rows = [r for r, s in enumerate(slots) if s >= first_host]
    return StepSplit(dev, host, device_rows, [slots[r] for r in device_rows], host_rows,
                     [slots[r] - first_host for r in host_rows], deterministic)


def _add(seg: Segments, row: int, count: int, seq_len: int, table: list[int],
         kv_end: int = 0) -> None:
    if seq_len > 0:
        seg.rows.append(row)
        seg.counts.append(count)
        seg.seq_lens.append(seq_len)
        seg.tables.append(table)
        seg.kv_ends.append(kv_end)


@dataclass(slots=True)
class CooperativeStats:
    """What cooperative layers moved between device and host memory and how long the
    device waited on host parts, summed while `recording` (jobs/bench/cooperative_kv.py)."""
    num_layer_calls: int = 0
    bytes_to_host: int = 0  # the queries and the host rows' new keys and values
    bytes_to_device: int = 0  # the host part's output and log-sum-exp
    host_seconds: float = 0.0  # host parts, from their submission to their end
    # what the device waits: the host part's time past the device part's (CUDA events);
    # on a CPU, whose cores run the parts one after the other, all of the host part's
    stall_seconds: float = 0.0


_recording: CooperativeStats | None = None


@contextmanager
def recording() -> Iterator[CooperativeStats]:
    """Sum every cooperative layer's transfers and waits into the yielded stats. Timing
    the device part syncs with the device once a layer: for measurements only."""
    global _recording
    previous, _recording = _recording, CooperativeStats()
    try:
        yield _recording
    finally:
        _recording = previous


class CooperativeStep:
    """What every layer of one step reads: the split as tensors, the host pool's caches
    by layer, and the thread that runs host parts (`pool`; None: the host part runs after
    the device part in this thread, as on a CPU, whose cores both parts would share).
    Set as AttentionMetadata.cooperative; the decoder then calls `attention` instead of
    caching and attending itself."""

    def __init__(self, split: StepSplit, device: torch.device,
                 host_caches: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 pool: ThreadPoolExecutor | None, host_threads: int, device_threads: int):
        # on a CUDA device its part runs the Triton kernel there, reading these
        self.device_part = split.device.tensors().to(device)
        # only the rows the host part computes cross to the host (their segments
        # renumbered over them); the others' output is the device part's
        query_rows, host = _compact(split.host)
        self.host_part = host.tensors()
        self.deterministic = split.deterministic
        as_index = (lambda xs, on: torch.tensor(xs, dtype=torch.int64, device=on))
        self.host_query_rows = as_index(query_rows, device)
        self.device_rows = as_index(split.device_rows, device)
        self.device_slots = as_index(split.device_slots, device)
        self.host_rows = as_index(split.host_rows, device)
        self.host_slots = as_index(split.host_slots, "cpu")
        self.host_caches = host_caches  # by the device k cache's data_ptr
        self.pool = pool
        self.host_threads, self.device_threads = host_threads, device_threads

    def attention(self, layer, positions, q, k, v, rope, kv_cache) -> torch.Tensor:
        """Layer `layer`'s attention output [T, Hq, D]: q and k rotated, the new keys and
        values stored in their pools, each pool's part computed, the parts merged."""
        k_cache, v_cache = kv_cache
        host_k, host_v = self.host_caches[k_cache.data_ptr()]
        rotary_embedding(positions, q, k, *rope)
        if len(self.device_rows):
            write_kv_cache(k[self.device_rows], v[self.device_rows], k_cache, v_cache,
                           self.device_slots)
        if len(self.host_rows):
            write_kv_cache(k[self.host_rows].cpu(), v[self.host_rows].cpu(), host_k, host_v,
                           self.host_slots)
        out, lse = empty_partial(q)
        if not len(self.host_query_rows):
            attention_part(q, k_cache, v_cache, self.device_part, out, lse, scale=layer.scale,
                           num_threads=self.device_threads, deterministic=self.deterministic)
            return out
        # the host rows' queries cross to the host, their partial output comes back
        host_q = q[self.host_query_rows].cpu()
        host_out, host_lse = empty_partial(host_q)
        host_args = (host_q, host_k, host_v, self.host_part, host_out, host_lse)
        rec, timer = _recording, None
        if rec is not None:
            timer = _Timer(q.device)
        job = None if self.pool is None else self.pool.submit(
            attention_part, *host_args, scale=layer.scale, num_threads=self.host_threads)
        attention_part(q, k_cache, v_cache, self.device_part, out, lse, scale=layer.scale,
                       num_threads=self.device_threads, deterministic=self.deterministic)
        if timer is not None:
            timer.device_done()
        if job is None:
            attention_part(*host_args, scale=layer.scale, num_threads=self.host_threads)
        else:
            job.result()
        if rec is not None:
            timer.host_done(rec, serial=job is None)
            rec.bytes_to_host += _nbytes(host_q) + 2 * len(self.host_rows) * _nbytes(k[0])
            rec.bytes_to_device += _nbytes(host_out) + _nbytes(host_lse)
        rows = self.host_query_rows
        out[rows] = merge_partials(out[rows], lse[rows], host_out.to(q.device),
                                   host_lse.to(q.device))
        return out


def _compact(seg: Segments) -> tuple[list[int], Segments]:
    """The rows `seg` names, and `seg` over them alone (segment k's rows renumbered to
    follow the segments before it)."""
    rows, starts = [], []
    for row, count in zip(seg.rows, seg.counts):
        starts.append(len(rows))
        rows.extend(range(row, row + count))
    return rows, Segments(starts, list(seg.counts), list(seg.seq_lens), list(seg.tables),
                          list(seg.kv_ends))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Timer:
    """One layer's host part and device part, timed from the host part's submission."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self.events[0].record()
        self.start = time.perf_counter()
        self.device_seconds = 0.0

    def device_done(self) -> None:
        if self.events is not None:
            self.events[1].record()
        else:  # on the CPU the device part ran in this thread
            self.device_seconds = time.perf_counter() - self.start
            self.start = time.perf_counter()

    def host_done(self, rec: CooperativeStats, serial: bool) -> None:
        host = time.perf_counter() - self.start
        if self.events is not None:
            self.events[1].synchronize()
            self.device_seconds = self.events[0].elapsed_time(self.events[1]) / 1e3
        rec.num_layer_calls += 1
        rec.host_seconds += host
        rec.stall_seconds += host if serial else max(0.0, host - self.device_seconds)
