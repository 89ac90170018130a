"""The engine step: `scheduler.schedule()` -> `runner.submit(batch)` ... `runner.collect()`
-> `scheduler.update()`, plus what turns prompts into requests (validation) and finished
requests into outputs.

Asynchronous scheduling (the `async_scheduling` option; vLLM v1's async scheduler,
SGLang's overlap scheduler): while the runner computes step N, the engine schedules
step N+1 and submits it (its inputs built, each request's next input id the
placeholder the runner fills from step N's sampled ids), then collects step N and turns
its tokens into outputs; the scheduler sees step N's tokens one step late. A request
that stops at step N (eos, a stop token or string) has run one token more, which is
discarded; one that reaches max_tokens does not (its limit is known ahead). Requests
whose sampling needs the host's per-token decisions first - structured output (the
grammar's mask), logits processors (penalties, min_tokens, bad_words, logit_bias) and
logprobs / prompt logprobs (written into the request by the step) - wait for their
token: each of their steps is scheduled after the last one's tokens are back, while
the rest of the batch goes on. The tokens are those of the synchronous loop (tests/
test_async_scheduling.py); unseeded sampling draws from the engine's generator, which
discarded tokens advance too. Unset (None) it is off until a measurement shows a gain
(`_async_scheduling`). Device groups keep their own batches in flight (pipeline stages)
and never use it."""
from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import deque
import json
import time
from dataclasses import dataclass
from pathlib import Path

from fusegen.engine.split_blocks import make_block_manager
from fusegen.engine.config import EngineConfig
from fusegen.engine.errors import EngineConfigError, ModelLoadError
from fusegen.engine.detokenizer import IncrementalDetokenizer
from fusegen.engine.models.rope import recompute_length
from fusegen.engine.outputs import RequestOutput
from fusegen.engine.request import Request, RequestGroup
from fusegen.engine.parallel.parallel_runner import make_runner
from fusegen.engine.runner_api import Runner
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.scheduler import ScheduledBatch, Scheduler
from fusegen.engine.logits_processors import bad_words_token_ids, vocabulary_problem
from fusegen.engine.structured import StructuredCompiler
from fusegen.engine.tokenizer import PromptError, PromptLimit, Tokenizer, prompt_problem
from fusegen.engine.weights.gguf_names import is_gguf
from fusegen.engine.weights.hub import resolve_model

Prompt = str | list[int]


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_running_sum: int = 0  # sum over steps of the requests in the batch
    num_scheduled_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_swapped_blocks: int = 0  # KV blocks copied to the host pool
    num_finished: int = 0
    step_seconds: float = 0.0
    num_decode_steps: int = 0  # steps with one token per request (no prefill)
    decode_seconds: float = 0.0
    decode_batch_sum: int = 0  # sum over decode steps of their batch size
    prompt_tokens_cached: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (recompute too)

    def as_dict(self, max_num_seqs: int) -> dict:
        steps = max(self.num_steps, 1)
        return {
            "num_steps": self.num_steps,
            "mean_running": self.num_running_sum / steps,
            "max_num_seqs": max_num_seqs,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_preemptions": self.num_preemptions,
            "num_swapped_blocks": self.num_swapped_blocks,
            "num_finished": self.num_finished,
            "step_seconds": self.step_seconds,
            "num_decode_steps": self.num_decode_steps,
            "decode_seconds": self.decode_seconds,
            "mean_decode_batch": self.decode_batch_sum / max(self.num_decode_steps, 1),
            "prompt_tokens_cached": self.prompt_tokens_cached,
            "prompt_tokens_computed": self.prompt_tokens_computed,
        }

    def record(self, batch: ScheduledBatch, sampled: list[int | None],
               finished: list[Request], seconds: float) -> None:
        """Count one step that ran `batch` in `seconds`; its generated tokens are those
        `update` appended (`sampled` less the discarded ones)."""
        self.num_steps += 1
        self.num_running_sum += len(batch)
        self.num_scheduled_tokens += batch.num_tokens
        self.num_generated_tokens += batch.num_generated
        self.num_preemptions += batch.num_preempted
        self.num_swapped_blocks += len(batch.swap_out)
        self.num_finished += len(finished)
        self.step_seconds += seconds
        self.prompt_tokens_cached += batch.num_cached_tokens
        self.prompt_tokens_computed += batch.num_prompt_tokens
        if batch.num_tokens == len(batch):
            self.num_decode_steps += 1
            self.decode_seconds += seconds
            self.decode_batch_sum += len(batch)


