"""One benchmark run: workload, model, ceiling, then every engine on the same requests.

The model is the preset's random checkpoint or a real one (`--model`, or the preset's
default_model): fusegen runs it as named (a GGUF file itself), the baselines a Hugging
Face directory (a GGUF file's export, made once). With a GGUF file, transformers' own
GGUF loader is timed once beside fusegen's load."""
from __future__ import annotations

import dataclasses
import gc
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fusegen.engine.host import on_a_passing_thread
from fusegen.jobs.bench import flops
from fusegen.jobs.bench.ceiling import measure_ceiling
from fusegen.jobs.bench.chat_prompts import make_chat_workload
from fusegen.jobs.bench.checkpoint import default_cache_dir, ensure_checkpoint
from fusegen.jobs.bench.model import (BenchModel, baseline_dir, load_tokenizer, random_model,
                                      resolve_bench_model)
from fusegen.jobs.bench.presets import LengthDist, Preset, PresetModel
from fusegen.jobs.bench.report import build_report
from fusegen.jobs.bench.results import EngineResult
from fusegen.jobs.bench.workload import BenchRequest, make_workload, max_context

Progress = Callable[[str], None]


@dataclass(slots=True)
class BenchConfig:
    preset: Preset  # already shrunk by --layers / --requests / --hf-batch-size
    # A real model (--model); None: the preset's default_model, else its random checkpoint.
    model: BenchModel | None = None
    dtype: str | None = None  # the run's dtype; None: the preset's
    device: str = "auto"  # auto: cuda when present, else cpu
    seed: int = 0  # the workload's requests
    cache_dir: Path | None = None  # None: $FUSEGEN_CACHE_DIR or ~/.cache/fusegen
    hf_static: bool = True
    hf_continuous: bool = True
    # The transformers baselines run the first hf_requests requests (None: all), so that
    # a long workload finishes; their rates are per token of those requests.
    hf_requests: int | None = None
    engine_options: dict = field(default_factory=dict)  # extra LLM(...) knobs for fusegen
    deterministic_too: bool = False  # fusegen a second time, deterministic=True
    structured: str = "none"  # "half": fusegen again, every other request JSON-constrained
    prefix_caching: str = "on"  # fusegen's; "both": on, then again off
    vllm_python: str | None = None  # vLLM's interpreter (its own environment); None: no vLLM row
    vllm_timeout: float = 3600.0  # seconds for vLLM's whole run, its start included
    # llama.cpp's tools folder (llama-server, llama-batched-bench); None: no llama.cpp row.
    # Runs on the model's own GGUF file, so the model must be one.
    llamacpp: Path | None = None
    llamacpp_timeout: float = 3600.0  # seconds for llama.cpp's whole run, its load included
    # fusegen again on the model pruned to each sparsity (jobs/bench/sparse.py), with
    # each of sparse_values ("bfloat16", "int8"); () : no sparse runs
    sparsities: tuple[float, ...] = ()
    sparse_values: tuple[str, ...] = ("bfloat16",)
    sparse_method: str = "magnitude"

    def __post_init__(self):
        if self.prefix_caching not in ("on", "off", "both"):
            raise ValueError(f"--prefix-caching must be on, off or both; got "
                             f"{self.prefix_caching!r}")
        self.engine_options = {**self.engine_options,
                               "enable_prefix_caching": self.prefix_caching != "off"}
        if self.model is None and self.preset.default_model is not None:
            self.model = resolve_bench_model(self.preset.default_model)
        if self.model is None and self.preset.prompts == "chat":
            raise ValueError(f"preset {self.preset.name} prompts through a chat template: "
                             "pass a real model with --model")
        if self.dtype is None:
            self.dtype = self.preset.run_dtype or self.shape.dtype
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            from fusegen.engine.memory.device import resolve_dtype

            self.dtype = str(on_a_passing_thread(resolve_dtype, "auto", self.device)
                             ).removeprefix("torch.")
        if self.dtype not in flops.DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {', '.join(flops.DTYPE_BYTES)}; got {self.dtype!r}")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.cache_dir is None:
            self.cache_dir = default_cache_dir()
        if self.preset.num_requests < 1:
            raise ValueError(f"--requests must be at least 1; got {self.preset.num_requests}")
        if self.preset.model.num_layers < 1:
            raise ValueError(f"--layers must be at least 1; got {self.preset.model.num_layers}")
        if self.preset.hf_batch_size < 1:
            raise ValueError(f"--hf-batch-size must be at least 1; got {self.preset.hf_batch_size}")
        if self.hf_requests is not None and not 1 <= self.hf_requests <= self.preset.num_requests:
            raise ValueError(
                f"--hf-requests {self.hf_requests} must be between 1 and --requests "
                f"{self.preset.num_requests}: the transformers baselines run the first "
                "--hf-requests of the bench's requests")
        if self.vllm_timeout <= 0:
            raise ValueError(f"--vllm-timeout must be positive; got {self.vllm_timeout}")
        if self.llamacpp is not None:
            self._check_llamacpp()
        if self.sparsities:
            self._check_sparse()
        self._check_context()

    def _check_context(self) -> None:
        """The longest request must fit the model's positions and fusegen's max_model_len."""
        preset = self.preset
        parts = [(preset.shared_prefix_len, "shared prefix")] if preset.shared_prefix_len else []
        parts += [(preset.prompt_len.high, "prompt"), (preset.output_len.high, "output")]
        longest = sum(n for n, _ in parts)
        what = (f"workload {preset.workload}'s" if preset.workload else
                f"preset {preset.name}'s") + f" requests reach {longest} positions"
        sizes = " + ".join(f"{n} {part}" for n, part in parts) + " tokens"
        if self.model is not None and longest > self.shape.max_position_embeddings:
            raise ValueError(
                f"{what} but {self.model.source} has max_position_embeddings "
                f"{self.shape.max_position_embeddings} ({sizes}); run a preset or workload "
                "with shorter requests, or a model with a longer context")
        max_model_len = self.engine_options.get("max_model_len")
        if max_model_len is not None and longest > max_model_len:
            raise ValueError(f"{what} but --max-model-len is {max_model_len} ({sizes}); "
                             f"raise it to at least {longest}")

    def _check_llamacpp(self) -> None:
        from fusegen.jobs.bench.llamacpp_runner import choose_tool

        if self.model is None or not self.model.gguf:
            what = (f"preset {self.preset.name} runs a random safetensors checkpoint"
                    if self.model is None else f"--model {self.model.source} is not a GGUF file")
            raise ValueError(f"--llamacpp runs llama.cpp on the model's GGUF file, but {what}; "
                             "pass --model FILE.gguf (or smollm2)")
        if self.llamacpp_timeout <= 0:
            raise ValueError(f"--llamacpp-timeout must be positive; got {self.llamacpp_timeout}")
        self.llamacpp = Path(self.llamacpp).expanduser()
        fixed = self.preset.shared_prefix_len == 0 and all(
            d.low == d.high for d in (self.preset.prompt_len, self.preset.output_len))
        choose_tool(self.llamacpp, fixed)  # ValueError naming the folder and the setup script

    def _check_sparse(self) -> None:
        from fusegen.jobs.bench.sparse import variants

        for share in self.sparsities:
            if not 0 < share < 1:
                raise ValueError(f"--sparsity {share} is outside (0, 1): it is the share of "
                                 "each row's weights pruned, such as 0.7 for 70%")
        variants(self.sparsities, self.sparse_values, self.sparse_method)  # names checked
        if int(self.engine_options.get("tensor_parallel_size") or 1) \
                * int(self.engine_options.get("pipeline_parallel_size") or 1) > 1:
            raise ValueError("--sparsity measures the layers one process holds; run it "
                             "without --tensor-parallel-size / --pipeline-parallel-size")

    @property
    def sparse_variants(self) -> list:
        from fusegen.jobs.bench.sparse import variants

        return variants(self.sparsities, self.sparse_values, self.sparse_method) \
            if self.sparsities else []

    @property
    def shape(self) -> PresetModel:
        """The shape FLOPs and bytes are counted over: the real model's, or the preset's."""
        return self.preset.model if self.model is None else self.model.shape


