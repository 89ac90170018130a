"""fusegen's engine on the benchmark's requests, through the offline API."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import as_completed
from dataclasses import dataclass, field
from pathlib import Path

from fusegen.engine.llm_engine import EngineStats, stats_since
from fusegen.jobs.bench.results import EngineResult
from fusegen.jobs.bench.sparse import linear_bytes_by_layer
from fusegen.jobs.bench.workload import BenchRequest

# `fusegen bench --structured half`: a labelling answer, what constrained jobs ask for.
LABEL_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral", "mixed"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "reasons": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 60}},
    },
    "required": ["label", "confidence", "reasons"],
    "additionalProperties": False,
}


def run_fusegen(model_dir: Path, requests: list[BenchRequest], warmup: list[BenchRequest], *,
                dtype: str, device: str, engine_options: dict,
                progress: Callable[[str], None], name: str = "fusegen",
                label: str = "fusegen", schema: dict | None = None) -> EngineResult:
    """`schema`: every other request (odd positions) constrained by it; those end when
    their JSON completes, so only the others must meet their budgets."""
    from fusegen.engine import LLM

    tp, pp = (engine_options.get(k, 1) for k in ("tensor_parallel_size",
                                                   "pipeline_parallel_size"))
    if tp * pp > 1:  # a device group: its shape beside the name
        mode = engine_options.get("tensor_parallel_mode") or "1d"
        label = f"{label} (tp {tp} x pp {pp})" if mode == "1d" else \
            f"{label} (tp {tp} {mode}, depth {engine_options.get('tesseract_depth') or 1})"
    result = EngineResult(name, label)
    _forget_parsed_gguf(model_dir)
    start = time.perf_counter()
    llm = LLM(str(model_dir), dtype=dtype, device=device, **engine_options)
    result.load_s = time.perf_counter() - start
    try:
        # untimed; with a schema, its compilation and the grammar tokenizer's too
        llm.generate(*_prompts_and_params(warmup, schema), use_tqdm=False)
        before = llm.stats()
        steps = _record_decode_steps(llm.engine)
        runner = llm.engine.runner
        streamer = runner.streamer  # a device group's ranks stream for themselves
        stall_before = streamer.stall_seconds if streamer is not None else 0.0
        graphs = runner.graphs  # recorded decode steps: CUDA graphs, or CPU graphs on a CPU
        replays_before = graphs.replays if graphs is not None else 0
        progress(f"fusegen: generating {len(requests)} requests "
                 f"(max_num_seqs {llm.config.max_num_seqs}, "
                 f"max_num_batched_tokens {llm.config.max_num_batched_tokens})")
        prompts, params = _prompts_and_params(requests, schema)
        start = time.perf_counter()
        # What generate() does (every request joins the same first step), but finishing
        # requests can be counted on the way.
        futures = llm.submit_many(list(zip(prompts, params)))
        _report_progress(futures, progress, start)
        outputs = [f.result() for f in futures]
        result.elapsed_s = time.perf_counter() - start
        after = llm.stats()
        delta = _stats_delta(before, after)
        if streamer is not None:
            delta["copy_stall_s"] = streamer.stall_seconds - stall_before
        offload = _offload_figures(llm, streamer, delta)
        memory = llm.memory_report()
        weight_bytes = runner.step_weight_bytes()
        model = runner.local_model()  # None where a device group's ranks hold it
        layer_bytes = None if model is None else linear_bytes_by_layer(model)
        # a device group's row-parallel sums timed (warm-up included): how much of the
        # all-reduces' time its compute hid
        overlap = runner.tensor_parallel_overlap() if tp > 1 else None
        # the graphs' kind is the device the steps ran on: "cuda" or "cpu"
        recorded = None if graphs is None else {
            "device": runner.device.type, "replays": graphs.replays - replays_before,
            "recorded": len(graphs.graphs), "failed": graphs.failed}
    finally:
        llm.close()

    result.counts = [(r.num_prompt_tokens, min(len(o.token_ids), r.max_tokens))
                     for r, o in zip(requests, outputs)]
    free = slice(None, None, 1 if schema is None else 2)  # the unconstrained requests
    result.budgets_met = all(len(o.token_ids) == r.max_tokens and o.finish_reason == "length"
                             for r, o in zip(requests[free], outputs[free]))
    errors = [o.error for o in outputs if o.error]
    result.extra = {
        **_stats_delta(before, after),
        "num_errors": len(errors),
        "first_error": errors[0] if errors else None,
        "max_num_seqs": llm.config.max_num_seqs,
        "max_num_batched_tokens": llm.config.max_num_batched_tokens,
        "quantization": llm.config.quantization,  # the form the weights ran in, resolved
        # allocated at load (sized from free memory unless kv_cache_memory says)
        "kv_cache_bytes": memory["device"]["kv_cache"] + memory["host"]["kv_cache"],
        "weight_bytes": weight_bytes,
        "linear_bytes_by_layer": layer_bytes,  # each decoder layer's linears, as held
        "output_digest": output_digest([o.token_ids for o in outputs]),
        "decode_step_times_s": steps.decode_step_times_s,  # each timed decode step, in order
        "memory": memory,  # bytes per tier and use, budgets, layers and KV blocks per tier
        **offload,
        **({} if recorded is None else {"graphs": recorded}),
        **({} if overlap is None else {"tensor_parallel_overlap": overlap}),
    }
    if schema is not None:
        constrained = [o.outputs[0] for o in outputs[1::2]]
        result.extra["num_constrained"] = len(constrained)
        result.extra["num_structured_valid"] = sum(c.structured_valid is True for c in constrained)
    return result


def output_digest(token_ids: list[list[int]]) -> str:
    """sha256 of each request's output ids, in workload order: two runs of the same
    requests gave the same tokens exactly when their digests are equal."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps([list(t) for t in token_ids]).encode()).hexdigest()


