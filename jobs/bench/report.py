"""The benchmark's figures: one JSON-ready dict, and the table printed from it."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from fusegen.jobs.bench import flops
from fusegen.jobs.bench.ceiling import Ceiling
from fusegen.jobs.bench.machine import describe_machine, now_iso, versions
from fusegen.jobs.bench.presets import WORKLOADS
from fusegen.jobs.bench.results import EngineResult
from fusegen.jobs.bench.sparse import format_sparse, summarize
from fusegen.jobs.bench.workload import BenchRequest, describe_workload

_RATES = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "flops_per_s")


def build_report(config, model, baseline_dir: Path, requests: list[BenchRequest],
                 ceiling: Ceiling, results: list[EngineResult], load: dict | None = None) -> dict:
    """`model`: the BenchModel run; `load`: with a GGUF file, fusegen's and transformers'
    load seconds (None: transformers' was not timed)."""
    preset, shape, dtype = config.preset, model.shape, config.dtype
    peak = ceiling.matmul_flops[dtype]
    engines = {}
    for r in results:
        engines[r.name] = r.to_dict()
        if r.skipped is None:
            engines[r.name]["mfu"] = r.flops_per_s / peak
    fusegen = next(r for r in results if r.name == "fusegen")
    return {
        "preset": preset.name,
        "date": now_iso(),
        "machine": describe_machine(config.device),
        "versions": versions(),
        "config": {"dtype": dtype, "device": config.device, "seed": config.seed,
                   "num_requests": preset.num_requests, "hf_batch_size": preset.hf_batch_size,
                   "hf_requests": config.hf_requests,  # None: the baselines ran them all
                   "engine_options": dict(config.engine_options)},
        "model": {**shape.to_dict(), "num_params": flops.num_params(shape),
                  "source": model.source, "format": model.format,
                  "checkpoint": str(model.path), "baseline_checkpoint": str(baseline_dir)},
        "workload": _workload(preset, requests),
        "ceiling": ceiling.to_dict(),
        "results": engines,
        "ratios": {r.name: _ratios(fusegen, r) for r in results
                   if r is not fusegen and r.skipped is None and fusegen.skipped is None},
        "utilisation": _utilisation(fusegen, shape, dtype, ceiling),
        **({} if load is None else {"load": {**load, "file_bytes": model.path.stat().st_size}}),
        **({"sparse": summarize(engines, config.sparse_variants)}
           if config.sparse_variants else {}),
    }


def _workload(preset, requests: list[BenchRequest]) -> dict:
    """The requests as drawn, and what they were drawn from: the named workload (None:
    the preset's own lengths) and each length distribution's parameters."""
    named = WORKLOADS.get(preset.workload)
    return {"name": preset.workload, "about": named.about if named else None,
            **describe_workload(requests),
            "prompt_dist": preset.prompt_len.describe(),
            "output_dist": preset.output_len.describe(),
            "prompt_dist_params": asdict(preset.prompt_len),
            "output_dist_params": asdict(preset.output_len)}


def _ratios(fusegen: EngineResult, baseline: EngineResult) -> dict:
    """fusegen / baseline for each rate (> 1: fusegen is faster)."""
    out = {}
    for name in _RATES:
        base = getattr(baseline, name)
        out[name] = getattr(fusegen, name) / base if base > 0 else None
    if fusegen.peak_rss_bytes and baseline.peak_rss_bytes:
        out["peak_rss_bytes"] = fusegen.peak_rss_bytes / baseline.peak_rss_bytes  # < 1: less
    return out


def _utilisation(fusegen: EngineResult, shape, dtype: str, ceiling: Ceiling) -> dict:
    if fusegen.skipped is not None or fusegen.elapsed_s <= 0:
        return {}
    peak = ceiling.matmul_flops[dtype]
    steps = fusegen.extra.get("num_steps", 0)
    # the bytes the engine reported its steps reading (compressed where kept), else dense
    step_bytes = fusegen.extra.get("weight_bytes") or flops.weight_bytes(shape, dtype)
    memory_s = flops.memory_bound_seconds(shape, dtype, fusegen.counts, steps,
                                          ceiling.memory_bandwidth, step_bytes)
    compute_s = fusegen.model_flops / peak
    return {
        "dtype": dtype,
        "matmul_ceiling_flops": peak,
        "mfu": fusegen.flops_per_s / peak,  # model FLOP/s over the run dtype's matmul ceiling
        "compute_bound_s": compute_s,  # the run at the matmul ceiling
        "memory_bound_s": memory_s,  # weights once per step + KV reads, at the bandwidth
        "memory_roofline_fraction": memory_s / fusegen.elapsed_s,
        "roofline_fraction": max(compute_s, memory_s) / fusegen.elapsed_s,
        "weight_bytes": step_bytes,
        "num_steps": steps,
    }


# --- the table ------------------------------------------------------------------------

def _num(value: float, digits: int = 1) -> str:
    return f"{value:,.{digits}f}"


def _flops(value: float) -> str:
    return f"{value / 1e12:.2f} TFLOP/s" if value >= 1e12 else f"{value / 1e9:.2f} GFLOP/s"


def format_report(report: dict) -> str:
    cfg, model, work, ceil = report["config"], report["model"], report["workload"], report["ceiling"]
    machine = report["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, {ceil['num_threads']} torch threads"
    named = "" if model.get("source", "random") == "random" else \
        f"{model['source']} ({model['format']}), "
    lines = [
        f"fusegen bench: preset {report['preset']}, {work['num_requests']} requests, "
        f"{cfg['dtype']} on {cfg['device']} ({where}), {report['date']}",
        f"  model: {named}{model['num_layers']} layers, hidden {model['hidden_size']}, vocab "
        f"{model['vocab_size']}, {model['num_params'] / 1e6:.1f}M parameters",
        _workload_line(report),
        f"  prompts: {work['num_prompt_tokens']:,} tokens ({work['prompt_dist']}, mean "
        f"{work['prompt_len']['mean']}); outputs: {work['num_output_tokens']:,} tokens "
        f"({work['output_dist']}, mean {work['output_len']['mean']})",
        "",
        f"{'engine':<28}{'time s':>9}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}"
        f"{'model FLOP/s':>16}{'MFU':>8}{'peak RSS':>11}{'fusegen x':>11}",
    ]
    for name, r in report["results"].items():
        if "skipped" in r:
            lines.append(f"{r['label']:<28}  {r['skipped']}")
            continue
        ratio = report["ratios"].get(name, {}).get("output_tokens_per_s")
        mark = "" if r["budgets_met"] else "  (counts differ from budgets!)"
        lines.append(
            f"{r['label']:<28}{r['elapsed_s']:>9.2f}{_num(r['requests_per_s'], 2):>9}"
            f"{_num(r['output_tokens_per_s']):>11}{_num(r['total_tokens_per_s']):>13}"
            f"{_flops(r['flops_per_s']):>16}{r['mfu']:>8.1%}{_mb(r.get('peak_rss_bytes')):>11}"
            f"{(f'{ratio:.2f}x' if ratio else '-'):>11}{mark}")
    lines += ["", _ceiling_line(ceil)]
    subset = _subset_line(report)
    if subset:
        lines.append(subset)
    if "llamacpp" in report["results"]:
        lines.append(_llamacpp_line(report["results"]["llamacpp"], report["ratios"],
                                    _ran_as(report, cfg), cfg["dtype"]))
    structured = report["results"].get("fusegen_structured_half", {})
    if "num_constrained" in structured:
        lines.append(f"structured: {structured['num_structured_valid']} of "
                     f"{structured['num_constrained']} JSON-constrained outputs complete their "
                     "schema (the others reached their budgets)")
    if "fusegen_no_prefix_cache" in report["results"]:
        lines.append(_prefix_line(report["results"]))
    if "load" in report:
        lines.append(_load_line(report["load"], report["results"]["fusegen"], cfg["dtype"],
                                _ran_as(report, cfg)))
    offload = report["results"].get("fusegen", {}).get("offload")
    if offload:
        layers = offload["layers"]
        lines.append(
            f"offload: {layers['device']} layers resident, {layers['host']} host, "
            f"{layers['disk']} disk; device {offload['device_bytes'] / 2**20:,.0f} of "
            f"{offload['device_budget'] / 2**20:,.0f} MiB; streamed "
            f"{offload['streamed_bytes_per_step'] / 1e6:,.1f} MB per step at a measured "
            f"{offload['transfer_bandwidth'] / 1e9:.2f} GB/s -> transfer bound "
            f"{offload['transfer_bound_s'] * 1e3:.1f} ms; decode steps took "
            f"{offload['decode_step_s'] * 1e3:.1f} ms ({offload['decode_over_bound']:.2f}x "
            f"the bound), of which compute waited {offload['stall_per_step_s'] * 1e3:.1f} ms "
            "per step on copies")
    fusegen = report["results"].get("fusegen", {})
    # "cuda_graphs": the key of reports written before the entry named its device
    graphs = fusegen.get("graphs") or fusegen.get("cuda_graphs")
    if graphs:
        lines.append(_graphs_line({"device": cfg["device"], **graphs}, fusegen))
    util = report["utilisation"]
    if util:
        lines.append(
            f"fusegen model-FLOP utilisation: {util['mfu']:.1%} of the measured {util['dtype']} "
            f"matmul ceiling; memory roofline {util['memory_roofline_fraction']:.1%} "
            f"({util['num_steps']} steps x {util['weight_bytes'] / 1e6:,.1f} MB of weights + KV "
            f"reads over the measured bandwidth)")
    if "sparse" in report:
        lines += format_sparse(report["sparse"])
    return "\n".join(lines)


def _workload_line(report: dict) -> str:
    work = report["workload"]
    if work.get("name"):
        return f"  workload {work['name']}: {work['about']}"
    return f"  workload: preset {report['preset']}'s own lengths"


def _subset_line(report: dict) -> str | None:
    """How the transformers baselines compare when they ran the first N requests alone."""
    num_requests = report["workload"]["num_requests"]
    ran = {name: r for name, r in report["results"].items() if name.startswith("hf_")
           and "skipped" not in r and r["num_requests"] < num_requests}
    if not ran:
        return None
    r = next(iter(ran.values()))
    return (f"transformers ({', '.join(x['label'] for x in ran.values())}) ran the first "
            f"{r['num_requests']:,} of the {num_requests:,} requests (--hf-requests: "
            f"{r['num_prompt_tokens']:,} prompt and {r['num_output_tokens']:,} output tokens): "
            "its rates are per token of those, and 'fusegen x' divides fusegen's rate over "
            f"all {num_requests:,} by that")


def _mb(value: int | None) -> str:
    return "-" if not value else f"{value / 1e6:,.0f} MB"


def _ran_as(report: dict, cfg: dict) -> str | None:
    """The form fusegen's weights ran in: as the engine resolved it (a GGUF file keeps its
    blocks on a CPU with quantization unset), else as asked (reports written before the
    engine recorded it)."""
    return report["results"].get("fusegen", {}).get(
        "quantization", cfg["engine_options"].get("quantization"))


def _llamacpp_line(peer: dict, ratios: dict, quantization: str | None, dtype: str) -> str:
    """How llama.cpp ran, and fusegen against it: output rate and peak RSS."""
    if "skipped" in peer:
        return f"llama.cpp: {peer['skipped']}"
    how = (f"{peer['slots']} slots, continuous batching, the same prompt ids"
           if peer["tool"] == "llama-server" else
           f"batches of {peer['slots']} (its own prompt ids, the same lengths)")
    weights = ("kept as the file's blocks" if quantization == "gguf"
               else f"dequantized into {dtype}")
    ratio = ratios.get("llamacpp", {})
    rate, rss = ratio.get("output_tokens_per_s"), ratio.get("peak_rss_bytes")
    versus = (f"; fusegen ({weights}) {rate:.2f}x its output tok/s" if rate else "") + \
        (f" at {rss:.2f}x its peak RSS" if rss else "")
    return (f"llama.cpp {peer.get('version') or ''}: {peer['tool']}, {how}, "
            f"{peer['threads']} threads: {_num(peer['output_tokens_per_s'])} out tok/s, "
            f"{peer['elapsed_s']:.2f} s, peak RSS {_mb(peer.get('peak_rss_bytes'))}{versus}")


def _graphs_line(graphs: dict, fusegen: dict) -> str:
    """How many of the timed run's decode steps replayed a recorded graph
    (engine/graphs.py): CUDA graphs on a GPU, CPU graphs on a CPU."""
    kind = "CPU" if graphs["device"] == "cpu" else "CUDA"
    line = (f"{kind} graphs: {graphs['replays']:,} of {fusegen.get('num_decode_steps', 0):,} "
            f"decode steps replayed a recorded graph ({graphs['recorded']} recorded)")
    if graphs["failed"]:
        line += f"; recording failed, the engine ran eagerly after: {graphs['failed'][:300]}"
    return line


def _prefix_line(results: dict) -> str:
    """fusegen with and without prefix caching: prompt tokens computed, output rate."""
    rows = [results[name] for name in ("fusegen", "fusegen_no_prefix_cache")
            if "prompt_tokens_computed" in results[name]]
    return "prefix caching: " + "; ".join(
        f"{r['label']} computed {r['prompt_tokens_computed']:,} prefill tokens "
        f"({r['prompt_tokens_cached']:,} from the cache), "
        f"{_num(r['output_tokens_per_s'])} out tok/s" for r in rows)


def _ceiling_line(ceil: dict) -> str:
    matmul = ", ".join(f"{dtype} {_flops(value)} (n={ceil['matmul_size'][dtype]})"
                       for dtype, value in ceil["matmul_flops"].items())
    return (f"ceiling, measured in this run: matmul {matmul}; memory bandwidth "
            f"{ceil['memory_bandwidth'] / 1e9:.1f} GB/s (copy, read + write)")


def _load_line(load: dict, fusegen: dict, dtype: str, quantization: str | None) -> str:
    kv = f"a {fusegen['kv_cache_bytes'] / 1e9:,.1f} GB KV cache" if "kv_cache_bytes" in fusegen \
        else "the KV cache"
    weights = (f"linears kept as the file's blocks where a kernel takes their type, the rest "
               f"dequantized into {dtype}") if quantization == "gguf" \
        else f"weights dequantized into {dtype}"
    line = (f"model load from the GGUF file ({load['file_bytes'] / 1e6:,.1f} MB): fusegen "
            f"{load['fusegen_s']:.2f}s (LLM(...): {weights}, {kv} allocated)")
    if "transformers_error" in load:
        return line + f"; transformers' GGUF loader failed: {load['transformers_error'][:300]}"
    if load["transformers_s"] is None:
        return line + "; transformers not timed (--skip-hf)"
    ratio = load["transformers_s"] / load["fusegen_s"] if load["fusegen_s"] > 0 else 0.0
    return (line + f"; transformers from_pretrained(gguf_file=) {load['transformers_s']:.2f}s "
            f"({ratio:.2f}x fusegen's)")