def workload_for(config: BenchConfig) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(the timed requests, a few short warm-up requests drawn apart from them). Chat
    prompts are templated and tokenized here, once, outside every timed run."""
    preset, vocab = config.preset, config.shape.vocab_size
    if preset.prompts == "chat":
        requests = make_chat_workload(load_tokenizer(config.model), preset.num_requests,
                                      preset.prompt_len, preset.output_len, seed=config.seed)
    else:
        requests = make_workload(preset.num_requests, preset.prompt_len, preset.output_len,
                                 vocab, seed=config.seed, shared_prefix_len=preset.shared_prefix_len)
    warmup = make_workload(2, LengthDist("uniform", 4, 16), LengthDist("uniform", 2, 4), vocab,
                           seed=config.seed + 1_000_003)
    limit = config.shape.max_position_embeddings
    if max_context(requests) > limit:
        fix = ("raise it in the preset" if config.model is None else
               "run a preset with shorter requests, or a model with a longer context")
        raise ValueError(f"preset {preset.name}: a request needs {max_context(requests)} positions "
                         f"but the model has max_position_embeddings {limit}; {fix}")
    return requests, warmup


def run_benchmark(config: BenchConfig, progress: Progress = lambda _: None) -> dict:
    preset, shape = config.preset, config.shape
    requests, warmup = workload_for(config)
    kind = "chat prompts" if preset.prompts == "chat" else "prompts"
    named = f" {preset.workload}" if preset.workload else ""
    progress(f"workload{named}: {len(requests)} requests, {kind} {preset.prompt_len.describe()}, "
             f"outputs {preset.output_len.describe()} (seed {config.seed})")
    # torch work of the bench's own runs on passing threads (engine/host.py): no OpenMP
    # team is left on the main thread beside fusegen's engine
    model = config.model or random_model(shape, on_a_passing_thread(
        ensure_checkpoint, preset.name, shape, config.cache_dir, progress))
    if config.model is not None:
        where = "" if str(model.path) == model.source else f" ({model.path})"
        progress(f"model: {model.source}{where}: {shape.num_layers} layers, hidden "
                 f"{shape.hidden_size}, vocab {shape.vocab_size}")
    model_dir = model.path
    sparse_dirs = _sparse_checkpoints(config, model_dir, progress)  # before any timed run

    progress(f"ceiling: measuring matmul FLOP/s and memory bandwidth on {config.device}")
    dtypes = tuple(dict.fromkeys(("bfloat16", "float32", config.dtype)))
    ceiling = on_a_passing_thread(measure_ceiling, config.device, dtypes,
                                  quick=preset.quick_ceiling)

    budgets = _offload_budgets(config, model_dir, requests, progress) if preset.offload else {}
    engine_options = {k: v for k, v in budgets.items() if not k.startswith("_")}
    progress(f"fusegen: loading the model ({config.dtype} on {config.device})")
    results = [_fusegen(model_dir, requests, warmup, dtype=config.dtype, device=config.device,
                        engine_options={**config.engine_options, **engine_options},
                        progress=progress)]
    _done(results[-1], progress)
    if config.deterministic_too:
        _release_memory(config.device)
        progress("fusegen: again in deterministic (batch-invariant) mode")
        results.append(_fusegen(
            model_dir, requests, warmup, dtype=config.dtype, device=config.device,
            engine_options={**config.engine_options, **engine_options, "deterministic": True},
            progress=progress, name="fusegen_deterministic", label="fusegen deterministic"))
        _done(results[-1], progress)
    if config.structured == "half":
        from fusegen.jobs.bench.fusegen_runner import LABEL_SCHEMA

        _release_memory(config.device)
        progress("fusegen: again with every other request constrained by a JSON schema")
        results.append(_fusegen(
            model_dir, requests, warmup, dtype=config.dtype, device=config.device,
            engine_options={**config.engine_options, **engine_options}, progress=progress,
            name="fusegen_structured_half", label="fusegen, half JSON schema",
            schema=LABEL_SCHEMA))
        _done(results[-1], progress)
    if config.prefix_caching == "both":
        results.append(_fusegen_again(
            config, (model_dir, requests, warmup), progress, "with prefix caching off",
            {**engine_options, "enable_prefix_caching": False},
            name="fusegen_no_prefix_cache", label="fusegen, no prefix cache"))
    # the pruned checkpoints run as their tiles: --quantization is the dense run's
    sparse_options = {k: v for k, v in {**config.engine_options, **engine_options}.items()
                      if k != "quantization"}
    for variant, path in sparse_dirs.items():
        _release_memory(config.device)
        progress(f"fusegen: again on {path.name}")
        results.append(_fusegen(path, requests, warmup, dtype=config.dtype,
                                device=config.device, engine_options=sparse_options,
                                progress=progress, name=variant.name, label=variant.label))
        results[-1].extra["checkpoint"] = str(path)
        _done(results[-1], progress)
    _release_memory(config.device)  # fusegen's weights and KV pool, before vLLM and transformers
    results += _run_llamacpp(config, model, requests, warmup, ceiling.num_threads,
                             results[0], progress)
    hf_on = config.hf_static or config.hf_continuous
    needs_dir = hf_on or (config.vllm_python is not None and not preset.offload)
    hf_dir = baseline_dir(model, config.dtype, config.cache_dir, progress) if needs_dir \
        else model_dir
    results += _run_vllm(config, hf_dir, requests, warmup, progress)
    load = {"fusegen_s": results[0].load_s, "transformers_s": None}
    if model.gguf and hf_on:
        load |= _time_hf_gguf_load(config, model, progress)
    hf_requests = requests[:config.hf_requests]  # None: all
    if preset.offload:
        results += _run_offload_baseline(config, hf_dir, hf_requests, warmup, budgets, progress)
    else:
        results += _run_baselines(config, hf_dir, hf_requests, warmup, progress)

    for result in results:
        if result.skipped is None:
            result.model_flops = flops.workload_flops(shape, result.counts)
    return build_report(config, model, hf_dir, requests, ceiling, results,
                        load if model.gguf else None)


class SparseSourceError(ValueError):
    """The model cannot be pruned for --sparsity (sparsify refused it): a usage error."""


def _sparse_checkpoints(config: BenchConfig, model_dir: Path, progress: Progress) -> dict:
    """Each sparse variant's checkpoint directory (cached), written before any timed run
    so that a source sparsify refuses fails first."""
    from fusegen.engine.weights.quantize_spec import QuantizeError
    from fusegen.jobs.bench.checkpoint import ensure_sparse_checkpoint
    from fusegen.jobs.bench.sparse import VALUES

    out = {}
    for variant in config.sparse_variants:
        try:
            out[variant] = on_a_passing_thread(
                ensure_sparse_checkpoint, model_dir, variant.sparsity, VALUES[variant.values],
                variant.method, config.cache_dir, progress)
        except QuantizeError as exc:
            raise SparseSourceError(f"--sparsity: {model_dir} cannot be pruned: {exc}") from None
    return out


def _fusegen_again(config: BenchConfig, run: tuple, progress: Progress, what: str,
                   engine_options: dict, **kwargs) -> EngineResult:
    """fusegen once more on the same (model_dir, requests, warmup), `what` told apart."""
    _release_memory(config.device)
    progress(f"fusegen: again {what}")
    result = _fusegen(*run, dtype=config.dtype, device=config.device, progress=progress,
                      engine_options={**config.engine_options, **engine_options}, **kwargs)
    _done(result, progress)
    return result


def _time_hf_gguf_load(config: BenchConfig, model: BenchModel, progress: Progress) -> dict:
    """Seconds transformers' own GGUF loader takes for the file (one load, then freed:
    the baselines run the export, which loads in a fraction of that), or why it failed."""
    from transformers import AutoModelForCausalLM  # noqa: F401 - imported before the clock

    from fusegen.jobs.bench.hf_static import load_hf_model

    progress(f"transformers: loading {model.path.name} with its GGUF loader (timed once)")
    start = time.perf_counter()
    try:
        loaded = load_hf_model(model.path.parent, config.dtype, config.device,
                               gguf_file=model.path.name)
    except Exception as exc:  # noqa: BLE001 - its loader's refusal is a figure, not the bench's end
        progress(f"transformers: its GGUF loader failed: {type(exc).__name__}: {exc}")
        return {"transformers_error": f"{type(exc).__name__}: {exc}"}
    seconds = time.perf_counter() - start
    del loaded
    _release_memory(config.device)
    progress(f"transformers: GGUF load took {seconds:.2f}s")
    return {"transformers_s": seconds}


def _fusegen(*args, **kwargs) -> EngineResult:
    """run_fusegen, with the process's peak RSS over its load and run (the high-water
    mark reset before it; Linux), None where it cannot be read."""
    from fusegen.jobs.bench.fusegen_runner import run_fusegen

    measured = _reset_peak_rss()
    result = run_fusegen(*args, **kwargs)
    result.peak_rss_bytes = _peak_rss() if measured else None
    return result


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found[1]) * 1024 if found else None


def _run_llamacpp(config: BenchConfig, model: BenchModel, requests, warmup, threads: int,
                  fusegen: EngineResult, progress: Progress) -> list[EngineResult]:
    """llama.cpp on the same GGUF file, with fusegen's threads and as many sequences at
    once as fusegen ran (its max_num_seqs)."""
    if config.llamacpp is None:
        return []
    from fusegen.jobs.bench.llamacpp_runner import run_llamacpp

    log_path = _peer_log(config, "llamacpp")
    slots = fusegen.extra.get("max_num_seqs") or config.engine_options.get("max_num_seqs") \
        or len(requests)
    result = run_llamacpp(config.llamacpp, model.path, requests, warmup, threads=threads,
                          slots=slots, prefix_caching=config.prefix_caching != "off",
                          log_path=log_path, timeout_s=config.llamacpp_timeout,
                          progress=progress)
    return [_peer_done(result, "llama.cpp", progress)]


def _run_vllm(config: BenchConfig, model_dir: Path, requests, warmup,
              progress: Progress) -> list[EngineResult]:
    """vLLM in its own interpreter and process: nothing of it stays in this one's memory."""
    if config.vllm_python is None:
        return []
    if config.preset.offload:
        return [EngineResult("vllm", "vLLM",
                             skipped="skipped: vLLM has no comparable offload mode")]
    from fusegen.jobs.bench.vllm_runner import run_vllm

    result = run_vllm(config.vllm_python, model_dir, requests, warmup, dtype=config.dtype,
                      device=config.device, seed=config.seed,
                      log_path=_peer_log(config, "vllm"),
                      max_model_len=config.shape.max_position_embeddings,
                      max_num_seqs=config.engine_options.get("max_num_seqs"),
                      timeout_s=config.vllm_timeout, progress=progress)
    return [_peer_done(result, "vllm", progress)]


