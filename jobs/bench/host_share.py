"""The host's share of a decode step: the real engine loop (scheduler, step inputs,
the head and sampler calls, update, outputs, detokenization) around a model whose
device work is stubbed out, timed per phase.

On a GPU a decode step is the device's kernels plus the host's Python around them; once
the kernels are recorded as a graph, the host's part bounds the step at large batches.
Here the model's forward returns preallocated (x, residual) rows, its head a fixed token
per row (greedy rows) or fixed logits whose one finite token every draw picks (sampled
rows), so what is timed is the host's work alone, on any machine. Every request has the
same prompt and output length, so all are admitted in the first step and every later
step is a decode step of the whole batch until they finish together.

Phases, each host microseconds per decode step (wall clock around the call, or with
`clock="cpu"` this thread's CPU time, which a machine shared with other work inflates
less):
  schedule  Scheduler.schedule
  inputs    the step's inputs from the batch (engine/step_inputs.py)
  copies    the runner's forward with the model stubbed: the inputs made tensors and
            sent to the device, the attention metadata
  sampling  the rest of the runner's step: head, sampler, sampled ids back to the host
  update    Scheduler.update: tokens appended, stops checked (incremental detokenizing)
  outputs   finished requests made outputs (their text decoded)
  other     the rest of LLMEngine.step (bookkeeping, stats)

Run: python -m fusegen.jobs.bench.host_share [--batch-sizes 1,16,64,256] [--sampled]
"""
from __future__ import annotations

import functools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

PHASES = ("schedule", "inputs", "copies", "sampling", "update", "outputs", "other")
TOKEN = 7  # what every stubbed row samples: a plain id of every preset's vocabulary
# a stop string no output of TOKEN repeated contains: each request's tokens are
# detokenized incrementally, as with any stop string, and none ever stops
STOP = "\x00never\x00"
# wall: time.perf_counter_ns; cpu: the calling thread's CPU time
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}


@dataclass(frozen=True, slots=True)
class HostShareConfig:
    """One measurement: `batch_size` requests of `prompt_len` prompt and `output_len`
    output tokens, timed after `warmup_steps` decode steps; `sampled`: temperature 0.8,
    top-p 0.9 rows instead of greedy ones."""
    batch_size: int
    prompt_len: int = 8
    output_len: int = 64
    warmup_steps: int = 3
    sampled: bool = False

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size {self.batch_size} must be at least 1")
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len {self.prompt_len} must be at least 1")
        if self.output_len < self.warmup_steps + 2:
            raise ValueError(f"output_len {self.output_len} leaves no timed decode step after "
                             f"{self.warmup_steps} warm-up steps; give at least "
                             f"{self.warmup_steps + 2}")


class StubModel:
    """The runner's model with its device work replaced: the forward pass returns
    preallocated rows, the head TOKEN for every row (or logits that draw it). Every
    other attribute is the real model's."""

    def __init__(self, model, max_tokens: int, device):
        cfg = model.cfg
        self._model = model
        shape = (max_tokens, cfg.hidden_size)
        self._x = torch.zeros(shape, dtype=torch.float32, device=device)
        self._residual = torch.zeros(shape, dtype=torch.float32, device=device)
        self._ids = torch.full((max_tokens,), TOKEN, dtype=torch.int64, device=device)
        # one finite logit: every temperature / top-k / top-p draw takes it
        self._logits = torch.full((max_tokens, cfg.vocab_size), -1e4, device=device)
        self._logits[:, TOKEN] = 10.0
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, positions, cos_sin, kv_caches, meta, **_):
        self.calls += 1
        n = input_ids.shape[0]
        return self._x[:n], self._residual[:n]

    def greedy_tokens(self, x, residual):
        return self._ids[:x.shape[0]]

    def logits(self, x, residual):
        return self._logits[:x.shape[0]].clone()  # the sampler may write into them


class PhaseTimer:
    """Wall-clock nanoseconds per phase, summed over the calls made while `on`, each
    exclusive of the timed calls made inside it (the runner's step less its inputs and
    forward pass is its sampling, wherever the engine builds the inputs)."""

    def __init__(self, clock: str = "wall"):
        if clock not in CLOCKS:
            raise ValueError(f"clock {clock!r} is none of {', '.join(CLOCKS)}")
        self.now = CLOCKS[clock]
        self.ns = dict.fromkeys(PHASES, 0)
        self.total_ns = 0  # LLMEngine.step, inclusive
        self.on = False
        self._inner: list[int] = []  # per open call: the ns its timed callees took

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self._inner.append(0)
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                took = self.now() - start
                self.ns[phase] += took - self._inner.pop()
                if self._inner:
                    self._inner[-1] += took
                else:
                    self.total_ns += took
        return timed

    def per_step_us(self, steps: int) -> dict[str, float]:
        out = {p: self.ns[p] / steps / 1e3 for p in PHASES}
        out["step"] = self.total_ns / steps / 1e3
        return out


