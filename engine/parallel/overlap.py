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


def grid_summed_in_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                          groups, chunks: int, times: SumTimes,
                          clock: Clock = time.perf_counter) -> torch.Tensor:
    """On a Tesseract grid (tesseract.TesseractGroups): fn(x) [N, n], a partial product
    over hidden block i, summed over grid row i, then grid column j's output blocks
    gathered side by side -> [N, q n] (o and down, tesseract_layers.py). fn runs on
    `chunks` runs of x's rows; each run's row sum starts while the next run computes, and
    its gather starts once that sum is in, while the run after next computes. One chunk:
    the sum and the gather, synchronous, after fn. Every rank of a grid row and column
    runs the same rows, so the collectives pair up in one order on each group."""
    start = clock()
    bounds = chunk_bounds(x.shape[0], chunks)
    spans, exposed, moved = [], 0.0, 0
    sums, gathers = [], []  # per run: (its sum's work, the run); (its blocks, work)

    def track(work, span):
        if work is not None:  # None: nothing moved (q 1, an empty block)
            work.get_future().then(lambda _, span=span: span.__setitem__(1, clock()))
            spans.append(span)

    def wait(work) -> None:
        nonlocal exposed
        if work is not None:
            blocked = clock()
            work.wait()
            exposed += clock() - blocked

    def gather(run: int) -> None:  # run's sum waited, its gather started
        nonlocal moved
        work, part = sums[run]
        wait(work)
        span = [clock(), None]
        blocks, work = groups.start_gather_col(part)
        track(work, span)
        gathers.append((blocks, work))
        moved += _grid_bytes(part, groups.grid.q)

    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        part = fn(x[a:b]).contiguous()
        span = [clock(), None]
        work = groups.start_all_reduce_row(part)
        track(work, span)
        sums.append((work, part))
        if n:
            gather(n - 1)
    gather(len(sums) - 1)
    for _, work in gathers:
        wait(work)
    done = clock()
    out = torch.cat([torch.cat(blocks, dim=1) for blocks, _ in gathers])
    # a completion the callback has not stamped yet ended by the wait's return
    spans = [(s, e if e is not None else done) for s, e in spans]
    times.calls += 1
    times.tokens += x.shape[0]
    times.bytes += moved
    times.comm_s += _union(spans)
    times.exposed_s += exposed
    times.compute_s += done - start - exposed
    return out


def _grid_bytes(part: torch.Tensor, q: int) -> int:
    """Bytes a rank sends summing `part` over its grid row (ring: 2 (q - 1) / q of it)
    and gathering it along its grid column ((q - 1) blocks)."""
    nbytes = part.numel() * part.element_size()
    return 2 * (q - 1) * nbytes // q + (q - 1) * nbytes


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
