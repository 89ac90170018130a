"""A scheduled batch as the forward pass takes it, in numpy arrays (`StepInputs`): the
runner in this process (engine/model_runner.py), its recorded decode steps
(engine/graphs.py) and a device group's controller and ranks (engine/parallel) all
take a step in this form.

Built with one pass over the requests per field (the per-request numbers the scheduler
keeps in Python) and numpy for the rest: positions, KV slots, which rows sample. A
256-request decode step's inputs take a few passes of C-level iteration, not a Python
loop over its tokens."""
from __future__ import annotations

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


def step_inputs(batch: ScheduledBatch, block_size: int, with_lengths: bool) -> StepInputs:
    """`batch`'s uncomputed tokens in order, with their KV slots and the rows to sample;
    `with_lengths`: each request's whole length too (a model that reads it)."""
    requests = batch.requests
    num_reqs = len(requests)
    counts = np.array(batch.num_scheduled_tokens, dtype=np.int64)  # [B]
    starts = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
    lengths = np.array([r.num_tokens for r in requests], dtype=np.int64)
    ends = starts + counts  # [B]
    query_start = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    num_tokens = int(query_start[-1])
    max_query_len = int(counts.max())
    if max_query_len == 1:  # one token a request: its position is its computed count
        input_ids = np.array([r.token_ids[r.num_computed_tokens] for r in requests],
                             dtype=np.int64)
        positions, owner = starts, np.arange(num_reqs)
    else:
        input_ids = np.fromiter(chain.from_iterable(
            r.token_ids[s:s + n] for r, s, n in zip(requests, starts.tolist(),
                                                     batch.num_scheduled_tokens)),
            dtype=np.int64, count=num_tokens)
        owner = np.repeat(np.arange(num_reqs), counts)  # [T] each row's request
        positions = np.arange(num_tokens, dtype=np.int64) + (starts - query_start[:-1])[owner]
    tables = block_tables(requests)
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size \
        + positions % block_size
    samples = ends == lengths  # the request's last uncomputed token runs
    sample_reqs = np.flatnonzero(samples)
    return StepInputs(input_ids, positions, slots, tables, ends, query_start,
                      query_start[1:][samples] - 1, sample_reqs, max_query_len,
                      lengths if with_lengths else None, batch.swap_out, batch.swap_in)


def block_tables(requests) -> np.ndarray:
    """[B, width] int32: each request's block table, padded with 0 to the widest."""
    widths = np.array([len(r.block_table) for r in requests], dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(r.block_table for r in requests), dtype=np.int32,
                       count=int(widths.sum()))
    width = int(widths.max())
    if flat.size == len(requests) * width:  # every table as wide: no padding
        return flat.reshape(len(requests), width)
    tables = np.zeros((len(requests), width), dtype=np.int32)
    tables[np.arange(width) < widths[:, None]] = flat
    return tables


def host_rows(rows) -> torch.Tensor:
    """[len(rows), width] int32 on the host from equal-length rows of ints (a step's
    block tables): the array itself where it is one, else converted through numpy,
    which converts nested lists about 3x faster than torch.tensor."""
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int32))
