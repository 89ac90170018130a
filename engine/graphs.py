"""CUDA graphs for decode steps.

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
the launcher picks from the longest sequence: one graph per (bucket, splits), recorded
the first time a step needs it, after one eager run of that step (which compiles the
kernels and does the step's work; the replay repeats it bit for bit). Should recording
ever fail, that step keeps its eager result and the engine runs eagerly from then on,
with one warning: no request is lost to it.

Steps whose rows each run one token use graphs (decode, and prefill chunks of one
token); the rest run eagerly, as do models that sync with the host inside the forward
pass (the MoE layers count tokens per expert), streamed layers (the weight ring waits
on events), device groups and deterministic mode.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

from fusegen.engine.models.decoder import AttentionMetadata
from fusegen.engine.step_inputs import StepInputs, host_rows
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
    pad = bucket - len(inputs.input_ids)
    lengths = inputs.request_lengths if with_lengths else [PAD[_LENGTHS]] * len(inputs.input_ids)
    rows = (inputs.input_ids, inputs.positions, inputs.slots, inputs.seq_lens, lengths)
    return torch.tensor([list(row) + [p] * pad for row, p in zip(rows, PAD)], dtype=torch.int64)


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
    """The recorded decode steps of one runner on a GPU: `serves` says which steps a
    graph runs, `run` runs one; `replays`, `graphs` (by (bucket, splits)) and `failed`
    say what they did."""

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
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.replays = 0
        self.failed: str | None = None  # why recording failed; then every step is eager

    def serves(self, inputs: StepInputs) -> bool:
        return (self.failed is None and inputs.max_query_len == 1
                and len(inputs.input_ids) <= self.buckets[-1]
                and len(inputs.block_tables[0]) <= self.block_tables.shape[1])

    def run(self, inputs: StepInputs):
        """The step's (x, residual) [B, h] each, through the step's graph."""
        rows = len(inputs.input_ids)
        bucket = bucket_for(self.buckets, rows)
        self._copy(self.small[:, :bucket], small_inputs(inputs, bucket, self.with_lengths))
        tables = host_rows(inputs.block_tables)
        self._copy(self.block_tables[:rows, :tables.shape[1]], tables)
        max_seq_len = max(inputs.seq_lens)
        key = (bucket, decode_kv_splits(self.small.device, bucket * self.num_kv_heads,
                                        max_seq_len))
        if key in self.graphs:
            graph, (x, residual) = self.graphs[key]
            graph.replay()
            self.replays += 1
        else:
            x, residual = self._record(key, bucket, max_seq_len)
        return x[:rows], residual[:rows]

    @staticmethod
    def _copy(dst: torch.Tensor, host: torch.Tensor) -> None:
        if dst.is_cuda:  # from pinned memory, queued behind the previous step's work
            dst.copy_(host.pin_memory(), non_blocking=True)
        else:
            dst.copy_(host)

    def _record(self, key, bucket: int, max_seq_len: int):
        small = self.small[:, :bucket]
        meta = AttentionMetadata(
            slot_mapping=small[_SLOTS], block_tables=self.block_tables[:bucket],
            seq_lens=small[_SEQ_LENS], query_start_loc=self.query_start[:bucket + 1],
            max_query_len=1, max_seq_len=max_seq_len,
            num_tokens=small[_LENGTHS] if self.with_lengths else None)
        runner = self.runner

        def forward():
            return runner.model(small[_IDS], small[_POSITIONS], runner.cos_sin,
                                runner.kv_caches, meta)

        eager = forward()  # this step, eagerly: compiles what the graph will launch
        try:
            graph, out = self._capture(forward)
        except Exception as failure:  # noqa: BLE001 - whatever refused, the step is done
            self.failed = f"{type(failure).__name__}: {failure}"
            log.warning("recording a decode step as a CUDA graph failed (%s); this engine "
                        "runs every step eagerly from now on", self.failed)
            return eager
        graph.replay()  # the step again, from the graph: the same writes, the same output
        self.graphs[key] = (graph, out)
        return out

    def _capture(self, forward):
        """(the graph of `forward`'s launches, the output tensors it replays into)"""
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work of other threads in the process (a job's, a user's) is
        # neither refused nor recorded while this thread records
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()
        return graph, out
