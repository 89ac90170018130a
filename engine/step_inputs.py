"""A scheduled batch as the forward pass takes it, in numpy arrays (`StepInputs`): the
runner in this process (engine/model_runner.py), its recorded decode steps
(engine/graphs.py) and a device group's controller and ranks (engine/parallel) all
take a step in this form.

Built with one pass over the requests per field (the per-request numbers the scheduler
keeps in Python) and numpy for the rest: positions, KV slots, which rows sample. A
256-request decode step's inputs take a few passes of C-level iteration, not a Python
loop over its tokens. Below SMALL_BATCH requests one Python pass is cheaper, and its
lists become the same arrays."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from fusegen.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepInputs:
    """A step's batch as int64 arrays (block tables int32): what the forward pass needs
    (the controller of a device group sends exactly this to its ranks, engine/parallel).
    T: the step's tokens, B: its requests, S: the requests that sample."""
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] each token's KV cache slot
    block_tables: np.ndarray  # [B, width] int32, each padded with 0 to the widest
    seq_lens: np.ndarray  # [B] each request's computed tokens after the step
    query_start: np.ndarray  # [B + 1] each request's first row, then T
    sample_rows: np.ndarray  # [S] rows of the requests whose last uncomputed token runs
    sample_reqs: np.ndarray  # [S] their indexes in the batch
    max_query_len: int
    request_lengths: np.ndarray | None  # [B] each request's whole length, where the model uses it
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    @property
    def is_decode(self) -> bool:
        """Every request runs one token, and every one samples (a decode step)."""
        return self.max_query_len == 1 and len(self.sample_rows) == len(self.input_ids)


# Below this many requests one Python pass over the tokens costs less than numpy's
# per-call overhead (about a microsecond a call, a dozen calls a step).
SMALL_BATCH = 8


def step_inputs(batch: ScheduledBatch, block_size: int, with_lengths: bool) -> StepInputs:
    """`batch`'s uncomputed tokens in order, with their KV slots and the rows to sample;
    `with_lengths`: each request's whole length too (a model that reads it)."""
    if len(batch.requests) < SMALL_BATCH:
        return _small_step_inputs(batch, block_size, with_lengths)
    requests, counts = batch.requests, batch.num_scheduled_tokens
    num_reqs = len(requests)
    starts = [r.num_computed_tokens for r in requests]
    lengths = np.array([r.num_tokens for r in requests], dtype=np.int64)
    tables = block_tables(requests)
    num_tokens = sum(counts)
    if num_tokens == num_reqs:  # one token a request (decode): a row per request
        input_ids = np.array([r.token_ids[s] for r, s in zip(requests, starts)], dtype=np.int64)
        positions = np.array(starts, dtype=np.int64)
        seq_lens = positions + 1
        query_start = np.arange(num_reqs + 1, dtype=np.int64)
        owner = query_start[:-1]  # [T] each row's request
    else:
        input_ids = np.fromiter(chain.from_iterable(
            r.token_ids[s:s + n] for r, s, n in zip(requests, starts, counts)),
            dtype=np.int64, count=num_tokens)
        sizes = np.array(counts, dtype=np.int64)
        query_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(sizes, out=query_start[1:])
        seq_lens = np.array(starts, dtype=np.int64) + sizes
        owner = np.repeat(np.arange(num_reqs), sizes)
        # each row's position: its request's first position plus its offset in the request
        positions = np.arange(num_tokens, dtype=np.int64) + (seq_lens - query_start[1:])[owner]
    blocks, offsets = np.divmod(positions, block_size)
    slots = tables[owner, blocks] * np.int64(block_size) + offsets
    samples = seq_lens == lengths  # the request's last uncomputed token runs
    sample_reqs = np.flatnonzero(samples)
    sample_rows = query_start[1:][sample_reqs] - 1
    return StepInputs(input_ids, positions, slots, tables, seq_lens, query_start, sample_rows,
                      sample_reqs, max(counts), lengths if with_lengths else None,
                      batch.swap_out, batch.swap_in)


def _small_step_inputs(batch: ScheduledBatch, block_size: int,
                       with_lengths: bool) -> StepInputs:
    """step_inputs for a few requests: the rows in one Python pass, then arrays."""
    bs = block_size
    input_ids, positions, slots, seq_lens, lengths = [], [], [], [], []
    query_start, sample_rows, sample_reqs = [0], [], []
    for i, (req, n) in enumerate(zip(batch.requests, batch.num_scheduled_tokens)):
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        input_ids += req.token_ids[start:end]
        positions += range(start, end)
        table = req.block_table
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        query_start.append(query_start[-1] + n)
        seq_lens.append(end)
        lengths.append(req.num_tokens)
        if end == lengths[-1]:
            sample_rows.append(query_start[-1] - 1)
            sample_reqs.append(i)
    as_array = functools.partial(np.array, dtype=np.int64)
    return StepInputs(as_array(input_ids), as_array(positions), as_array(slots),
                      block_tables(batch.requests), as_array(seq_lens), as_array(query_start),
                      as_array(sample_rows), as_array(sample_reqs),
                      max(batch.num_scheduled_tokens),
                      as_array(lengths) if with_lengths else None, batch.swap_out,
                      batch.swap_in)


def block_tables(requests) -> np.ndarray:
    """[B, width] int32: each request's block table, padded with 0 to the widest."""
    widths = [len(r.block_table) for r in requests]
    width = max(widths)
    if len(requests) < SMALL_BATCH:
        return np.array([r.block_table + [0] * (width - n) for r, n in zip(requests, widths)],
                        dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(r.block_table for r in requests), dtype=np.int32,
                       count=sum(widths))
    if flat.size == len(requests) * width:  # every table as wide: no padding
        return flat.reshape(len(requests), width)
    tables = np.zeros((len(requests), width), dtype=np.int32)
    tables[np.arange(width) < np.array(widths)[:, None]] = flat
    return tables


def host_rows(rows) -> torch.Tensor:
    """[len(rows), width] int32 on the host from equal-length rows of ints (a step's
    block tables): the array itself where it is one, else converted through numpy,
    which converts nested lists about 3x faster than torch.tensor."""
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int32))