def measure(model_dir: str | Path, config: HostShareConfig, device: str = "cpu",
            clock: str = "wall") -> dict:
    """Run `config`'s workload through a fresh engine on `model_dir` with the model
    stubbed; its counts and host microseconds per timed decode step by phase, on
    `clock` (CLOCKS)."""
    from fusegen.engine import model_runner
    from fusegen.engine.llm_engine import LLMEngine
    from fusegen.engine.config import EngineConfig
    from fusegen.engine.options import EngineOptions
    from fusegen.engine.sampling_params import SamplingParams

    b, p, n = config.batch_size, config.prompt_len, config.output_len
    engine = LLMEngine(EngineConfig.build(str(model_dir), EngineOptions.from_kwargs(dict(
        device=device, dtype="float32", max_num_seqs=b, max_num_batched_tokens=max(b * p, 256),
        max_model_len=p + n, enable_prefix_caching=False,
        # the stub is no model to record: every step runs the runner's eager path, whose
        # host work is what this measures
        enforce_eager=True))))
    try:
        runner = engine.runner
        runner.model = stub = StubModel(runner.model, max(b * p, 256), runner.device)
        timer = PhaseTimer(clock)
        sched = engine.scheduler
        sched.schedule = timer.wrap("schedule", sched.schedule)
        sched.update = timer.wrap("update", sched.update)
        engine._outputs = timer.wrap("outputs", engine._outputs)
        runner.run = timer.wrap("sampling", runner.run)  # less its inputs and forward
        runner.forward = timer.wrap("copies", runner.forward)
        original_inputs = model_runner.step_inputs
        model_runner.step_inputs = timer.wrap("inputs", original_inputs)
        step = timer.wrap("other", engine.step)  # less every phase above
        params = SamplingParams(max_tokens=n, ignore_eos=True, stop=[STOP],
                                **({"temperature": 0.8, "top_p": 0.9} if config.sampled
                                   else {"temperature": 0.0}))
        for i in range(b):
            prompt = [(TOKEN + 1 + i + j) % 97 + 1 for j in range(p)]
            for request in engine.make_request(prompt, params):
                engine.add(request)
        outputs, timed_steps = [], 0
        try:
            while engine.has_unfinished():
                decode_before = engine.stats.num_decode_steps
                timer.on = decode_before >= config.warmup_steps
                outputs += step()
                if timer.on:
                    timed_steps += engine.stats.num_decode_steps - decode_before
        finally:
            model_runner.step_inputs = original_inputs
        stats = engine.stats
        return {
            **asdict(config),
            "num_steps": stats.num_steps, "num_decode_steps": stats.num_decode_steps,
            "num_generated_tokens": stats.num_generated_tokens,
            "num_outputs": len(outputs), "model_calls": stub.calls,
            "tokens_as_stubbed": all(o.token_ids == [TOKEN] * n for o in outputs),
            "timed_steps": timed_steps,
            "us_per_step": timer.per_step_us(max(timed_steps, 1)),
        }
    finally:
        engine.close()


def tiny_checkpoint(cache_dir: Path | None = None) -> Path:
    """The tiny preset's random checkpoint (built once, cached): the stub replaces its
    compute, so only its vocabulary and hidden size matter."""
    from fusegen.jobs.bench.checkpoint import default_cache_dir, ensure_checkpoint
    from fusegen.jobs.bench.presets import PRESETS

    tiny = PRESETS["tiny"].model
    return ensure_checkpoint("tiny", tiny, cache_dir or default_cache_dir())


def format_table(results: list[dict]) -> str:
    head = f"{'batch':>5} {'step us':>9} " + " ".join(f"{p:>9}" for p in PHASES)
    lines = [head]
    for r in results:
        us = r["us_per_step"]
        lines.append(f"{r['batch_size']:>5} {us['step']:>9.1f} "
                     + " ".join(f"{us[p]:>9.1f}" for p in PHASES))
    return "\n".join(lines)


def _batch_sizes(_ctx, _param, value: str) -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give batch sizes as integers, e.g. 1,16,64") \
            from None
    if any(s < 1 for s in sizes):
        raise click.BadParameter(f"{value!r}: every batch size must be at least 1")
    return sizes


@click.command()
@click.option("--batch-sizes", default="1,16,64,256", show_default=True,
              callback=_batch_sizes, help="Requests in the batch, one run each.")
@click.option("--output-len", default=64, show_default=True, type=click.IntRange(min=5),
              help="Output tokens a request (decode steps: one fewer).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Runs of each batch size, in turn; the table gives the medians.")
@click.option("--sampled", is_flag=True, help="Temperature 0.8, top-p 0.9 rows, not greedy.")
@click.option("--clock", type=click.Choice(sorted(CLOCKS)), default="wall", show_default=True,
              help="wall: elapsed time; cpu: this thread's CPU time (less inflated where "
                   "other work shares the cores).")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False),
              help="A checkpoint directory (default: the tiny preset's, built once).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write every run's figures to this JSON file.")
def main(batch_sizes, output_len, repeats, sampled, clock, model_dir, json_path):
    """Host microseconds per decode step, by phase, with the model's device work stubbed."""
    torch.set_num_threads(1)  # the host loop is one thread; the stub computes nothing
    model_dir = model_dir or tiny_checkpoint()
    runs = {b: [] for b in batch_sizes}
    for _ in range(repeats):
        for b in batch_sizes:
            runs[b].append(measure(model_dir, HostShareConfig(b, output_len=output_len,
                                                              sampled=sampled), clock=clock))
    medians = []
    for b, rs in runs.items():
        us = {k: statistics.median(r["us_per_step"][k] for r in rs)
              for k in rs[0]["us_per_step"]}
        medians.append({**rs[0], "us_per_step": us})
    click.echo(format_table(medians))
    if json_path is not None:
        json_path.write_text(json.dumps({"medians": medians, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