# as_dict's means, each over a step count; every other number is a running total.
_MEANS = {"mean_running": "num_steps", "mean_decode_batch": "num_decode_steps"}


def stats_since(before: dict, after: dict) -> dict:
    """The counters of `after` (an `EngineStats.as_dict`) less those of `before`, taken
    earlier from the same engine: what it did in between, its means over those steps."""
    delta = {key: value - before.get(key, 0) if isinstance(value, (int, float))
             and key not in _MEANS and key != "max_num_seqs" else value
             for key, value in after.items()}
    for key, steps in _MEANS.items():
        if key in after and steps in after:
            total = after[key] * after[steps] - before.get(key, 0) * before.get(steps, 0)
            delta[key] = total / delta[steps] if delta[steps] else 0.0
    return delta


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = _load_tokenizer(config)
        self.eos_token_ids = frozenset(_eos_token_ids(config, self.tokenizer))
        self.runner: Runner = make_runner(config)
        recompute_at = recompute_length(config.model_config, config.max_model_len)
        # LongRoPE's keys depend on the whole request's length, not on the prefix alone
        caching = config.options.enable_prefix_caching and not recompute_at \
            and not self.runner.uses_request_lengths
        self.block_manager = make_block_manager(
            config.kv_split, self.runner.num_blocks, config.block_size,
            self.runner.num_host_blocks, caching,
            cache_salt=f"{config.model}|{config.options.revision}|{config.torch_dtype}|"
                       f"{config.block_size}")
        self.async_scheduling = _async_scheduling(config, self.runner, recompute_at)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   recompute_at, overlap=self.async_scheduling)
        self.stats = EngineStats()
        # batches submitted and not collected, oldest first, with their submit times
        self._in_flight: deque[tuple[ScheduledBatch, float]] = deque()
        # at most this many in flight: the runner's (a pipeline's stage count); 1 makes
        # a pipeline blocking, as a baseline to measure the stages' idle time against;
        # 2 with asynchronous scheduling (the step running and the next)
        self.max_in_flight = 2 if self.async_scheduling else self.runner.max_in_flight
        self._last_collect = 0.0  # when the last step's tokens came back
        if self.async_scheduling:
            self.runner.overlap_steps()
        self._ids = itertools.count()
        self.structured = StructuredCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        # chat templates stop rendering past what could fit the context (engine used alone
        # too, not only through LLM)
        self.tokenizer.prompt_limit = self.prompt_limit

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.vocab_size

    @functools.cached_property
    def prompt_limit(self) -> PromptLimit:
        """The most bytes of text that could fit the context, checked before tokenizing."""
        return PromptLimit(self.config.max_model_len, self.tokenizer.max_token_bytes)

    def make_request(self, prompt: Prompt, params: SamplingParams
                     ) -> list[Request] | RequestOutput:
        """A prompt's validated requests (n of them, one per completion), or a finished
        error output for a bad prompt (one, whatever its n). Tokenizes, so call it from
        the producer's thread, not the step loop."""
        request_id = next(self._ids)
        text = prompt if isinstance(prompt, str) else None
        prompt_ids, error = self._prompt_ids(prompt)
        if error is None:
            problem = params.validate() if isinstance(params, SamplingParams) else \
                f"expected SamplingParams, got {type(params).__name__}"
            error = problem and f"invalid_params: {problem}"
        if error is None and len(prompt_ids) >= self.config.max_model_len:
            error = (f"prompt_too_long: the prompt has {len(prompt_ids)} tokens; the context "
                     f"limit is {self.config.max_model_len} (max_model_len) and at least one "
                     "token must be generated")
        if error is None:
            problem = self.scheduler.check_fits(
                Request(request_id, prompt_ids, params, self.eos_token_ids))
            error = problem and f"kv_cache_too_small: {problem}"
        if error is None:
            problem = vocabulary_problem(params, self.vocab_size)
            error = problem and f"invalid_params: {problem}"
        if error is None and params.prompt_logprobs is not None \
                and not self.runner.supports_prompt_logprobs:
            error = ("invalid_params: prompt_logprobs needs every prompt row's logits, which "
                     "a device group (tensor_parallel_size x pipeline_parallel_size > 1) "
                     "does not return; run without it, or on one device")
        if error is None:  # compiled once per distinct constraint, copied per request
            structured, error = self.structured.state_for(params)
        if error is not None:
            return RequestOutput.failed(request_id, error, text, prompt_ids)
        n = params.n
        try:  # bad_words are tokenized here
            if n == 1:
                return [self._request(request_id, text, prompt_ids, params, structured)]
            group = RequestGroup(request_id, n)
            return [self._request(next(self._ids), text, prompt_ids, _child_params(params, i),
                                  structured if i == 0 else self.structured.state_for(params)[0],
                                  group, i) for i in range(n)]
        except PromptError as exc:
            return RequestOutput.failed(request_id, f"{exc.code}: bad_words: {exc}", text,
                                        prompt_ids)

    def _request(self, request_id: int, text: str | None, prompt_ids: list[int],
                 params: SamplingParams, structured, group: RequestGroup | None = None,
                 index: int = 0) -> Request:
        request = Request(request_id, prompt_ids, params, self.eos_token_ids, prompt=text,
                          group=group, index=index)
        if params.stop:  # it decodes the prompt's tail: here, off the step loop
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                params.include_stop_str_in_output)
        if params.bad_words:  # tokenized here, once, off the step loop
            request.bad_words_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        if structured is not None:
            request.structured, request.structured_valid = structured, False
        return request

    def error_output(self, error: str) -> RequestOutput:
        """A finished error output, under a fresh id, for a request that could not even
        be made (`LLM.chat`: a conversation its chat template refuses)."""
        return RequestOutput.failed(next(self._ids), error)

    def _prompt_ids(self, prompt) -> tuple[list[int] | None, str | None]:
        if isinstance(prompt, str):
            if not prompt:
                return None, "empty_prompt: the prompt is an empty string"
            problem = prompt_problem(prompt, self.prompt_limit)
            if problem:
                return None, problem
            try:
                return self.tokenizer.encode(prompt), None
            except PromptError as exc:  # the tokenizer failed on this text: its error
                return None, f"{exc.code}: {exc}"
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                return None, "empty_prompt: the prompt has no token ids"
            bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)
                        or not 0 <= t < self.vocab_size), None)
            if bad is not None:
                return None, (f"token_out_of_vocab: token id {bad!r} is outside the "
                              f"vocabulary [0, {self.vocab_size})")
            return list(prompt), None
        return None, ("invalid_prompt: a prompt must be a string, a list of token ids, or a "
                      f"dict with \"prompt\" or \"prompt_token_ids\", got {_kind(prompt)}")

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        """Schedule and submit batches while fewer than the runner takes are in flight
        (one, or a pipeline's stage count: EnergonAI's non-blocking pipeline, where no
        stage waits for the controller), then collect the oldest and advance its
        requests."""
        # in flight, each batch takes its share of the requests (and of max_num_seqs)
        share = None if self.max_in_flight == 1 or self.async_scheduling else -(-min(
            self.scheduler.num_unfinished, self.scheduler.max_num_seqs) // self.max_in_flight)
        while len(self._in_flight) < self.max_in_flight:
            batch = self.scheduler.schedule(share)
            if not batch:
                break
            for req in batch.requests:
                req.num_in_flight += 1
            self._in_flight.append((batch, time.perf_counter()))
            self.runner.submit(batch)  # takes the batch's inputs now
            if self.async_scheduling:
                self.scheduler.advance(batch)
        if not self._in_flight:
            return []
        batch, start = self._in_flight[0]
        sampled = self.runner.collect()
        self._in_flight.popleft()
        finished = self.scheduler.update(batch, sampled)
        now = time.perf_counter()
        # overlapped steps: a step's time is from the last one's tokens to its own
        seconds = now - (max(start, self._last_collect) if self.async_scheduling else start)
        self._last_collect = now
        self.stats.record(batch, sampled, finished, seconds)
        return self._outputs(finished)

    def _outputs(self, finished: list[Request]) -> list[RequestOutput]:
        """One output per finished prompt: a prompt of n > 1 completions once all n are."""
        outputs = []
        for req in finished:
            if req.group is None:
                outputs.append(RequestOutput.from_request(req, self.tokenizer))
            elif req.group.add(req):
                outputs.append(RequestOutput.from_requests(
                    req.group.request_id, req.group.finished, self.tokenizer))
        return outputs

    def abort(self, request_ids: set[int]) -> list[Request]:
        """Drop the unfinished requests of these outputs (their callers gave up; all n of
        a prompt's) between steps; returns those found, with finish_reason "abort" and
        their KV blocks freed."""
        dropped = [r for r in self._unfinished() if r.output_id in request_ids]
        self.scheduler.finish(dropped, "abort")
        return dropped

    def abort_all(self, reason: str = "error") -> list[Request]:
        """Drop every unfinished request (after a failed step); returns them."""
        dropped = self._unfinished()
        for batch, _ in self._in_flight:  # their tokens will never come back
            for req in batch.requests:
                req.num_in_flight = 0
        self._in_flight.clear()
        self.scheduler.finish(dropped, reason)
        self.block_manager.reset_cache()  # the failed step may have half-written its blocks
        self.runner.reset_streams()
        return dropped

    def _unfinished(self) -> list[Request]:
        sched = self.scheduler
        return [*sched.running, *sched.waiting, *sched.swapped]

    def memory_report(self) -> dict:
        return self.runner.memory_report()

    def load(self) -> dict:
        """Running and waiting (swapped included) requests, the KV cache's used fraction
        and the tokens generated since the engine started (those of running requests
        included), read without a lock: a snapshot for a progress line, safe from any
        thread."""
        sched = self.scheduler
        blocks = sched.block_manager
        return {"running": len(sched.running), "waiting": len(sched.waiting) + len(sched.swapped),
                "kv_used": (blocks.num_blocks - blocks.num_free_blocks) / max(blocks.num_blocks, 1),
                "num_generated_tokens": self.stats.num_generated_tokens}

    def close(self) -> None:
        self.runner.close()


def _async_scheduling(config: EngineConfig, runner: Runner, recompute_at: int) -> bool:
    """The `async_scheduling` option resolved: None is off until a measurement shows a
    gain (its one GPU run, Llama-3-8B's shape with CUDA graphs on an H200, was slower
    than the synchronous loop's; the controller's Python and the worker thread's launches
    share one interpreter); True where it cannot run is an error naming why."""
    asked = config.options.async_scheduling
    why = None
    if not runner.supports_async_scheduling:
        why = ("a device group (tensor_parallel_size x pipeline_parallel_size > 1) keeps "
               "its own batches in flight")
    elif recompute_at or runner.uses_request_lengths:
        why = "the model's rotary factors follow each request's whole length (LongRoPE)"
    if asked is None:
        return False
    if asked and why is not None:
        raise EngineConfigError(f"async_scheduling=True cannot run here: {why}; leave it "
                                "unset or false")
    return asked


def _load_tokenizer(config: EngineConfig) -> Tokenizer:
    """The model's tokenizer, or the `tokenizer` option's (a path, or a hub id resolved
    like a model's), whose ids must all be rows of the model's embedding."""
    name = config.options.tokenizer
    try:
        path = config.model if name is None else resolve_model(name)
        tokenizer = Tokenizer.from_gguf(path) if is_gguf(path) else Tokenizer.from_dir(path)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure is the checkpoint's
        raise ModelLoadError(str(exc)) from exc
    vocab = config.model_config.vocab_size
    if name is not None and tokenizer.vocab_size > vocab:
        raise ModelLoadError(f"tokenizer {name} has ids up to {tokenizer.vocab_size - 1}, "
                             f"past the model's vocabulary of {vocab}; pass the tokenizer "
                             "the model was trained with")
    return tokenizer


def _eos_token_ids(config: EngineConfig, tokenizer: Tokenizer) -> list[int]:
    """generation_config.json decides, as in transformers; then config.json; then the
    tokenizer's own end-of-sequence token."""
    path = Path(config.model) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        if value is not None:
            return value if isinstance(value, list) else [value]
    return config.model_config.eos_token_ids or list(tokenizer.eos_token_ids)


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of a prompt: seeded with seed + index, so each completion is
    reproducible alone (vLLM's rule); unseeded ones draw from the engine's generator."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**64)


def _kind(prompt) -> str:
    return f"a dict with keys {sorted(map(str, prompt))}" if isinstance(prompt, dict) \
        else type(prompt).__name__
