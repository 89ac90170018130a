"""The engine step: `scheduler.schedule()` -> `runner.run(batch)` -> `scheduler.update()`,
plus what turns prompts into requests (validation) and finished requests into outputs."""
from __future__ import annotations

import functools
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

from fusegen.engine.block_manager import BlockManager
from fusegen.engine.config import EngineConfig
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.detokenizer import IncrementalDetokenizer
from fusegen.engine.models.rope import recompute_length
from fusegen.engine.outputs import RequestOutput
from fusegen.engine.request import Request
from fusegen.engine.runner import ModelRunner
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.scheduler import ScheduledBatch, Scheduler
from fusegen.engine.tokenizer import PromptLimit, Tokenizer, prompt_problem
from fusegen.engine.weights.gguf_names import is_gguf

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
        }

    def record(self, batch: ScheduledBatch, sampled: list[int | None],
               finished: list[Request], seconds: float) -> None:
        """Count one step that ran `batch` in `seconds`."""
        self.num_steps += 1
        self.num_running_sum += len(batch)
        self.num_scheduled_tokens += batch.num_tokens
        self.num_generated_tokens += sum(t is not None for t in sampled)
        self.num_preemptions += batch.num_preempted
        self.num_swapped_blocks += len(batch.swap_out)
        self.num_finished += len(finished)
        self.step_seconds += seconds
        if batch.num_tokens == len(batch):
            self.num_decode_steps += 1
            self.decode_seconds += seconds
            self.decode_batch_sum += len(batch)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = _load_tokenizer(config.model)
        self.eos_token_ids = frozenset(_eos_token_ids(config, self.tokenizer))
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          self.runner.num_host_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   recompute_length(config.model_config, config.max_model_len))
        self.stats = EngineStats()
        self._ids = itertools.count()

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.vocab_size

    @functools.cached_property
    def prompt_limit(self) -> PromptLimit:
        """The most bytes of text that could fit the context, checked before tokenizing."""
        return PromptLimit(self.config.max_model_len, self.tokenizer.max_token_bytes)

    def make_request(self, prompt: Prompt, params: SamplingParams) -> Request | RequestOutput:
        """A validated request, or a finished error output for a bad one. Tokenizes,
        so call it from the producer's thread, not the step loop."""
        request_id = next(self._ids)
        prompt_ids, error = self._prompt_ids(prompt)
        if error is None:
            problem = params.validate() if isinstance(params, SamplingParams) else \
                f"expected SamplingParams, got {type(params).__name__}"
            error = problem and f"invalid_params: {problem}"
        if error is None and len(prompt_ids) >= self.config.max_model_len:
            error = (f"prompt_too_long: the prompt has {len(prompt_ids)} tokens; the context "
                     f"limit is {self.config.max_model_len} (max_model_len) and at least one "
                     "token must be generated")
        if error is not None:
            return RequestOutput(request_id, "", [], "error", len(prompt_ids or []), error)
        request = Request(request_id, prompt_ids, params, self.eos_token_ids)
        problem = self.scheduler.check_fits(request)
        if problem:
            return RequestOutput(request_id, "", [], "error", len(prompt_ids),
                                 f"kv_cache_too_small: {problem}")
        if params.stop:  # it decodes the prompt's tail: here, off the step loop
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
        return request

    def error_output(self, error: str) -> RequestOutput:
        """A finished error output, under a fresh id, for a request that could not even
        be made (`LLM.chat`: a conversation its chat template refuses)."""
        return RequestOutput(next(self._ids), "", [], "error", 0, error)

    def _prompt_ids(self, prompt) -> tuple[list[int] | None, str | None]:
        if isinstance(prompt, str):
            if not prompt:
                return None, "empty_prompt: the prompt is an empty string"
            problem = prompt_problem(prompt, self.prompt_limit)
            return (None, problem) if problem else (self.tokenizer.encode(prompt), None)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                return None, "empty_prompt: the prompt has no token ids"
            bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)
                        or not 0 <= t < self.vocab_size), None)
            if bad is not None:
                return None, (f"token_out_of_vocab: token id {bad!r} is outside the "
                              f"vocabulary [0, {self.vocab_size})")
            return list(prompt), None
        return None, (f"invalid_prompt: a prompt must be a string or a list of token ids, "
                      f"got {type(prompt).__name__}")

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        start = time.perf_counter()
        sampled = self.runner.run(batch)
        finished = self.scheduler.update(batch, sampled)
        self.stats.record(batch, sampled, finished, time.perf_counter() - start)
        return [RequestOutput.from_request(req, self.tokenizer) for req in finished]

    def abort(self, request_ids: set[int]) -> list[Request]:
        """Drop these unfinished requests (their callers gave up) between steps; returns
        those found, with finish_reason "abort" and their KV blocks freed."""
        dropped = [r for r in self._unfinished() if r.request_id in request_ids]
        self.scheduler.finish(dropped, "abort")
        return dropped

    def abort_all(self, reason: str = "error") -> list[Request]:
        """Drop every unfinished request (after a failed step); returns them."""
        dropped = self._unfinished()
        self.scheduler.finish(dropped, reason)
        self.runner.reset_streams()
        return dropped

    def _unfinished(self) -> list[Request]:
        sched = self.scheduler
        return [*sched.running, *sched.waiting, *sched.swapped]

    def memory_report(self) -> dict:
        return self.runner.memory_report()

    def close(self) -> None:
        self.runner.close()


def _load_tokenizer(model: str) -> Tokenizer:
    try:
        return Tokenizer.from_gguf(model) if is_gguf(model) else Tokenizer.from_dir(model)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure is the checkpoint's
        raise ModelLoadError(str(exc)) from exc


def _eos_token_ids(config: EngineConfig, tokenizer: Tokenizer) -> list[int]:
    """generation_config.json decides, as in transformers; then config.json; then the
    tokenizer's own end-of-sequence token."""
    path = Path(config.model) / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        if value is not None:
            return value if isinstance(value, list) else [value]
    return config.model_config.eos_token_ids or list(tokenizer.eos_token_ids)
