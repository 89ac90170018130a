"""A scheduled batch as the forward pass takes it, in plain lists (`StepInputs`): the
runner in this process (engine/model_runner.py), its recorded decode steps
(engine/graphs.py) and a device group's controller and ranks (engine/parallel) all
take a step in this form."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from fusegen.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepInputs:
    """A step's batch as plain lists: what the forward pass needs (the controller of a
    device group sends exactly this to its ranks, engine/parallel)."""
    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # each token's KV cache slot
    block_tables: list[list[int]]  # padded to one width
    seq_lens: list[int]
    query_start: list[int]
    sample_rows: list[int]  # rows of the requests whose last uncomputed token runs
    sample_reqs: list[int]  # their indexes in the batch
    max_query_len: int
    request_lengths: list[int] | None  # each request's whole length, where the model uses it
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]


def step_inputs(batch: ScheduledBatch, block_size: int, with_lengths: bool) -> StepInputs:
    """`batch`'s uncomputed tokens in order, with their KV slots and the rows to sample;
    `with_lengths`: each request's whole length too (a model that reads it)."""
    bs = block_size
    input_ids, positions, slots, seq_lens = [], [], [], []
    query_start = [0]
    sample_rows, sample_reqs = [], []
    for i, (req, n) in enumerate(zip(batch.requests, batch.num_scheduled_tokens)):
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        input_ids += req.token_ids[start:end]
        positions += range(start, end)
        table = req.block_table
        slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        query_start.append(query_start[-1] + n)
        seq_lens.append(end)
        if end == req.num_tokens:
            sample_rows.append(query_start[-1] - 1)
            sample_reqs.append(i)
    width = max(len(r.block_table) for r in batch.requests)
    tables = [r.block_table + [0] * (width - len(r.block_table)) for r in batch.requests]
    lengths = [r.num_tokens for r in batch.requests] if with_lengths else None
    return StepInputs(input_ids, positions, slots, tables, seq_lens, query_start, sample_rows,
                      sample_reqs, max(batch.num_scheduled_tokens), lengths,
                      batch.swap_out, batch.swap_in)


def host_rows(rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), width] int32 on the host from equal-length lists of ints (a step's
    block tables): through numpy, which converts nested lists about 3x faster than
    torch.tensor (256 rows of 24 blocks: 90 against 250 us)."""
    return torch.from_numpy(np.array(rows, dtype=np.int32))
