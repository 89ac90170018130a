"""Baseline 2: transformers' own continuous batching, where the installed version has it.

`generate_batch` takes one `max_new_tokens` for all requests, so this drives the manager
it wraps (`continuous_batching_context_manager`, the same warm-up and workload hints)
and gives each request its own budget, with EOS disabled (`eos_token_id=-1`)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

from fusegen.jobs.bench.results import EngineResult
from fusegen.jobs.bench.workload import BenchRequest


def continuous_batching_missing(model) -> str | None:
    """Why this transformers cannot run the baseline, or None when it can."""
    if not hasattr(model, "generate_batch") or not hasattr(
            model, "continuous_batching_context_manager"):
        return "this transformers has no continuous batching (generate_batch)"
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: F401
        from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: F401
    except ImportError as exc:
        return f"this transformers' continuous batching API differs ({exc})"
    return None


def _cb_config(requests: list[BenchRequest], device: str):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if device.startswith("cuda"):
        return ContinuousBatchingConfig()  # sized from free GPU memory, as users get it
    # On CPU its default takes 60% of host memory for KV pages, which costs seconds of
    # warm-up; give it exactly enough to hold every request at once instead (never less
    # than it can use, so it is never made to wait or preempt).
    page = _page_size(ContinuousBatchingConfig())
    blocks = sum(math.ceil((r.num_prompt_tokens + r.max_tokens) / page) + 1 for r in requests)
    return ContinuousBatchingConfig(num_blocks=blocks)


def _collect(manager, request_ids: list[str], progress, label: str, start: float) -> dict:
    results, marks = {}, {len(request_ids) * q // 4 for q in (1, 2, 3)}
    while len(results) < len(request_ids):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
            continue
        if out.is_finished():
            results[out.request_id] = out
            if len(results) in marks:
                progress(f"{label}: {len(results)}/{len(request_ids)} requests done "
                         f"({time.perf_counter() - start:.1f}s so far)")
    return results


def run_hf_continuous(model, requests: list[BenchRequest], warmup: list[BenchRequest], *,
                      device: str, progress: Callable[[str], None]) -> EngineResult:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    result = EngineResult("hf_continuous", "hf continuous batching")
    everything = requests + warmup
    hints = WorkloadHints(max_prompt_length=max(r.num_prompt_tokens for r in everything),
                          max_generated_length=max(r.max_tokens for r in everything),
                          num_requests=len(requests))
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                              max_new_tokens=max(r.max_tokens for r in everything))
    with model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=_cb_config(everything, device),
            workload_hints=hints, block=True, timeout=60) as manager:
        ids = [manager.add_request(r.prompt_ids, max_new_tokens=r.max_tokens, eos_token_id=-1)
               for r in warmup]
        _collect(manager, ids, lambda _: None, "", time.perf_counter())  # untimed
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt_ids, max_new_tokens=r.max_tokens, eos_token_id=-1)
               for r in requests]
        outputs = _collect(manager, ids, progress, "hf continuous", start)
        result.elapsed_s = time.perf_counter() - start
    generated = [len(outputs[i].generated_tokens) for i in ids]
    result.counts = [(r.num_prompt_tokens, min(n, r.max_tokens)) for r, n in zip(requests, generated)]
    result.budgets_met = all(n == r.max_tokens and outputs[i].error is None
                             for r, n, i in zip(requests, generated, ids))
    result.extra = {"num_blocks": manager.continuous_batching_config.num_blocks,
                    "page_size": _page_size(manager.continuous_batching_config)}
    return result


def _page_size(config) -> int:
    """Tokens per KV page: `page_size` in transformers 5.20 and later, `block_size` before."""
    return getattr(config, "page_size", None) or config.block_size
