"""The engine step: `scheduler.schedule()` -> `runner.run(batch)` -> `scheduler.update()`,
plus what turns requests into outputs (validation, stop strings, detokenization)."""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

from fusegen.engine.block_manager import BlockManager
from fusegen.engine.config import EngineConfig
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.detokenizer import IncrementalDetokenizer, detokenize
from fusegen.engine.outputs import RequestOutput
from fusegen.engine.request import Request
from fusegen.engine.runner import ModelRunner
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.scheduler import Scheduler
from fusegen.engine.tokenizer import Tokenizer

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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = _load_tokenizer(config.model)
        self.eos_token_ids = frozenset(_eos_token_ids(config, self.tokenizer))
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          self.runner.num_host_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.vocab_size

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
        return request

    def _prompt_ids(self, prompt) -> tuple[list[int] | None, str | None]:
        if isinstance(prompt, str):
            if not prompt:
                return None, "empty_prompt: the prompt is an empty string"
            return self.tokenizer.encode(prompt), None
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
        if request.params.stop:
            self._detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.params.stop)
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
        finished += self._check_stop_strings(batch.requests, sampled)
        stats = self.stats
        stats.num_steps += 1
        stats.num_running_sum += len(batch)
        stats.num_scheduled_tokens += batch.num_tokens
        stats.num_generated_tokens += sum(t is not None for t in sampled)
        stats.num_preemptions += batch.num_preempted
        stats.num_swapped_blocks += len(batch.swap_out)
        stats.num_finished += len(finished)
        elapsed = time.perf_counter() - start
        stats.step_seconds += elapsed
        if batch.num_tokens == len(batch):
            stats.num_decode_steps += 1
            stats.decode_seconds += elapsed
            stats.decode_batch_sum += len(batch)
        return [self._output(req) for req in finished]

    def _check_stop_strings(self, requests, sampled) -> list[Request]:
        stopped = []
        for req, token in zip(requests, sampled):
            detok = self._detokenizers.get(req.request_id)
            if token is None or detok is None or detok.stopped:
                continue
            if detok.add([token]):
                if req.is_finished:
                    req.finish_reason = "stop"  # the stop string came with its last token
                else:
                    stopped.append(req)
        if stopped:
            self.scheduler.finish(stopped, "stop")
        return stopped

    def abort_all(self, reason: str = "error") -> list[Request]:
        """Drop every unfinished request (after a failed step); returns them."""
        sched = self.scheduler
        dropped = list(sched.running) + list(sched.waiting) + list(sched.swapped)
        self.scheduler.finish(dropped, reason)
        for req in dropped:
            self._detokenizers.pop(req.request_id, None)
            self.runner.release(req.request_id)
        self.runner.reset_streams()
        return dropped

    def memory_report(self) -> dict:
        return self.runner.memory_report()

    def close(self) -> None:
        self.runner.close()

    def _output(self, req: Request) -> RequestOutput:
        self.runner.release(req.request_id)
        detok = self._detokenizers.pop(req.request_id, None)
        output_ids = req.output_token_ids
        text = detok.text if detok is not None else \
            detokenize(self.tokenizer, req.prompt_token_ids, output_ids)
        return RequestOutput(req.request_id, text, output_ids, req.finish_reason,
                             req.num_prompt_tokens)


def _load_tokenizer(model_dir: str) -> Tokenizer:
    try:
        return Tokenizer.from_dir(model_dir)
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
