"""One request's state: plain integers and lists, no tensors.

What else belongs to one request hangs off it, so it leaves with the request and
nothing is keyed by request id elsewhere: its incremental detokenizer (only when it
has stop strings) and its seeded sampling generator (made by the sampler on its
first draw).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusegen.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler and block manager import this module: no torch here
    import torch

    from fusegen.engine.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; also a preempted request waiting to be recomputed
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks copied to the host pool
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    # Tokens whose keys and values are in the KV cache. Prefill, chunked prefill,
    # decode and recompute after preemption are all "compute num_tokens -
    # num_computed_tokens more tokens".
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)  # device KV block ids, in order
    host_block_table: list[int] = field(default_factory=list)  # while swapped out
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Matches stop strings token by token; None without stop strings, so those
    # requests never decode during a step.
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None  # seeded, non-greedy requests; set by the sampler

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, max_model_len: int) -> str | None:
        """Append a sampled token; why the request must stop now ("stop" or "length"),
        or None to go on. The one place a request decides that it is done."""
        self.token_ids.append(token_id)
        # A stop string completed by the last token allowed still ends with "stop".
        if self.detokenizer is not None and self.detokenizer.add_token(token_id):
            return "stop"
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in self.params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
