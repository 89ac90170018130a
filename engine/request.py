"""One request's state: plain integers and lists, no tensors.

What else belongs to one request hangs off it, so it leaves with the request and
nothing is keyed by request id elsewhere: its incremental detokenizer (only when it
has stop strings) and its seeded sampling generator (made by the sampler on its
first draw).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fusegen.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler and block manager import this module: no torch here
    import torch

    from fusegen.engine.detokenizer import IncrementalDetokenizer
    from fusegen.engine.structured import StructuredState


# A sampled token not yet back from the device (asynchronous scheduling); never a
# vocabulary id, so no prefix-cache key holding it matches real tokens.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; also a preempted request waiting to be recomputed
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks copied to the host pool
    FINISHED = "finished"


@dataclass(slots=True)
class Logprob:
    """One token's entry at one position (vLLM's shape; engine/logprobs.py fills them)."""
    logprob: float
    rank: int | None = None  # 1-based place among the vocabulary, most likely first
    decoded_token: str | None = None  # the token's text, filled when the output is made


class ProcessorState(Protocol):
    """What the logits processors keep for one request across steps
    (engine/logits_processors.py's `LogitsState`, which imports this module, not the
    other way round): brought up to date with the request's generated tokens before
    each use."""

    def catch_up(self, request: Request) -> None: ...


@dataclass(slots=True, eq=False)
class RequestGroup:
    """The n requests of one prompt (n > 1): the id its one output carries, and those
    finished so far. Held by the requests alone, so an aborted group leaves with them."""
    request_id: int
    n: int
    finished: list[Request] = field(default_factory=list)

    def add(self, request: Request) -> bool:
        """Record a finished request; True once all n have finished."""
        self.finished.append(request)
        return len(self.finished) == self.n


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
    # Prompt tokens whose KV blocks came from the prefix cache when first admitted.
    num_cached_tokens: int = 0
    # Matches stop strings token by token; None without stop strings, so those
    # requests never decode during a step.
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None  # seeded, non-greedy requests; set by the sampler
    prompt: str | None = None  # the prompt's text as given; None for token ids
    # n > 1: the prompt's n requests share one group (its output's id, the finished ones);
    # `index` is this one's completion index. None and 0 for a single completion.
    group: RequestGroup | None = None
    index: int = 0
    # Structured output: the request's grammar matcher, advanced on each generated token
    # only (so it survives preemption and recompute), and whether the output completed the
    # grammar (False until it does); both None for an unconstrained request.
    structured: StructuredState | None = None
    structured_valid: bool | None = None
    # "code: message" when it ended with finish_reason "error" (its grammar engine gave up)
    error: str | None = None
    # Its sampling row needs the logits processors or logprobs (set from params): rows
    # without it cost the sampler nothing.
    processed: bool = False
    bad_words_ids: list[list[int]] = field(default_factory=list)  # set when the request is made
    # What the processors keep across steps (token counts for the penalties, logit_bias
    # as tensors), made on the row's first processing by engine/logits_processors.py.
    logits_state: ProcessorState | None = None
    # With params.logprobs: one dict per generated token (the sampled token and the top-k),
    # and the sum of the sampled tokens' logprobs. With params.prompt_logprobs: one per
    # prompt token, the first None (nothing predicts it), filled chunk by chunk.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Batches holding it that were submitted and not yet collected. A pipeline's
    # (engine/parallel) request is in one at most: the scheduler neither schedules it
    # again nor preempts it until its tokens are back. Under asynchronous scheduling it
    # may be in two: the one running and the next, whose input is the running one's
    # sampled token (a PLACEHOLDER at the end of `token_ids` until it arrives).
    num_in_flight: int = 0
    num_placeholders: int = 0  # PLACEHOLDER tokens ending `token_ids`

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        params = self.params
        self.processed = params.needs_logits_processing
        if params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def in_flight(self) -> bool:
        return self.num_in_flight > 0

    @property
    def overlaps(self) -> bool:
        """Whether its next step may be scheduled before its last sampled token is back
        (asynchronous scheduling): only rows whose sampling reads nothing the host
        decides per token. Structured output's mask needs the grammar advanced by the
        last token; the penalties read the generated tokens and min_tokens their count;
        bad_words the last tokens; logprobs and prompt logprobs are written into the
        request by the step that computes them. Those requests wait for their token."""
        return self.structured is None and not self.processed \
            and self.prompt_logprobs is None

    def at_limit(self, max_model_len: int) -> bool:
        """Whether the tokens sampled so far (placeholders included) reach max_tokens or
        max_model_len: the last of them ends it ("length"), so a next step would only
        make a token to discard."""
        return self.num_output_tokens >= self.params.max_tokens \
            or self.num_tokens >= max_model_len

    def add_placeholder(self) -> None:
        """The step just submitted samples this request's next token: it stands in
        `token_ids` until `fill_placeholder`."""
        self.token_ids.append(PLACEHOLDER)
        self.num_placeholders += 1

    def fill_placeholder(self, token_id: int, max_model_len: int) -> str | None:
        """The oldest placeholder's token arrived: `append_token` in its place (the ones
        after it stay behind it, unless the request stops: then they are dropped, their
        tokens discarded)."""
        count = self.num_placeholders
        del self.token_ids[-count:]
        self.num_placeholders = 0
        reason = self.append_token(token_id, max_model_len)
        if reason is None:
            self.token_ids += [PLACEHOLDER] * (count - 1)
            self.num_placeholders = count - 1
        return reason

    def drop_placeholders(self) -> None:
        """Its in-flight tokens will never be used (preempted, aborted)."""
        if self.num_placeholders:
            del self.token_ids[-self.num_placeholders:]
            self.num_placeholders = 0

    @property
    def output_id(self) -> int:
        """The id of the output this request's completion goes into (its group's, n > 1)."""
        return self.request_id if self.group is None else self.group.request_id

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
        """Append a sampled token; why the request must stop now ("stop", "length", or
        "error" with `error` set), or None to go on. The one place a request decides
        that it is done."""
        if self.structured is not None and self.structured.problem is not None:
            self.error = self.structured.problem  # the token drawn is none the grammar allows
            return "error"
        self.token_ids.append(token_id)
        grammar_done = self.structured is not None and self.structured.accept(token_id)
        if grammar_done and (error := self.structured.error) is not None:
            self.error = error  # a failed matcher is stopped too: never a complete output
            return "error"
        # A stop string completed by the last token allowed still ends with "stop".
        if self.detokenizer is not None and self.detokenizer.add_token(token_id):
            return "stop"  # the text is cut at the stop string: structured_valid stays False
        if grammar_done:  # nothing more may follow
            self.structured_valid = self.structured.complete
            return "stop"
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in self.params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None