@dataclass(slots=True)
class _StepTimes(EngineStats):
    """The engine's counters, and the seconds of each decode step as it records them
    (the engine keeps sums only): one float a step, for the report's step-time line."""
    decode_step_times_s: list[float] = field(default_factory=list)

    def record(self, batch, sampled, finished, seconds: float) -> None:
        decode_steps = self.num_decode_steps
        EngineStats.record(self, batch, sampled, finished, seconds)
        if self.num_decode_steps > decode_steps:  # the engine counted it a decode step
            self.decode_step_times_s.append(seconds)


def _record_decode_steps(engine) -> _StepTimes:
    """From now on, the engine's steps also leave their times (between runs: no step is
    in progress while its counters move over)."""
    counters = {f.name: getattr(engine.stats, f.name) for f in dataclasses.fields(EngineStats)}
    engine.stats = _StepTimes(**counters)
    return engine.stats


def _forget_parsed_gguf(model: Path) -> None:
    """The bench read a GGUF file's header already (its shape, the chat workload's
    tokenizer), which the reader keeps per process: the timed load parses it afresh, as
    a fresh process does."""
    from fusegen.engine.weights.gguf_names import is_gguf

    if is_gguf(model):
        from fusegen.engine.weights.gguf import GGUFFile

        GGUFFile._parse.cache_clear()


def _offload_figures(llm, streamer, stats: dict) -> dict:
    """With streamed layers (`streamer`, the runner's weight ring): the measured transfer
    rate, the transfer bound of a decode step (the streamed bytes over that rate) and how
    close the decode steps came to it."""
    if streamer is None:
        return {}
    report = llm.memory_report()
    bandwidth = streamer.measure_bandwidth()
    step_bytes = streamer.step_bytes  # the streamed layers' bytes, compressed where kept
    bound = step_bytes / bandwidth
    decode_step = stats["decode_seconds"] / stats["num_decode_steps"] \
        if stats.get("num_decode_steps") else 0.0
    return {
        "offload": {
            "layers": report["layers"],
            "kv_blocks": report["kv_blocks"],
            "device_bytes": report["device"]["total"],
            "device_budget": report["device"]["budget"],
            "streamed_bytes_per_step": step_bytes,
            "transfer_bandwidth": bandwidth,
            "transfer_bound_s": bound,
            "decode_step_s": decode_step,
            "decode_over_bound": decode_step / bound if bound else 0.0,
            # Time compute spent blocked on a copy, per step: what streaming cost on
            # top of compute (measured on the host: CPU runs; ~0 by construction on CUDA).
            "stall_per_step_s": stats.get("copy_stall_s", 0.0) / max(stats.get("num_steps", 0), 1),
        }
    }


def _report_progress(futures, progress: Callable[[str], None], start: float) -> None:
    marks = {len(futures) * q // 4 for q in (1, 2, 3)}
    for done, _ in enumerate(as_completed(futures), 1):
        if done in marks:
            progress(f"fusegen: {done}/{len(futures)} requests done "
                     f"({time.perf_counter() - start:.1f}s so far)")


def _stats_delta(before: dict, after: dict) -> dict:
    """The engine's counters for the timed run alone (they accumulate over the warm-up)."""
    return {key: value for key, value in stats_since(before, after).items()
            if isinstance(value, (int, float)) and key != "max_num_seqs"}


def _prompts_and_params(requests: list[BenchRequest], schema: dict | None = None):
    from fusegen.engine import SamplingParams

    prompts = [r.prompt_ids for r in requests]
    # Greedy and ignore_eos: a random model must produce exactly the budget, every engine.
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True,
                             json_schema=schema if i % 2 else None)
              for i, r in enumerate(requests)]
    return prompts, params
