"""`LLM`: the Python API. A background thread builds the engine and runs its step loop;
any number of producer threads `submit()` requests into the one running batch, and each
future resolves as soon as its request finishes."""
from __future__ import annotations

import functools
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait

from tqdm import tqdm

from fusegen.engine.config import EngineConfig
from fusegen.engine.llm_engine import LLMEngine, Prompt
from fusegen.engine.options import EngineOptions, describe, describe_vllm
from fusegen.engine.outputs import RequestOutput
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.tokenizer import PromptError, PromptLimit, Tokenizer, messages_problem
from fusegen.kernels.openmp import mark_engine_thread, release_thread_team

# Prompts `generate` keeps submitted and unfinished, per request a step runs at most:
# enough that every step finds a full batch waiting, few enough that an iterable of
# millions of prompts is never held (nor tokenized) whole.
_IN_FLIGHT_PER_SEQ = 4


class LLM:
    def __init__(self, model: str, **options):
        """`model`: a Hugging Face checkpoint directory, a .gguf file, or a hub id
        (`org/name`, resolved through the Hugging Face cache, downloaded when missing and
        the machine can; `revision=` pins it). `options`: the fields of `EngineOptions`
        (listed below), or vLLM's `gpu_memory_utilization` (read as `device_memory`) and
        `tensor_parallel_size=1`; `quantization` takes vLLM's keyword: None (the
        checkpoint's own form: a fusegen int8/int4 checkpoint runs compressed, a .gguf
        file keeps its blocks where the device has a kernel for their type, a Hugging Face
        FP8 checkpoint runs in FP8 on GPUs of capability 8.9+), "dequantize", "gguf",
        "int8" / "int4" (a 16-bit checkpoint quantized on load: round to nearest,
        symmetric, groups of 128) or "fp8" (CUDA, capability 8.9+), each checked against the model and the device before
        anything loads; a name fusegen does not support (`trust_remote_code=True`,
        `enable_lora`, any other) is an error that names it."""
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._futures: dict[int, Future] = {}
        self._aborts: set[int] = set()  # ids of cancelled requests, dropped before the next step
        self._closed = False
        self._close_error: BaseException | None = None
        # The engine is built on the thread that will step it, so that every OpenMP
        # parallel region of the engine (weight packing, the `auto` dtype probe, the
        # steps) runs on one thread: each thread that opens one gets a team of its own,
        # and with two teams libgomp counts more threads than cores and lets waiting
        # threads sleep after ~100 spins, so every region of a step pays their wake-up
        # (2.7 ms of a 29.5 ms decode step, docs/performance.md). The caller's thread
        # is the other one that may hold a team (any parallel torch op it ran before,
        # or runs between calls): `_release_caller_team` frees it where work is handed
        # over, once the engine is built and on every submit.
        built: Future = Future()
        # "cuda" names the caller's current GPU; the engine's thread starts on cuda:0.
        self._caller_gpu = _current_gpu()
        self._thread = threading.Thread(target=self._run, args=(model, options, built),
                                        name="fusegen-engine", daemon=True)
        self._thread.start()
        try:
            self.config, self.engine = built.result()
        except BaseException:  # a bad option, a missing model, or Ctrl-C while loading
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            raise
        self.tokenizer = self.engine.tokenizer  # its prompt limit set by the engine
        self._release_caller_team()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def prompt_limit(self) -> PromptLimit:
        """The most bytes of text a prompt can have; longer ones fail before tokenizing."""
        return self.engine.prompt_limit

    def stats(self) -> dict:
        return self.engine.stats.as_dict(self.config.max_num_seqs)

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer prompts are encoded with (vLLM's `LLM.get_tokenizer`): `encode`,
        `decode`, `apply_chat_template(messages, tokenize=False,
        add_generation_prompt=True)` for a conversation's prompt text, `eos_token_ids`."""
        return self.tokenizer

    def memory_report(self) -> dict:
        """Bytes per memory tier (device, host, disk) for weights and KV cache, the
        budgets, and the device peak."""
        return self.engine.memory_report()

    def engine_load(self) -> dict:
        """Running and waiting requests, the KV cache's used fraction and the tokens
        generated so far (running requests' included): a snapshot, read without a lock,
        for a progress line."""
        return self.engine.load()

    @property
    def placement(self):
        """The placement plan (engine.memory.placement.PlacementPlan); `.table()` prints it."""
        return self.config.placement

    def generate(self, prompts: Iterable[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True) -> list[RequestOutput]:
        """One output per prompt, in input order, as vLLM's `LLM.generate`: a prompt is a
        string, a list of token ids, or a dict with "prompt" or "prompt_token_ids";
        `prompts` one of them or any iterable of them (a generator included: it is read
        as the engine takes prompts, a few batches ahead, never whole); `sampling_params`
        one for all or one per prompt (each with its `n` completions in
        `output.outputs`); `use_tqdm`: a progress bar of finished prompts on stderr (or a
        tqdm-like class to draw it). A bad prompt gives an output with finish_reason
        "error"; it never fails the others. Interrupted (Ctrl-C), it drops its requests
        from the engine before it raises; other callers' go on."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        total = len(prompts) if hasattr(prompts, "__len__") else None
        pairs = _paired(prompts, sampling_params, total, "prompts")
        in_flight = _IN_FLIGHT_PER_SEQ * self.config.max_num_seqs
        with _Progress(use_tqdm, total) as progress:
            return self._stream(pairs, in_flight, progress)

    def _stream(self, pairs: Iterator[tuple[Prompt, SamplingParams]], in_flight: int,
                progress: _Progress) -> list[RequestOutput]:
        """Submit `pairs` as earlier ones finish, `in_flight` prompts unfinished at most;
        the outputs in input order."""
        futures: list[Future] = []
        pending: set[Future] = set()
        try:
            while True:
                batch = [(_prompt_of(p), params) for p, params in
                         itertools.islice(pairs, in_flight - len(pending))]
                submitted = self.submit_many(batch) if batch else []
                futures += submitted
                pending.update(submitted)
                if not pending:
                    return [f.result() for f in futures]
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                progress.advance(done)
        except BaseException:  # KeyboardInterrupt above all: nobody waits for the rest
            self._cancel(list(pending))
            raise

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or
        a list of them, each written out by the model's chat template (or
        `chat_template`, a Jinja source) and tokenized as transformers'
        `apply_chat_template(..., tokenize=True)` does. Outputs in input order; a
        conversation that is malformed or that the template refuses gives an output with
        finish_reason "error", as a bad prompt does in `generate()`, whose
        `sampling_params` and `use_tqdm` these are."""
        conversations = [messages] if messages and isinstance(messages[0], dict) \
            else messages
        if chat_template is None and not self.tokenizer.chat_template:
            raise ValueError(
                f"{self.config.model_name} has no chat template (no "
                f"{self.tokenizer.template_key} in its {self.tokenizer.template_home}): pass "
                "one, llm.chat(conversations, chat_template=\"{% for "
                "m in messages %}...{% endfor %}\"), or use generate() with plain prompts")
        params = _params_per_prompt(sampling_params, len(conversations), "conversations")
        prompts = [self._chat_prompt(c, add_generation_prompt, chat_template)
                   for c in conversations]
        valid = [i for i, p in enumerate(prompts) if not isinstance(p, RequestOutput)]
        outputs = self.generate([prompts[i][1] for i in valid], [params[i] for i in valid],
                                use_tqdm) if valid else []
        for i, output in zip(valid, outputs):
            output.prompt = prompts[i][0]  # vLLM's: the conversation as the template wrote it
            prompts[i] = output
        return prompts

    def _chat_prompt(self, messages, add_generation_prompt: bool, chat_template: str | None
                     ) -> tuple[str, list[int]] | RequestOutput:
        """The conversation written out by the template and its ids (`chat_prompt`'s),
        or an error output saying why there are none."""
        problem = messages_problem(messages)
        if problem:
            return self.engine.error_output(f"invalid_prompt: a conversation {problem}")
        too_long = self.prompt_limit.conversation_too_long(messages)
        if too_long:  # before the template renders it and the tokenizer encodes it
            return self.engine.error_output(too_long)
        try:
            return self.tokenizer.chat_prompt(messages, add_generation_prompt, chat_template)
        except PromptError as exc:  # its text is too long, or the tokenizer failed on it
            return self.engine.error_output(f"{exc.code}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the template's refusal is this request's
            return self.engine.error_output(
                f"invalid_prompt: the chat template failed: {type(exc).__name__}: {exc}")

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> Future:
        """Thread-safe. The future resolves to the prompt's RequestOutput (all of its n
        completions); cancelling it drops its requests from the engine."""
        return self.submit_many([(prompt, params)])[0]

    def submit_many(self, requests: Sequence[tuple[Prompt, SamplingParams | None]]
                    ) -> list[Future]:
        """Thread-safe; the requests join the running batch in the same step."""
        # generate(), chat() and submit() hand their work over here; so do the jobs'
        # workers and the OpenAI-batch path, whose threads then wait on the futures
        self._release_caller_team()
        futures, items = [], []
        for prompt, params in requests:
            future: Future = Future()
            made = self.engine.make_request(prompt, params or SamplingParams())
            if isinstance(made, RequestOutput):
                future.set_result(made)
            else:  # the prompt's n requests, all resolving this one future
                items.append((made, future))
            futures.append(future)
        with self._cond:
            if self._closed:
                raise RuntimeError("this LLM is closed")
            for made, future in items:
                output_id = made[0].output_id
                self._futures[output_id] = future
                self._inbox.extend(made)
                future.add_done_callback(functools.partial(self._on_done, output_id))
            self._cond.notify()
        return futures

    def _release_caller_team(self) -> None:
        """Free the calling thread's OpenMP team where the engine runs the C kernels on
        this machine's cores (`kernels/openmp.py`): left idle, it makes libgomp count
        more threads than cores, and the engine's own workers then sleep between its
        parallel regions, each region of a step waiting for them to wake up."""
        if self.config.device == "cpu":
            release_thread_team()

    def _run(self, model: str, options: dict, built: Future) -> None:
        """The engine's thread: build the engine, hand it over, then step it."""
        mark_engine_thread()
        try:
            config = EngineConfig.build(model, EngineOptions.from_kwargs(options))
            gpu = engine_gpu(config.device, self._caller_gpu)
            if gpu is not None:
                # Kernels launch on the calling thread's current device: this engine's
                # own, which is not cuda:0 for a job worker given another GPU.
                import torch

                torch.cuda.set_device(gpu)
            engine = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 - raised in the constructor's caller
            built.set_exception(exc)
            return
        built.set_result((config, engine))
        with self._cond:  # the caller gave up while the model loaded
            abandoned = self._closed
        try:
            if not abandoned:
                self._loop(engine)
        finally:
            # Closed from this thread: a device group's ranks die with the thread that
            # started them (PR_SET_PDEATHSIG, engine/parallel/worker.py), so the group
            # is stopped before this thread ends, not killed by its end.
            try:
                engine.close()
            except BaseException as exc:  # noqa: BLE001 - raised by close()
                self._close_error = exc

    def _loop(self, engine: LLMEngine) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._aborts or engine.has_unfinished()
                           or self._closed):
                    self._cond.wait()
                if self._closed:
                    break
                self._drop_cancelled()
                while self._inbox:
                    engine.add(self._inbox.popleft())
            try:
                outputs = engine.step()
            except BaseException as exc:  # noqa: BLE001 - delivered to every waiter
                self._fail(engine.abort_all(), exc)
                continue
            if outputs:
                with self._cond:
                    done = [(self._futures.pop(o.request_id, None), o) for o in outputs]
                for future, output in done:
                    _resolve(future, output)
        self._fail(engine.abort_all(), RuntimeError("the LLM was closed before this "
                                                    "request finished"))

    def _fail(self, requests, exc: BaseException) -> None:
        with self._cond:
            # A prompt's n requests share one future: popped by the first, None after.
            futures = [self._futures.pop(r.output_id, None) for r in requests]
            futures += [self._futures.pop(r.output_id, None) for r in self._inbox]
            self._inbox.clear()
        for future in futures:
            _resolve(future, exc)

    def _on_done(self, request_id: int, future: Future) -> None:
        """A future's callback: a cancelled one's request leaves the engine before the
        next step (the step loop alone touches the engine)."""
        if future.cancelled():
            with self._cond:
                self._aborts.add(request_id)
                self._cond.notify_all()

    def _drop_cancelled(self) -> None:
        """The step loop, holding the lock: drop the cancelled requests, queued or running."""
        if not self._aborts:
            return
        ids, self._aborts = self._aborts, set()
        self._inbox = deque(r for r in self._inbox if r.output_id not in ids)
        self.engine.abort(ids)
        for request_id in ids:
            self._futures.pop(request_id, None)
        self._cond.notify_all()  # _cancel() waits for this

    def _cancel(self, futures: list[Future]) -> None:
        """Cancel the unfinished futures and wait until the engine has dropped them."""
        for future in futures:
            future.cancel()
        with self._cond:
            self._cond.wait_for(lambda: not self._aborts or self._closed)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        error, self._close_error = self._close_error, None
        if error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _current_gpu() -> int | None:
    """The calling thread's current GPU, where it has touched CUDA (torch is not asked
    to start CUDA for this: a CPU engine on a GPU machine never does)."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def engine_gpu(device: str, caller_gpu: int | None) -> int | None:
    """The GPU an engine's own thread makes current: "cuda" is the constructor's caller's
    current GPU (cuda:0 where it had none), "cuda:N" is N. None for CPUs and for device
    groups ("cuda:a,b,..."), whose ranks each take theirs in their own process."""
    if not device.startswith("cuda") or "," in device:
        return None
    _, _, index = device.partition(":")
    if index:
        return int(index)
    return 0 if caller_gpu is None else caller_gpu


def _resolve(future: Future | None, result) -> None:
    """Set an output or an exception, unless the caller cancelled the future meanwhile."""
    if future is None:
        return
    try:
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled (or already failed): nobody waits for it
        pass


def _prompt_of(prompt):
    """vLLM's dict prompts ({"prompt": text} or {"prompt_token_ids": ids}) as fusegen's."""
    if isinstance(prompt, dict):
        for key in ("prompt_token_ids", "prompt"):
            if key in prompt:
                return prompt[key]
    return prompt


def _paired(prompts: Iterable, params, total: int | None, what: str
            ) -> Iterator[tuple[Prompt, SamplingParams]]:
    """(prompt, its SamplingParams) for each of `prompts` (`total` of them, None when
    unknown until the iterable ends), `params` one for all or one per prompt; a count
    that differs is a ValueError, before any is submitted when `total` is known."""
    if params is None or isinstance(params, SamplingParams):
        return zip(prompts, itertools.repeat(params or SamplingParams()))
    if total is not None:
        return zip(prompts, _params_per_prompt(params, total, what))
    return _zip_counted(prompts, list(params), what)


def _zip_counted(prompts: Iterable, params: list[SamplingParams], what: str):
    count = 0
    for prompt in prompts:
        if count == len(params):
            raise ValueError(f"more {what} than the {len(params)} SamplingParams; pass one "
                             f"SamplingParams for all, or one per {what[:-1]}")
        yield prompt, params[count]
        count += 1
    if count != len(params):
        raise ValueError(f"{count} {what} but {len(params)} SamplingParams; pass one "
                         f"SamplingParams for all, or one per {what[:-1]}")


def _params_per_prompt(params, count: int, what: str) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    if len(params) != count:
        raise ValueError(f"{count} {what} but {len(params)} SamplingParams; pass one "
                         f"SamplingParams for all, or one per {what[:-1]}")
    return list(params)


class _Progress:
    """A bar of finished prompts (of `total`, when known) and output tok/s on stderr,
    drawn by the caller's thread; `use_tqdm` a tqdm-like class draws it (vLLM's form),
    and none is drawn when it is false or there are no prompts."""

    def __init__(self, use_tqdm: bool | Callable, total: int | None):
        self._bar = None
        self._tokens = 0
        if use_tqdm and total != 0:
            bar_cls = use_tqdm if callable(use_tqdm) else tqdm
            self._bar = bar_cls(total=total, desc="Processed prompts", unit="prompt",
                                dynamic_ncols=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()

    def advance(self, done: set[Future]) -> None:
        if self._bar is None:
            return
        for future in done:
            if not future.cancelled() and future.exception() is None:
                self._tokens += future.result().num_generated_tokens
        elapsed = self._bar.format_dict.get("elapsed") or 0.0  # a tqdm (sub)class's
        if elapsed:
            self._bar.set_postfix_str(f"output: {self._tokens / elapsed:.1f} tok/s",
                                      refresh=False)
        self._bar.update(len(done))


LLM.__init__.__doc__ += "\n\n" + describe() + "\n\n" + describe_vllm()
