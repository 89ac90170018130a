"""`LLM`: the Python API. A background thread runs the engine step loop; any number
of producer threads `submit()` requests into the one running batch, and each future
resolves as soon as its request finishes."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from fusegen.engine.config import EngineConfig
from fusegen.engine.llm_engine import LLMEngine, Prompt
from fusegen.engine.outputs import RequestOutput
from fusegen.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **options):
        """`options` are `EngineConfig` fields: dtype, device, max_num_seqs,
        max_num_batched_tokens, block_size, kv_cache_memory, num_kv_blocks,
        max_model_len, allow_pickle, seed, device_memory, host_memory, prefetch_depth,
        num_host_kv_blocks."""
        self.config = EngineConfig(model=model, **options)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._cond = threading.Condition()
        self._inbox: deque = deque()
        self._futures: dict[int, Future] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def stats(self) -> dict:
        return self.engine.stats.as_dict(self.config.max_num_seqs)

    def memory_report(self) -> dict:
        """Bytes per memory tier (device, host, disk) for weights and KV cache, the
        budgets, and the device peak."""
        return self.engine.memory_report()

    @property
    def placement(self):
        """The placement plan (engine.memory.placement.PlacementPlan); `.table()` prints it."""
        return self.engine.runner.plan

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Outputs in input order. A bad request gives an output with
        finish_reason "error"; it never fails the others."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return [f.result() for f in self.submit_many(list(zip(prompts, params)))]

    def submit(self, prompt: Prompt, params: SamplingParams | None = None) -> Future:
        """Thread-safe. The future resolves to the request's RequestOutput."""
        return self.submit_many([(prompt, params)])[0]

    def submit_many(self, requests: Sequence[tuple[Prompt, SamplingParams | None]]
                    ) -> list[Future]:
        """Thread-safe; the requests join the running batch in the same step."""
        futures, items = [], []
        for prompt, params in requests:
            future: Future = Future()
            item = self.engine.make_request(prompt, params or SamplingParams())
            if isinstance(item, RequestOutput):
                future.set_result(item)
            else:
                items.append((item, future))
            futures.append(future)
        with self._cond:
            if self._closed:
                raise RuntimeError("this LLM is closed")
            for item, future in items:
                self._futures[item.request_id] = future
                self._inbox.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fusegen-engine",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        return futures

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._inbox and not engine.has_unfinished() and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                while self._inbox:
                    engine.add(self._inbox.popleft())
            try:
                outputs = engine.step()
            except BaseException as exc:  # noqa: BLE001 - delivered to every waiter
                self._fail(engine.abort_all(), exc)
                continue
            if outputs:
                with self._cond:
                    done = [(self._futures.pop(o.request_id), o) for o in outputs]
                for future, output in done:
                    future.set_result(output)
        self._fail(engine.abort_all(), RuntimeError("the LLM was closed before this "
                                                    "request finished"))

    def _fail(self, requests, exc: BaseException) -> None:
        with self._cond:
            futures = [self._futures.pop(r.request_id, None) for r in requests]
            futures += [self._futures.pop(r.request_id, None) for r in self._inbox]
            self._inbox.clear()
        for future in futures:
            if future is not None and not future.done():
                future.set_exception(exc)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