def _peer_log(config: BenchConfig, peer: str) -> Path:
    """Where a peer engine's own output goes: a file per run under the cache."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(config.cache_dir) / "bench" / "logs" / f"{peer}-{config.preset.name}-{stamp}.log"


def _peer_done(result: EngineResult, peer: str, progress: Progress) -> EngineResult:
    """A peer engine's figures told, or why it did not run (the bench goes on)."""
    if result.skipped is None:
        _done(result, progress)
    else:
        progress(f"{peer}: {result.skipped}")
    return result


def _run_baselines(config: BenchConfig, model_dir: Path, requests, warmup,
                   progress: Progress) -> list[EngineResult]:
    batch_size = config.preset.hf_batch_size
    static = EngineResult("hf_static", f"hf generate, static bs {batch_size}")
    continuous = EngineResult("hf_continuous", "hf continuous batching")
    if not (config.hf_static or config.hf_continuous):
        static.skipped = continuous.skipped = "skipped (--skip-hf)"
        return [static, continuous]

    from fusegen.jobs.bench.hf_continuous import continuous_batching_missing, run_hf_continuous
    from fusegen.jobs.bench.hf_static import load_hf_model, run_hf_static

    progress(f"transformers: loading the model ({config.dtype} on {config.device})")
    start = time.perf_counter()
    model = load_hf_model(model_dir, config.dtype, config.device)
    load_s = time.perf_counter() - start  # one load serves both baselines
    if config.hf_static:
        progress(f"hf static: generating {len(requests)} requests in batches of {batch_size}")
        static = run_hf_static(model, requests, warmup, batch_size=batch_size,
                               device=config.device, progress=progress)
        _done(static, progress)
    else:
        static.skipped = "skipped (--skip-hf-static)"
    missing = continuous_batching_missing(model)
    if not config.hf_continuous:
        continuous.skipped = "skipped (--skip-hf-continuous)"
    elif missing:
        continuous.skipped = missing
        progress(f"hf continuous: {missing}")
    else:
        progress(f"hf continuous: generating {len(requests)} requests")
        continuous = run_hf_continuous(model, requests, warmup, device=config.device,
                                       progress=progress)
        _done(continuous, progress)
    del model
    _release_memory(config.device)
    for result in (static, continuous):
        result.load_s = load_s if result.skipped is None else 0.0
    return [static, continuous]


