"""A row-parallel product summed over the tensor-parallel group in chunks of the step's
tokens, each chunk's all-reduce started (an async work handle) while the next chunk
computes, and the clock that says how much of the communication the compute hid.

Chunks are runs of token rows, not runs of down's output columns: a chunk of rows runs
the whole MLP (gate_up, activation, down; a mixture of experts' routing and experts
too), so three matmuls hide the previous chunk's all-reduce where a chunk of columns
would have down's next columns only; and each row's sum over the ranks is the same
elementwise sum it is unchunked. The cost: every chunk reads the layer's weights again,
which a step of few rows (a decode step, bound by weight bytes) pays in full.

Timing (`SumTimes`, per layer and part): `comm_s` is the time at least one of a call's
all-reduces was in flight (started, not yet completed in the collective's own thread);
`exposed_s` the time the caller sat blocked on them; hidden = comm_s - exposed_s, and
the overlap fraction hidden / comm_s. In flight includes waiting for the slowest rank to
join: skew between ranks counts as communication.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import torch.distributed as dist

Clock = Callable[[], float]


@dataclasses.dataclass(slots=True)
class SumTimes:
    """One summed product's totals over the steps (one layer's o, or its MLP)."""
    calls: int = 0
    tokens: int = 0  # rows summed
    bytes: int = 0  # sent by this rank (a ring all-reduce receives as many)
    compute_s: float = 0.0  # the call's wall time, less exposed_s
    comm_s: float = 0.0
    exposed_s: float = 0.0

    @property
    def hidden_s(self) -> float:
        return max(self.comm_s - self.exposed_s, 0.0)


def chunk_bounds(num_rows: int, chunks: int) -> list[int]:
    """Run starts and the end: min(chunks, rows) near-equal runs (at least one)."""
    n = max(min(chunks, num_rows), 1)
    return [num_rows * i // n for i in range(n + 1)]


def summed_in_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, group,
                     chunks: int, times: SumTimes, clock: Clock = time.perf_counter
                     ) -> torch.Tensor:
    """fn(x) [N, out] summed over `group` (layers.TPGroup), fn run on `chunks` runs of
    x's rows (x [N, in]); fn must act on each row alone. One chunk: one synchronous
    all-reduce after fn, as without overlap."""
    start = clock()
    bounds = chunk_bounds(x.shape[0], chunks)
    if len(bounds) == 2:
        out = fn(x)
        issued = clock()
        group.all_reduce(out)
        done = clock()
        spans = [(issued, done)]
        exposed = done - issued
    else:
        parts, works, spans = [], [], []
        for a, b in zip(bounds, bounds[1:]):
            part = fn(x[a:b]).contiguous()
            span = [clock(), None]  # [issued, completed]
            work = group.start_all_reduce(part)
            work.get_future().then(lambda _, span=span: span.__setitem__(1, clock()))
            parts.append(part)
            works.append(work)
            spans.append(span)
        waiting = clock()
        for work in works:
            work.wait()
        done = clock()
        exposed = done - waiting
        out = torch.cat(parts)
        # a completion the callback has not stamped yet ended by the wait's return
        spans = [(s, e if e is not None else done) for s, e in spans]
    times.calls += 1
    times.tokens += x.shape[0]
    times.bytes += group.all_reduce_bytes(out)
    times.comm_s += _union(spans)
    times.exposed_s += exposed
    times.compute_s += done - start - exposed
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the intervals."""
    total, reach = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def overlap_summary(per_rank: dict[int, dict[str, dict]]) -> dict:
    """Every rank's `TPGroup.overlap_stats()` as the group's figures: seconds summed
    over ranks and layers, the overlap fraction (hidden / communication), and per
    layer and part the same with bytes per token (one rank's)."""
    layers: dict[str, dict] = {}
    for stats in per_rank.values():
        for key, row in stats.items():
            if not row["calls"]:  # another pipeline stage's layer
                continue
            acc = layers.setdefault(key, dict.fromkeys(
                ("ranks", "calls", "tokens", "bytes", "compute_s", "comm_s", "exposed_s"), 0))
            acc["ranks"] += 1
            for name in row:
                acc[name] += row[name]
    for row in layers.values():
        _finish(row)
        # every rank of a stage sums the same rows: calls, tokens and bytes per rank
        for name in ("calls", "tokens", "bytes"):
            row[name] //= row["ranks"]
        row["bytes_per_token"] = row["bytes"] / row["tokens"] if row["tokens"] else 0.0
    total = dict.fromkeys(("compute_s", "comm_s", "exposed_s"), 0.0)
    for row in layers.values():
        for name in total:
            total[name] += row[name]
    _finish(total)
    return {**total, "ranks": len(per_rank), "layers": layers}


def _finish(row: dict) -> None:
    row["hidden_s"] = max(row["comm_s"] - row["exposed_s"], 0.0)
    row["overlap_fraction"] = row["hidden_s"] / row["comm_s"] if row["comm_s"] else 0.0
