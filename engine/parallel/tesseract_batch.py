"""Which sequences each rank of a Tesseract grid runs: pure policy over plain lists.

The grid's p = q x q x d ranks split a step's sequences into q d sequence groups:
group g = k q + i runs on depth layer k, and within it grid row i attends it. A depth
layer's q^2 ranks all run every token of its groups through the linears (each its
weight blocks); rank (i, j, k) attends heads block j of group (i, k)'s sequences and
keeps their keys and values only. So a sequence must stay in one group for as long as
its KV blocks live (`SequenceGroups`): across steps, chunked prefill, swapping out and
in, and a prompt that starts from another request's cached blocks (which only that
request's group computed).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusegen.engine.parallel.tesseract import GridShape
from fusegen.engine.step_inputs import StepInputs


class SequenceGroups:
    """The controller's record of each running request's sequence group.

    A request keeps the group it first ran in until it finishes. A new request whose
    first tokens came from the prefix cache (computed tokens at first sight) joins the
    group that wrote its first block: every block of a cached prefix was written by the
    group holding the prefix's first block. Any other new request joins the group with
    the fewest of the step's requests (the lowest such group on a tie)."""

    def __init__(self, grid: GridShape):
        self.num_groups = grid.q * grid.depth
        self.group_of: dict[int, int] = {}  # request id -> its group
        self.block_owner: dict[int, int] = {}  # device KV block -> the group that wrote it
        self._live: dict[int, object] = {}  # request id -> the request, until it finishes

    def assign(self, requests: list) -> list[int]:
        """Each request's group (in the batch's order); `requests` carry request_id,
        block_table, num_computed_tokens and status (engine/request.py)."""
        self._forget_finished()
        counts = [0] * self.num_groups
        for req in requests:
            if req.request_id in self.group_of:
                counts[self.group_of[req.request_id]] += 1
        out = []
        for req in requests:
            group = self.group_of.get(req.request_id)
            if group is None:
                first = req.block_table[0] if req.block_table else None
                if req.num_computed_tokens and first in self.block_owner:
                    group = self.block_owner[first]
                else:
                    group = min(range(self.num_groups), key=lambda g: (counts[g], g))
                self.group_of[req.request_id] = group
                self._live[req.request_id] = req
                counts[group] += 1
            for block in req.block_table:
                self.block_owner[block] = group
            out.append(group)
        return out

    def _forget_finished(self) -> None:
        done = [rid for rid, req in self._live.items() if req.status.name == "FINISHED"]
        for rid in done:
            del self._live[rid], self.group_of[rid]


@dataclass(slots=True)
class RankStep:
    """What one rank runs of a step: its depth layer's requests (`inputs`, grouped by
    grid row in row order, the step's order within a row), the requests and token rows
    of its own grid row among them (`attend`, `rows`), each grid row's token count
    (`row_tokens`: the attention outputs' gather), and, for each sampled row of
    `inputs`, its place among the whole step's sampled rows (`sample_places`)."""
    inputs: StepInputs | None  # None: no request of the step runs on this depth layer
    attend: StepInputs | None  # None: none of them in this rank's grid row
    rows: range
    row_tokens: list[int]
    sample_places: list[int]


def rank_step(inputs: StepInputs, groups: list[int], grid: GridShape, i: int,
              k: int) -> RankStep:
    """The share of `inputs` that rank (i, *, k) runs, from each request's group."""
    q = grid.q
    order = sorted((b for b, g in enumerate(groups) if g // q == k),
                   key=lambda b: (groups[b] % q, b))
    row_tokens = [0] * q
    for b in order:
        row_tokens[groups[b] % q] += int(inputs.query_start[b + 1] - inputs.query_start[b])
    if not order:
        return RankStep(None, None, range(0), row_tokens, [])
    place = {int(b): n for n, b in enumerate(inputs.sample_reqs)}
    depth = select_requests(inputs, order)
    sample_places = [place[order[b]] for b in depth.sample_reqs.tolist()]
    mine = [n for n, b in enumerate(order) if groups[b] % q == i]
    start = sum(row_tokens[:i])
    rows = range(start, start + row_tokens[i])
    return RankStep(depth, select_requests(depth, mine) if mine else None, rows, row_tokens,
                    sample_places)


def select_requests(inputs: StepInputs, order: list[int]) -> StepInputs:
    """`inputs` of the requests `order` (indexes into its requests), in that order, as
    arrays; the swaps are the step's own (every rank copies its share of every block)."""
    qs = np.asarray(inputs.query_start, dtype=np.int64)
    take = np.asarray(order, dtype=np.int64)
    counts = qs[take + 1] - qs[take]
    rows = np.concatenate([np.arange(qs[b], qs[b + 1]) for b in order])
    query_start = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    sampled = np.isin(take, np.asarray(inputs.sample_reqs, dtype=np.int64))
    lengths = None if inputs.request_lengths is None else \
        np.asarray(inputs.request_lengths, dtype=np.int64)[take]
    return StepInputs(np.asarray(inputs.input_ids, dtype=np.int64)[rows],
                      np.asarray(inputs.positions, dtype=np.int64)[rows],
                      np.asarray(inputs.slots, dtype=np.int64)[rows],
                      np.asarray(inputs.block_tables, dtype=np.int32)[take],
                      np.asarray(inputs.seq_lens, dtype=np.int64)[take], query_start,
                      query_start[1:][sampled] - 1, np.flatnonzero(sampled),
                      int(counts.max()), lengths, inputs.swap_out, inputs.swap_in)
