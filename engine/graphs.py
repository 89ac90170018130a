"""Recorded decode steps: CUDA graphs on GPUs, CPU graphs on CPUs.

A decode step on a GPU is bound by its fixed cost: every layer launches a dozen
kernels from Python, and the GPU waits between them (on an H200, an 8-layer Llama-3-8B
slice kept the GPU busy 36% of a step). A graph records one step's launches once and
replays them with one call.

A graph replays fixed shapes and fixed addresses, so the step's inputs live in static
device buffers that each step overwrites, and a batch of B rows runs as the smallest
bucket >= B (1, 2, 4, 8, then multiples of 8 up to max_num_seqs, as vLLM does). The
padding rows write no KV (slot -1: the cache kernel skips it) and attend to one key of
a valid block, so they stay finite and touch nothing; their outputs are cut off. A
step's graph also depends on the attention's split of the keys (flash-decoding), which
the launcher picks from the longest sequence: one graph per (bucket, splits) and
whether it holds the head (below), recorded the first time a step needs it, after one
eager run of that step (which compiles the kernels and does the step's work; the
replay repeats it bit for bit). Should recording
ever fail, that step keeps its eager result and the engine runs eagerly from then on,
with one warning: no request is lost to it.

Steps whose rows each run one token use graphs (decode, and prefill chunks of one
token); the rest run eagerly, as do models that sync with the host inside the forward
pass (the MoE layers count tokens per expert), streamed layers (the weight ring waits
on events), device groups and deterministic mode.

A decode step whose requests are all plain greedy (no processors, logprobs or
structured output) records the head and the argmax too: its graph's output is the
step's token ids [bucket], and the host's only sync is reading them. Sampled rows keep
the head and sampler outside the graph (their per-row generators and data-dependent
top-k widths do not replay). The graph's body is `decode_body`, a plain function: on a
CPU, tests run it eagerly in place of a replay (`DecodeGraphs._capture` is the only
CUDA-specific part).

On CPUs a decode step is bound by the Python around its C kernel calls, and
`CpuDecodeGraphs` records the same `decode_body` as a CPU graph (engine/cpu_graphs.py:
the step's kernel calls and torch ops, replayed in one Python loop). What differs from
the GPU: one graph per exact row count (no padding rows: they would cost real compute,
and could take another kernel path, so outputs would differ from eager) up to
CPU_GRAPH_ROWS and per head flag, as many row counts as CPU_GRAPH_BYTES holds
(`CpuDecodeGraphs` states the rule); recording is the step's eager run itself (nothing
runs twice); before each replay the step's tables, lengths and slots are checked
against the cache (the kernels' wrappers check them eagerly, a replay does not), with
the eager path's error; a replayed kernel that returns another status than at
recording leaves the step and the engine eager, as a failed recording does.
Deterministic mode uses them too (a replay makes eager's calls, so its bits are
eager's); models whose decode steps take a torch path with Python-side loops (Gemma 2's
soft cap) and the torch-reference kernels (FUSEGEN_KERNELS=reference) do not.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from fusegen.engine.cpu_graphs import ReplayMismatch, record
from fusegen.engine.models.decoder import AttentionMetadata
from fusegen.engine.runner_api import LOGITS_CHUNK
from fusegen.engine.step_inputs import StepInputs, host_rows
from fusegen.kernels.argmax import argmax
from fusegen.kernels.paged_attention import decode_kv_splits

if TYPE_CHECKING:
    from fusegen.engine.config import EngineConfig
    from fusegen.engine.models.decoder import CausalLM

log = logging.getLogger("fusegen.engine")

# rows of the small-input buffer, each [max bucket] int64
_IDS, _POSITIONS, _SLOTS, _SEQ_LENS, _LENGTHS = range(5)
# what a padding row holds in each of those rows: token 0 at position 0, no KV write,
# one key to attend to, a whole length of one token
PAD = (0, 0, -1, 1, 1)


def decode_buckets(max_rows: int) -> list[int]:
    """Batch sizes with a graph of their own: 1, 2, 4, 8, then every multiple of 8,
    up to the first one >= max_rows."""
    sizes = [1, 2, 4, *range(8, max_rows + 8, 8)]
    return [b for b in sizes if b < max_rows] + [next(b for b in sizes if b >= max_rows)]


def bucket_for(buckets: list[int], rows: int) -> int:
    return next(b for b in buckets if b >= rows)


def small_inputs(inputs, bucket: int, with_lengths: bool) -> torch.Tensor:
    """[5, bucket] int64 on the host: token ids, positions, KV slots, sequence lengths
    and (for models that use them, else padding) whole request lengths, each row
    padded from len(input_ids) to `bucket` with PAD."""
    rows = len(inputs.input_ids)
    host = np.empty((5, bucket), dtype=np.int64)
    host[:, rows:] = np.array(PAD, dtype=np.int64)[:, None]
    host[_IDS, :rows] = inputs.input_ids
    host[_POSITIONS, :rows] = inputs.positions
    host[_SLOTS, :rows] = inputs.slots
    host[_SEQ_LENS, :rows] = inputs.seq_lens
    host[_LENGTHS, :rows] = inputs.request_lengths if with_lengths else PAD[_LENGTHS]
    return torch.from_numpy(host)


def greedy_head(model: CausalLM, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """rows [N, h] (x, residual) -> [N] int64, each row's argmax token, LOGITS_CHUNK
    rows at a time: the head's own argmax where it has one (`greedy_tokens`), else the
    argmax of the logits. The same ops as the runner's eager path for plain greedy
    rows (ModelRunner.head_chunks, then Sampler's argmax), so the same tokens."""
    parts = []
    for start in range(0, x.shape[0], LOGITS_CHUNK):
        x_rows, residual_rows = x[start:start + LOGITS_CHUNK], residual[start:start + LOGITS_CHUNK]
        tokens = model.greedy_tokens(x_rows, residual_rows)
        parts.append(tokens if tokens is not None else argmax(model.logits(x_rows, residual_rows)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def decode_body(runner: GraphedRunner, small: torch.Tensor, block_tables: torch.Tensor,
                query_start: torch.Tensor, max_seq_len: int, with_lengths: bool,
                head: bool) -> tuple[torch.Tensor, ...]:
    """One decode step over the static buffers, what a graph records: `small` [5, B]
    (small_inputs' rows), `block_tables` [B, width], `query_start` [B + 1] ->
    (token ids [B],) with `head` (every row plain greedy), else (x, residual) [B, h]."""
    meta = AttentionMetadata(
        slot_mapping=small[_SLOTS], block_tables=block_tables, seq_lens=small[_SEQ_LENS],
        query_start_loc=query_start, max_query_len=1, max_seq_len=max_seq_len,
        num_tokens=small[_LENGTHS] if with_lengths else None)
    model = runner.model
    x, residual = model(small[_IDS], small[_POSITIONS], runner.cos_sin, runner.kv_caches, meta)
    return (greedy_head(model, x, residual),) if head else (x, residual)


class GraphedRunner(Protocol):
    """What `DecodeGraphs` reads of the runner whose steps it records (`ModelRunner`,
    engine/model_runner.py): the model with its rotary tables and KV caches, and the
    shapes its buffers take."""
    config: EngineConfig
    device: torch.device
    block_size: int
    uses_request_lengths: bool
    model: CausalLM
    cos_sin: list  # a rotary table per base (Gemma 3: the sliding-window layers' own)
    kv_caches: list


class DecodeGraphs:
    """The recorded decode steps of one runner (on a GPU; CpuDecodeGraphs below on a
    CPU): `serves` says which steps a graph runs, `run` runs one; `replays`, `graphs`
    (by (bucket, splits), then by whether the graph holds the head) and `failed` say
    what they did."""

    def __init__(self, runner: GraphedRunner, max_rows: int, max_model_len: int):
        self.runner = runner
        self.buckets = decode_buckets(max_rows)
        device, top = runner.device, self.buckets[-1]
        self.with_lengths = runner.uses_request_lengths
        self.small = torch.tensor([[p] * top for p in PAD], dtype=torch.int64, device=device)
        width = -(-max_model_len // runner.block_size)
        self.block_tables = torch.zeros(top, width, dtype=torch.int32, device=device)
        self.query_start = torch.arange(top + 1, dtype=torch.int64, device=device)
        self.num_kv_heads = runner.config.model_config.num_kv_heads
        # one pool for every graph: they replay one at a time
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[tuple[int, int], dict[bool, tuple[torch.cuda.CUDAGraph, tuple]]] = {}
        self.replays = 0
        self.failed: str | None = None  # why recording failed; then every step is eager

    def serves(self, inputs: StepInputs) -> bool:
        return (self.failed is None and inputs.max_query_len == 1
                and len(inputs.input_ids) <= self.buckets[-1]
                and len(inputs.block_tables[0]) <= self.block_tables.shape[1])

    def run(self, inputs: StepInputs, head: bool = False) -> tuple[torch.Tensor, ...]:
        """The step through its graph: (token ids [B],) with `head` (a decode step whose
        rows are all plain greedy: the graph holds the head and the argmax), else
        (x, residual) [B, h] each."""
        rows = len(inputs.input_ids)
        bucket = bucket_for(self.buckets, rows)
        self._copy(self.small[:, :bucket], small_inputs(inputs, bucket, self.with_lengths))
        tables = host_rows(inputs.block_tables)
        self._copy(self.block_tables[:rows, :tables.shape[1]], tables)
        max_seq_len = int(np.max(inputs.seq_lens))
        key = (bucket, decode_kv_splits(self.small.device, bucket * self.num_kv_heads,
                                        max_seq_len))
        recorded = self.graphs.get(key, {})
        if head in recorded:
            out = self._replay(recorded[head], bucket, max_seq_len, head)
        else:
            out = self._record(key, bucket, max_seq_len, head)
        return tuple(t[:rows] for t in out)

    def _replay(self, recorded, bucket: int, max_seq_len: int, head: bool):
        graph, out = recorded
        graph.replay()
        self.replays += 1
        return out

    @staticmethod
    def _copy(dst: torch.Tensor, host: torch.Tensor) -> None:
        if dst.is_cuda:  # from pinned memory, queued behind the previous step's work
            dst.copy_(host.pin_memory(), non_blocking=True)
        else:
            dst.copy_(host)

    def _forward(self, bucket: int, max_seq_len: int, head: bool):
        """The step over the first `bucket` rows of the buffers, as a call of nothing."""
        small, tables = self.small[:, :bucket], self.block_tables[:bucket]
        query_start = self.query_start[:bucket + 1]

        def forward():
            return decode_body(self.runner, small, tables, query_start, max_seq_len,
                               self.with_lengths, head)
        return forward

    def _fail(self, failure: Exception, what: str) -> None:
        self.failed = f"{type(failure).__name__}: {failure}"
        log.warning("%s failed (%s); this engine runs every step eagerly from now on",
                    what, self.failed)

    def _record(self, key, bucket: int, max_seq_len: int, head: bool):
        forward = self._forward(bucket, max_seq_len, head)
        eager = forward()  # this step, eagerly: compiles what the graph will launch
        try:
            graph, out = self._capture(forward)
        except Exception as failure:  # noqa: BLE001 - whatever refused, the step is done
            self._fail(failure, "recording a decode step as a CUDA graph")
            return eager
        graph.replay()  # the step again, from the graph: the same writes, the same output
        self.graphs.setdefault(key, {})[head] = (graph, out)
        return out

    def _capture(self, forward):
        """(the graph of `forward`'s launches, the output tensors it replays into)"""
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads in the process (a job's, a user's) is
        # neither refused nor recorded while this thread records
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()
        return graph, out


# CPU graphs serve decode steps of up to this many rows: what a replay saves is the
# Python around a step's kernel calls, a fixed cost per step that a step's own compute
# outgrows as rows are added, while recording a step costs about half an eager step
# more; past 16 rows a row count must recur many times to repay its recording, and a
# run whose batch shrinks meets each count only a few times.
CPU_GRAPH_ROWS = 16
# The bytes all CPU graphs of an engine may keep: each keeps every intermediate tensor
# of its step, about rows x one row's activations (CpuDecodeGraphs: which row counts
# get a graph within it).
CPU_GRAPH_BYTES = 256 << 20


def rows_within(bytes_per_row: float, cap: int) -> int:
    """The largest n whose graphs of 1..n rows, `bytes_per_row` (> 0) each row, keep at
    most `cap` bytes: n (n + 1) / 2 rows in all."""
    n = int((2 * cap / bytes_per_row) ** 0.5)
    while n * (n + 1) / 2 * bytes_per_row > cap:
        n -= 1
    return n


def cpu_graphable(model: CausalLM) -> bool:
    """Whether a CPU graph replays `model`'s decode steps right: every layer without
    host syncs, and every kernel of a decode step a C kernel or a torch op whose shapes
    do not depend on the step's values (Gemma 2's soft-capped attention runs the torch
    reference, which loops over the sequences in Python)."""
    from fusegen.kernels import use_native

    return (model.graphable and use_native(torch.empty(0))
            and all(not getattr(layer, "softcap", 0) for layer in model.layers))


def bounds_problem(inputs: StepInputs, num_blocks: int, block_size: int) -> str | None:
    """What the eager step's kernels would refuse in the step's tables, lengths and
    slots (their bounds checks do not run in a replay), in their words; None: fine."""
    from fusegen.kernels.paged_attention_cpu import table_bounds_problem

    problem = table_bounds_problem(torch.from_numpy(np.asarray(inputs.block_tables)),
                                   torch.from_numpy(np.asarray(inputs.seq_lens)),
                                   num_blocks, block_size)
    if problem is None:
        slots = int(np.max(inputs.slots))
        if slots >= num_blocks * block_size:
            return f"slot {slots} outside a KV cache of {num_blocks} blocks of {block_size}"
    return problem


class CpuDecodeGraphs(DecodeGraphs):
    """Recorded decode steps on a CPU (engine/cpu_graphs.py). The rule: one graph per
    exact row count and head flag, recorded the first time a step of that many rows
    runs, for row counts 1..`rows`, and the graphs kept total at most CPU_GRAPH_BYTES.
    `rows` starts at min(max_num_seqs, CPU_GRAPH_ROWS); each graph recorded lowers it
    to the largest n whose graphs of 1..n rows, at that graph's bytes per row (a graph
    keeps its step's intermediates: bytes in proportion to rows), fit in
    CPU_GRAPH_BYTES, so small row counts, which save a step as much Python as large
    ones at a fraction of the bytes, are not crowded out by the large ones a run
    starts with. A graph past `rows`, or one that would pass the cap all the same (both
    head flags recorded), is dropped, and `rows` drops below it. Steps of more than `rows` rows without a graph run
    eagerly, outside the graphs (`serves`). No padding rows: they would cost real
    compute, and could take another kernel path than the rows alone, so outputs would
    differ from eager. Recording IS the step's eager run; a replay makes the same kernel
    calls, so its outputs are eager's bit for bit, which each graph's first replay
    checks against the step run eagerly (work outside the recorded calls would show
    there). `nbytes`: what the graphs keep."""

    def __init__(self, runner: GraphedRunner, max_rows: int, max_model_len: int):
        max_rows = min(max_rows, CPU_GRAPH_ROWS)
        super().__init__(runner, max_rows, max_model_len)
        self.buckets = list(range(1, max_rows + 1))
        self.rows = max_rows
        self.nbytes = 0
        self._checked: set = set()  # graphs whose first replay matched the eager step
        self.num_blocks = next(c for c in runner.kv_caches if c is not None)[0].shape[0]

    def serves(self, inputs: StepInputs) -> bool:
        """Row counts up to `rows`, and larger ones that kept a graph: the rest take the
        runner's own eager path, not the static buffers'."""
        rows = len(inputs.input_ids)
        return super().serves(inputs) and (rows <= self.rows
                                           or any(key[0] == rows for key in self.graphs))

    def run(self, inputs: StepInputs, head: bool = False) -> tuple[torch.Tensor, ...]:
        problem = bounds_problem(inputs, self.num_blocks, self.runner.block_size)
        if problem is not None:
            raise IndexError(problem)
        return super().run(inputs, head)

    def _replay(self, recorded, bucket: int, max_seq_len: int, head: bool):
        graph, out = recorded
        try:
            graph.replay()
        except ReplayMismatch as failure:
            self._fail(failure, "replaying a decode step's CPU graph")
            return self._forward(bucket, max_seq_len, head)()  # the step again, eagerly
        if graph not in self._checked:
            # A graph's first replay is checked against the same step run eagerly after
            # it (which also rewrites the step's KV slots, should the replay have written
            # them wrong): work of a step that is neither a fusegen C kernel nor a torch
            # op (a Triton kernel in the interpreter, numpy on a tensor's memory) is not
            # recorded, and its stale outputs show here rather than in later tokens.
            eager = self._forward(bucket, max_seq_len, head)()
            if not all(torch.equal(a, b) for a, b in zip(out, eager)):
                self._fail(RuntimeError("its outputs differ from the same step run eagerly: "
                                        "the step computes outside the C kernels and torch "
                                        "ops a graph records"),
                           "replaying a decode step's CPU graph")
                return eager
            self._checked.add(graph)
        self.replays += 1
        return out

    def _record(self, key, bucket: int, max_seq_len: int, head: bool):
        forward = self._forward(bucket, max_seq_len, head)
        if bucket > self.rows:  # a larger row count's other head flag: eagerly, unrecorded
            return forward()
        try:
            graph, out = record(forward)  # the step itself, eagerly, recorded as it runs
        except Exception as failure:  # noqa: BLE001 - the step runs again, eagerly
            out = forward()  # a failure of the step itself raises again here
            self._fail(failure, "recording a decode step as a CPU graph")
            return out
        if graph.nbytes:  # how many row counts the cap holds at this graph's bytes per row
            self.rows = min(self.rows, rows_within(graph.nbytes / bucket, CPU_GRAPH_BYTES))
        if bucket > self.rows or self.nbytes + graph.nbytes > CPU_GRAPH_BYTES:
            self.rows = min(self.rows, bucket - 1)
            log.debug("CPU graphs: %d rows%s keep %d bytes, %d kept already: past what "
                      "CPU_GRAPH_BYTES holds; steps of more than %d rows without a graph "
                      "run eagerly", bucket, " with the head" if head else "", graph.nbytes,
                      self.nbytes, self.rows)
            return out
        self.nbytes += graph.nbytes
        log.debug("CPU graph: %d rows%s, %d kernel calls, %d torch ops, %d bytes kept "
                  "(%d in all)", bucket, " with the head" if head else "", graph.num_calls,
                  graph.num_ops, graph.nbytes, self.nbytes)
        self.graphs.setdefault(key, {})[head] = (graph, out)
        return out
