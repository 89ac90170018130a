"""The runner contract: what the engine (engine/llm_engine.py), jobs (jobs/engines.py)
and the benchmark (jobs/bench/fusegen_runner.py) may ask of the object that turns
scheduled batches into sampled tokens.

Two classes implement it, each declaring so by subclassing `Runner`: `ModelRunner`
(engine/model_runner.py, the whole model in this process) and `ParallelRunner`
(engine/parallel/parallel_runner.py, the controller of a device group, which holds no
weights). It is a module of its own so that neither implementation owns the other's
contract and the engine reads a runner without importing either.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from fusegen.engine.memory.offload import WeightStreamer
    from fusegen.engine.scheduler import ScheduledBatch


# Sampled rows go through the LM head and the sampler this many at a time, so the
# logits of a 1024-request decode step never exist at once. Every runner honours it,
# and the memory plan's activation reserve counts at most this many [vocab] rows
# whatever max_num_seqs is: it belongs to the contract between the two.
LOGITS_CHUNK = 256


class RecordedSteps(Protocol):
    """What the contract shows of a runner's recorded decode steps (engine/graphs.py's
    `DecodeGraphs`, which implements it): counts for the benchmark's report."""
    graphs: dict  # the recorded graphs, by (rows bucket, KV splits)
    replays: int  # decode steps replayed from a recorded graph
    failed: str | None  # why recording failed (every step then eager), else None


class Runner(Protocol):
    # batches submitted before the oldest must be collected: 1, or a pipeline's stage count
    max_in_flight: int
    num_blocks: int  # KV blocks of the device pool
    num_host_blocks: int  # KV blocks of the host pool (swapped-out requests)
    # each step carries every request's whole length (LongRoPE picks its factors by it,
    # so a prefix's keys depend on the whole request: the engine caches no prefixes)
    uses_request_lengths: bool
    # every prompt row's logprobs can be recorded; a device group returns the sampled
    # rows' logits only
    supports_prompt_logprobs: bool
    # the ring this process streams host- and disk-tier layers through; None when every
    # layer is resident, or when ranks of a device group stream for themselves
    streamer: WeightStreamer | None
    graphs: RecordedSteps | None  # recorded decode steps (CUDA graphs), else None
    # `overlap_steps` is available (asynchronous scheduling, engine/llm_engine.py)
    supports_async_scheduling: bool = False

    @property
    def failed(self) -> str | None:
        """Why the runner can run no more steps (a device group lost a rank), else None."""

    def submit(self, batch: ScheduledBatch) -> None:
        """Hand over a batch; at most `max_in_flight` wait to be collected."""

    def overlap_steps(self) -> None:
        """Asynchronous scheduling from now on: `submit` takes the batch's inputs at once
        and returns while the step runs; a request's PLACEHOLDER input
        (engine/request.py) is its token sampled by the step submitted before."""
        raise NotImplementedError(f"{type(self).__name__} runs no asynchronous scheduling")

    def collect(self) -> list[int | None]:
        """The oldest submitted batch's tokens, waiting for them: one per request, None
        for a request whose last uncomputed token did not run (a prefill chunk)."""

    def memory_report(self) -> dict:
        """Bytes per tier (device, host, disk) and use, the budgets and the device peak."""

    def step_weight_bytes(self) -> int | None:
        """The weight bytes a decode step reads, as held (compressed where kept); None
        where this process holds no model (a device group's ranks do)."""

    def local_model(self) -> "torch.nn.Module | None":
        """The model, where this process holds it whole (for reading what its layers
        hold); None for a device group's controller, whose ranks hold the weights."""

    def reset_streams(self) -> None:
        """After a failed step: bring the runner back to a state the next step can use."""

    def close(self) -> None:
        """Release the weights' streams, worker processes and shared memory."""