def _offload_budgets(config: BenchConfig, model_dir: Path, requests: list[BenchRequest],
                     progress: Progress) -> dict:
    """The preset's device and host budgets in bytes, and the batch limits they were
    planned with (pinned, so the engine plans alike). A budget stated as a share of
    resident layers also holds the KV cache of the whole workload at full length, so
    the run measures streamed weights, not a starved KV pool."""
    from fusegen.engine.config import PlanInputs
    from fusegen.engine.memory.placement import budget_for_resident_layers, parse_bytes
    from fusegen.engine.memory.plan import batch_limits, model_sizes, plan_engine
    from fusegen.engine.options import EngineOptions

    spec = config.preset.offload
    options = EngineOptions(dtype=config.dtype, device=config.device, **config.engine_options)
    inputs = PlanInputs.gather(model_dir, options)  # what the engine itself will plan over
    # The batch limits the engine uses once layers stream, and the sizes under them.
    limits = batch_limits(options, inputs.free.on_gpu, streaming=True)
    sizes = model_sizes(options, inputs.shape, limits, options.max_model_len
                        or inputs.model_config.max_position_embeddings)
    host_memory = parse_bytes(spec.host_memory, name="host_memory")
    kv_reserve = None
    if spec.device_memory is not None:
        device_memory = parse_bytes(spec.device_memory, name="device_memory")
    else:
        block = options.block_size
        running = requests[:limits[0]]
        kv_reserve = sizes.kv_block_bytes * sum(
            -(-(r.num_prompt_tokens + r.max_tokens) // block) for r in running)
        resident = int(spec.resident_fraction * sizes.num_layers)
        device_memory = budget_for_resident_layers(sizes, resident, kv_reserve=kv_reserve)
    budgets = {"device_memory": device_memory, "host_memory": host_memory,
               "kv_cache_memory": kv_reserve, "max_num_seqs": limits[0],
               "max_num_batched_tokens": limits[1]}
    # The engine's own plan under these budgets: what it will do, not a second guess.
    plan = plan_engine(dataclasses.replace(options, **budgets), inputs.shape,
                       inputs.free).placement
    progress(f"offload: device budget {device_memory / 2**20:,.0f} MiB, host budget "
             f"{host_memory / 2**20:,.0f} MiB; the plan keeps "
             f"{plan.layer_tiers.count('device')}/{sizes.num_layers} layers on the device")
    return {**budgets,
            # accelerate has no KV cache manager and no activation reserve: its device
            # budget is what fusegen's plan gives weights (resident layers + staging).
            "_baseline_device_memory": plan.device_bytes["weights"] + plan.device_bytes["staging"]}


def _run_offload_baseline(config: BenchConfig, model_dir: Path, requests, warmup, budgets: dict,
                          progress: Progress) -> list[EngineResult]:
    from fusegen.jobs.bench.hf_offload import load_offloaded_model, run_hf_offload

    batch_size = config.preset.hf_batch_size
    if not (config.hf_static or config.hf_continuous):
        result = EngineResult("hf_offload", f"hf accelerate offload, static bs {batch_size}")
        result.skipped = "skipped (--skip-hf)"
        return [result]
    progress("transformers + accelerate: loading the model with device_map offload")
    start = time.perf_counter()
    model = load_offloaded_model(model_dir, config.dtype, config.device,
                                 budgets["_baseline_device_memory"], budgets["host_memory"])
    load_s = time.perf_counter() - start
    progress(f"hf offload: generating {len(requests)} requests in batches of {batch_size}")
    result = run_hf_offload(model, requests, warmup, batch_size=batch_size, device=config.device,
                            device_memory=budgets["_baseline_device_memory"], progress=progress)
    result.load_s = load_s
    _done(result, progress)
    del model
    _release_memory(config.device)
    return [result]


def _release_memory(device: str) -> None:
    """Give back what the last engine held (its objects, the CUDA cache) before the next."""
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _done(result: EngineResult, progress: Progress) -> None:
    note = "" if result.budgets_met else " -- WARNING: output counts differ from the budgets"
    progress(f"{result.label}: {result.num_output_tokens} output tokens in "
             f"{result.elapsed_s:.2f}s{note}")
