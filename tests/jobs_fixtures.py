"""Helpers for the tests of jobs/: a fake engine (fast, deterministic, thread-safe, with the
LLM.submit contract), dataset writers, and the tiny real checkpoint shared by the tests
that need the engine."""
from __future__ import annotations

import os
import tempfile
import threading
import time
import zlib
from concurrent.futures import Future
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusegen.engine.outputs import CompletionOutput, RequestOutput
from fusegen.engine.tokenizer import PromptLimit


class FakeTokenizer:
    chat_template = "{{ messages }}"
    max_token_bytes = 4  # a token per character: at most 4 bytes of UTF-8

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) % 1000 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return (chat_template or "") + text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages, add_generation_prompt=True, chat_template=None):
        return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                    chat_template), False)


class FakeLLM:
    """Iteration-level batching like the engine: every step, waiting requests join the
    running batch (up to max_num_seqs) and each running request gains one token. It has
    every member of `LLM` that jobs use."""

    instances: list = []

    def __init__(self, model, max_num_seqs=None, max_model_len=None, step_seconds=0.0005,
                 **_):
        if not os.path.isdir(model):
            raise ValueError(f"{model}/config.json: not found")
        self.tokenizer = FakeTokenizer()
        self.config = SimpleNamespace(model=model)  # the path the model's name resolved to
        self.max_num_seqs = max_num_seqs or 8
        self.max_model_len = max_model_len or 64
        self.step_seconds = step_seconds
        self._waiting, self._running = [], []
        self._cv = threading.Condition()
        self._steps = self._running_sum = self._generated = self._next_id = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        FakeLLM.instances.append(self)

    def submit(self, prompt, params) -> Future:
        fut = Future()
        with self._cv:
            self._next_id += 1
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if len(ids) > self.max_model_len:
                out = RequestOutput.failed(self._next_id, f"prompt_too_long: {len(ids)} tokens "
                                           f"> max_model_len {self.max_model_len}", None, ids)
                fut.set_result(out)
                return fut
            n = getattr(params, "n", 1)  # n completions, each a request of its own
            out = RequestOutput(self._next_id, None, ids,
                                [CompletionOutput(i, "", [], "length") for i in range(n)])
            seed = zlib.crc32(repr((ids, params.seed)).encode())
            self._waiting += [[c, params.max_tokens, seed + c.index, fut, out]
                              for c in out.outputs]
            self._cv.notify()
        return fut

    def submit_many(self, requests):
        return [self.submit(p, s) for p, s in requests]

    @property
    def prompt_limit(self) -> PromptLimit:
        return PromptLimit(self.max_model_len, self.tokenizer.max_token_bytes)

    def engine_load(self) -> None:
        return None  # no scheduler or KV cache to report: the progress line shows none

    class placement:  # the engine's placement plan, as the job prints it
        @staticmethod
        def table() -> str:
            return "tier  budget  weights\ndevice  -  all layers"

    def memory_report(self) -> dict:
        return {"device": {"total": 0}, "layers": {"device": 1, "host": 0, "disk": 0}}

    def generate(self, prompts, params):
        plist = params if isinstance(params, list) else [params] * len(prompts)
        return [f.result() for f in [self.submit(p, s) for p, s in zip(prompts, plist)]]

    def _loop(self):
        while True:
            with self._cv:
                while not self._closed and not (self._waiting or self._running):
                    self._cv.wait()
                if self._closed:
                    return
                free = self.max_num_seqs - len(self._running)
                self._running += self._waiting[:free]
                del self._waiting[:free]
                running = list(self._running)
                self._steps += 1
                self._running_sum += len(running)
            time.sleep(self.step_seconds)
            for req in running:
                completion, max_tokens, seed, fut, out = req
                token = 97 + (seed + len(completion.token_ids)) % 26
                completion.token_ids.append(token)
                completion.text += chr(token)
                self._generated += 1
                if len(completion.token_ids) >= max_tokens:
                    with self._cv:
                        self._running.remove(req)
                    if all(len(c.token_ids) >= max_tokens for c in out.outputs):
                        fut.set_result(out)

    def stats(self):
        with self._cv:
            return {"num_steps": self._steps, "max_num_seqs": self.max_num_seqs,
                    "mean_running": self._running_sum / max(self._steps, 1),
                    "num_generated_tokens": self._generated}

    def close(self):
        with self._cv:
            self._closed = True
            pending = self._waiting + self._running
            self._waiting, self._running = [], []
            self._cv.notify()
        for fut in {id(req[3]): req[3] for req in pending}.values():  # n > 1: one future
            fut.cancel() or fut.set_exception(RuntimeError("engine closed"))


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    """Route jobs' engine loading to FakeLLM; yields a model directory that 'loads'."""
    from fusegen.jobs import engines
    model = tmp_path / "fake-model"
    model.mkdir()
    FakeLLM.instances = []
    monkeypatch.setattr(engines, "_load", lambda m, kw: FakeLLM(m, **kw))
    yield str(model)
    engines.close_engines()


def write_prompts(path, n: int, start: int = 0, row_group_size: int | None = None, **extra):
    """A Parquet file of n rows: id, prompt ("prompt <id>") and any extra columns."""
    table = pa.table({"id": list(range(start, start + n)),
                      "prompt": [f"prompt {i}" for i in range(start, start + n)], **extra})
    pq.write_table(table, path, row_group_size=row_group_size)
    return table


def write_job(tmp_path, model, **keys) -> str:
    """tmp_path/job.yaml reading tmp_path/in.parquet into tmp_path/out with `model`, no
    progress line, and `keys` (as the job file spells them); returns its path."""
    lines = {"model": model, "input": tmp_path / "in.parquet", "output": tmp_path / "out",
             "progress": "none", **keys}
    job = tmp_path / "job.yaml"
    job.write_text("".join(f"{key}: {value}\n" for key, value in lines.items()))
    return str(job)


def read_output(fs_or_path, path=None) -> pa.Table:
    """All committed parts of an output directory, in part order."""
    if path is None:
        files = sorted(p for p in os.listdir(fs_or_path) if p.startswith("part-"))
        return pa.concat_tables([pq.read_table(os.path.join(fs_or_path, f)) for f in files],
                                promote_options="default")
    fs = fs_or_path
    files = sorted(p for p in fs.ls(path, detail=False) if p.rsplit("/", 1)[-1].startswith("part-"))
    return pa.concat_tables([pq.read_table(fs.open(f, "rb")) for f in files],
                            promote_options="default")


_TINY_MODEL = {}


def tiny_model_dir() -> str:
    """The demo-sized random checkpoint with a real tokenizer, built once per process."""
    if "dir" not in _TINY_MODEL:
        from fusegen.engine.models.synthetic import build_checkpoint

        root = tempfile.mkdtemp(prefix="fusegen-jobs-model-")
        _TINY_MODEL["dir"] = str(build_checkpoint(os.path.join(root, "model"), seed=0))
    return _TINY_MODEL["dir"]


def sigkill_when(args, log_path, ready, what: str, timeout: float = 300.0) -> None:
    """Run `args` (from the repository root, output to `log_path`) and SIGKILL it as
    soon as `ready()` holds (or it exits first); `what` names the wait in a time-out."""
    import signal
    import subprocess
    import time

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=repo, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not ready() and proc.poll() is None:
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
