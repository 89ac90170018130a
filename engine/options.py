"""The engine's settings, listed once.

`EngineOptions` is what a user may set on an engine. `LLM(model, **options)`, a job's
engine keys (the job file and `JobSpec`), the `fusegen run` / `fusegen bench` flags and
their --help text all come from these fields and their help. Checks here are the ones
that need neither the model nor the machine; what follows from them (the batch limits,
where weights and KV blocks live) is worked out by `engine.memory.plan.plan_engine`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.placement import parse_bytes

DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's (and torch's) other names for them: read as fusegen's, so a job records one name.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16",
                 "fp32": "float32"}
# vLLM's `quantization=` keyword: None (the checkpoint's own form), and the forms fusegen
# runs; engine/config.py checks each against the model and device before anything loads.
QUANTIZATIONS = (None, "dequantize", "gguf", "int8", "int4", "fp8")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
KV_PLACEMENTS = ("auto", "device", "cooperative")  # engine/memory/kv_split.py
TP_MODES = ("1d", "2d", "2.5d")  # engine/parallel/tesseract.py: the 2d / 2.5d grid


def option(default, help: str, *, kind: type = str, unset: str = "none",
           affects_output: bool = False):
    """A field with its help text. `kind`: how a command line reads it (int, bool or
    str: sizes and names are read as text). `unset`: what None means, for --help.
    `affects_output`: a different value can give different tokens, so a job run with
    another value is another job."""
    return field(default=default, metadata={"help": help, "kind": kind, "unset": unset,
                                            "affects_output": affects_output})


@dataclass(slots=True, kw_only=True)
class EngineOptions:
    dtype: str = option(
        "auto", "Weights dtype: auto, float32, bfloat16, float16 (auto: bf16 on GPUs and on "
        "CPUs with bf16 units by their flags (AMX, AVX512_BF16), fp32 elsewhere; a job "
        "records the dtype it resolved to and resumes only in it). vLLM's half and float "
        "are read as float16 and float32.",
        affects_output=True)
    device: str = option("auto", "Engine device: auto, cpu, cuda, cuda:N, or for a device "
                         "group one GPU per rank, cuda:0,1,... (auto: cuda when present).")
    max_num_seqs: int | None = option(
        None, "Running requests per step at most.", kind=int,
        unset="from the machine; larger when layers stream")
    max_num_batched_tokens: int | None = option(
        None, "Tokens per step at most.", kind=int,
        unset="from the machine; larger when layers stream")
    # Attention sums a row's keys block by block: the block size is part of the result.
    block_size: int = option(16, "Tokens per KV cache block (a power of two up to 128).",
                             kind=int, affects_output=True)
    kv_cache_memory: int | str | None = option(
        None, "Bytes (or a size like 16GiB) for the KV cache; with --device-memory, the KV "
        "share kept before layers are placed.",
        unset="from free memory; a quarter of the room under --device-memory")
    num_kv_blocks: int | None = option(
        None, "Exact number of device KV blocks (overrides --kv-cache-memory).", kind=int,
        unset="from the KV cache memory")
    max_model_len: int | None = option(
        None, "Context length limit; longer prompts become errors.", kind=int,
        unset="the model's", affects_output=True)
    allow_pickle: bool = option(
        False, "Load pickle checkpoints (*.bin, *.pt) with torch.load(weights_only=True); "
        "pickle files can run code.", kind=bool)
    seed: int = option(0, "Seed of the engine-wide generator that requests without a seed "
                       "of their own sample from.", kind=int)
    device_memory: int | str | float | None = option(
        None, "Memory pool: device budget (bytes, a size like 24GiB, or a fraction of free "
        "memory); layers that do not fit stream from host or disk. On a CPU a fraction is a "
        "cap, not a share to fill: the KV pool holds what max_num_seqs requests at "
        "max_model_len can use, at most what it takes with no budget (30% of available "
        "memory), and no host swap pool is set aside unasked.", unset="no limit")
    host_memory: int | str | float | None = option(
        None, "Memory pool: pinned host budget for streamed layers and swapped KV blocks "
        "(same forms).", unset="half of free host memory when --device-memory is set")
    peer_memory: int | str | float | None = option(
        None, "Memory pool: a device group's peer tier, per rank: bytes of its layers that "
        "the group's other ranks hold in the memory their own budgets leave free, fetched "
        "ahead of use (same forms; tried before host memory).", unset="none")
    prefetch_depth: int = option(1, "Memory pool: streamed layers copied ahead of compute.",
                                 kind=int)
    deterministic: bool = option(
        False, "Batch-invariant mode: a request's tokens are bit-identical whatever it is "
        "batched with, however its prompt is chunked, across preemption and resume "
        "(fixed reduction orders in matmuls and attention; costs throughput).", kind=bool,
        affects_output=True)
    num_host_kv_blocks: int | None = option(
        None, "Exact number of host KV blocks that preempted requests swap to.", kind=int,
        unset="as many as the device pool")
    kv_placement: str = option(
        "auto", "Where a running batch's KV blocks live: device (on the device; requests that "
        "do not fit are swapped out whole or recomputed), cooperative (each request's first "
        "blocks on the device, the rest in the host KV pool, attention over those computed "
        "on the host's cores and merged exactly; needs host KV blocks), auto (cooperative "
        "when max_num_seqs requests at max_model_len do not fit the device's blocks and "
        "there are host KV blocks, on CPUs outside deterministic mode).")
    # A cached block holds what the request would compute as a prompt chunk of its own
    # (bit for bit in deterministic mode): not part of a job's identity.
    enable_prefix_caching: bool = option(
        True, "Prefix caching: a prompt reuses the KV blocks of the full blocks of tokens "
        "another request already computed (a shared instruction is computed once); freed "
        "blocks stay cached until their memory is needed.", kind=bool)
    # A recorded decode step runs its batch padded to a bucket size, which, like another
    # batch composition, may pick another matmul kernel: not part of a job's identity.
    enforce_eager: bool = option(
        False, "Run every step op by op: no recorded decode steps. On GPUs those are CUDA "
        "graphs (a step's kernels replayed with one launch; deterministic mode never uses "
        "them); on CPUs, CPU graphs of steps of up to 16 rows (a step's C kernel calls "
        "replayed without the Python around them). Streamed layers and MoE models never "
        "use either.", kind=bool)
    # The same tokens either way (a request that stops runs one extra token, discarded):
    # not part of a job's identity.
    async_scheduling: bool | None = option(
        None, "Prepare the next step (schedule it, build its inputs) while this one runs: "
        "a request's next input id is the sampled id the device still holds; requests "
        "with structured output, logits processors, logprobs or prompt logprobs wait for "
        "their previous token (engine/llm_engine.py).", kind=bool,
        unset="off (measured slower on a GPU and no faster on CPUs); never in device groups")
    # Another revision is other weights: part of a job's identity.
    revision: str | None = option(
        None, "Hub revision (branch, tag or commit) of a model named by its hub id "
        "(org/name); an error for a local path.", unset="main", affects_output=True)
    # Another tokenizer makes other tokens of the same text: part of a job's identity.
    tokenizer: str | None = option(
        None, "Tokenizer to use instead of the model's: a checkpoint directory holding "
        "tokenizer.json, a .gguf file, or a hub id (org/name).", unset="the model's",
        affects_output=True)
    # Compressed weights are summed in another order than dense ones: part of a job's
    # identity. A job's unset value stays "dequantize" (jobs/spec.py), as its outputs
    # were made before None kept a GGUF file's blocks.
    quantization: str | None = option(
        None, "Form the weights run in. None: the checkpoint's own (a fusegen int8/int4 "
        "checkpoint runs compressed; a GGUF file keeps its linears' blocks where a kernel on "
        "the device takes their type - C on CPUs, Triton on CUDA GPUs - dequantizing the "
        "rest; a Hugging Face FP8 checkpoint runs in FP8 on GPUs of compute capability "
        "8.9+); dequantize: every weight expanded to the run's dtype as it loads; gguf: a "
        "GGUF file's blocks (CPUs; CUDA GPUs with Triton); int8 / int4: fusegen's group "
        "codes (a 16-bit checkpoint is quantized on load: round to nearest, symmetric, "
        "groups of 128 input channels); fp8: quantized on load to FP8 (CUDA, compute "
        "capability 8.9+). Norms stay dense; the embedding and LM head too, except a GGUF "
        "file's on CPUs.",
        unset="the checkpoint's own form; in a job, dequantize for GGUF files",
        affects_output=True)

    # Another split sums the row-parallel matmuls in another order: part of a job's identity.
    tensor_parallel_size: int = option(
        1, "Device group: ranks that split every layer (1-D tensor parallelism: heads and "
        "MLP rows), one process each; on GPUs one GPU each, on CPUs a share of the cores.",
        kind=int, affects_output=True)
    # Stages run whole layers: the same sums, bit for bit.
    pipeline_parallel_size: int = option(
        1, "Device group: stages that split the layers (pipeline parallelism, up to this "
        "many batches in flight), each stage tensor_parallel_size ranks.", kind=int)
    # The grid sums each linear's partial products in another order than 1-D: part of a
    # job's identity.
    tensor_parallel_mode: str = option(
        "1d", "Device group: how tensor_parallel_size ranks split each layer: 1d (heads and "
        "MLP rows, two all-reduces a layer), 2d (a [q, q] grid, each rank a q x q block of "
        "every weight: tensor_parallel_size = q x q) or 2.5d (a [q, q, d] grid: d such "
        "layers, each its share of the batch's sequences; tensor_parallel_size = q x q x "
        "tesseract_depth). docs/parallel_modes.md says which wins where.",
        affects_output=True)
    tesseract_depth: int = option(
        1, "Device group, tensor_parallel_mode 2.5d: d, the grid's depth (2d is depth 1).",
        kind=int, affects_output=True)
    collective_timeout: int = option(
        300, "Device group: seconds a rank may take to start or to answer a step before "
        "the group is declared failed (its requests fail with device_group_failed).",
        kind=int)
    # Chunks split a step's rows, and a BLAS may sum a smaller call's rows another way.
    tp_overlap_chunks: int = option(
        1, "Device group (tensor_parallel_size > 1): split each layer's o projection and "
        "MLP into this many chunks of the step's tokens and start each chunk's all-reduce "
        "while the next chunk computes (1: one all-reduce after the whole matmul).",
        kind=int, affects_output=True)

    def __post_init__(self):
        if isinstance(self.dtype, str):
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise EngineConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        device = self.device
        if not isinstance(device, str) or not (
                device in ("auto", "cpu", "cuda")
                or (device.startswith("cuda:")
                    and all(i.isdigit() for i in device[5:].split(",")))):
            raise EngineConfigError(f"device must be auto, cpu, cuda, cuda:N or cuda:N,M,...; "
                                    f"got {device!r}")
        if isinstance(self.kv_cache_memory, str):  # a size like "16GiB"
            self.kv_cache_memory = _parse(self.kv_cache_memory, None, "kv_cache_memory")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                     "num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_int(self, name, 1)
        _check_int(self, "prefetch_depth", 1)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "collective_timeout",
                     "tp_overlap_chunks"):
            _check_int(self, name, 1)
        _check_int(self, "tesseract_depth", 1)
        if self.tensor_parallel_mode not in TP_MODES:
            raise EngineConfigError(f"tensor_parallel_mode must be one of "
                                    f"{', '.join(TP_MODES)}; got {self.tensor_parallel_mode!r}")
        if self.tesseract_depth > 1 and self.tensor_parallel_mode != "2.5d":
            raise EngineConfigError(
                f"tesseract_depth {self.tesseract_depth} needs tensor_parallel_mode '2.5d' "
                f"(got {self.tensor_parallel_mode!r}; '2d' is depth 1)")
        self._check_seed()
        if self.num_host_kv_blocks is not None:
            _check_int(self, "num_host_kv_blocks", 0)
        blocks = {n: getattr(self, n) for n in ("num_kv_blocks", "num_host_kv_blocks")
                  if getattr(self, n) is not None}
        if sum(blocks.values()) > MAX_KV_BLOCKS:
            raise EngineConfigError(
                f"{' + '.join(f'{n} {v}' for n, v in blocks.items())} is past the "
                f"{MAX_KV_BLOCKS} KV blocks a block table can number (int32 ids, the "
                "host pool's after the device's)")
        if self.kv_placement not in KV_PLACEMENTS:
            raise EngineConfigError(f"kv_placement must be one of {', '.join(KV_PLACEMENTS)}; "
                                    f"got {self.kv_placement!r}")
        if self.block_size not in BLOCK_SIZES:
            raise EngineConfigError(f"block_size must be a power of two up to 128; "
                                    f"got {self.block_size!r}")
        for name in ("allow_pickle", "deterministic", "enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise EngineConfigError(f"{name} must be true or false; got "
                                        f"{getattr(self, name)!r}")
        if not (self.async_scheduling is None or isinstance(self.async_scheduling, bool)):
            raise EngineConfigError(f"async_scheduling must be true, false or unset (auto); "
                                    f"got {self.async_scheduling!r}")
        if self.revision is not None and (not isinstance(self.revision, str)
                                          or not self.revision):
            raise EngineConfigError(f"revision must be a branch, tag or commit name; got "
                                    f"{self.revision!r}")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str)
                                           or not self.tokenizer):
            raise EngineConfigError(f"tokenizer must be a path or a hub id (org/name); got "
                                    f"{self.tokenizer!r}")
        for name in ("device_memory", "host_memory", "peer_memory"):
            if getattr(self, name) is not None:  # a typo fails before any model loads
                _parse(getattr(self, name), 1, name)
        if self.peer_memory is not None and self.tensor_parallel_size \
                * self.pipeline_parallel_size == 1:
            raise EngineConfigError(
                f"peer_memory {self.peer_memory!r} needs a device group: peers are the other "
                "ranks of one, and tensor_parallel_size x pipeline_parallel_size is 1 x 1; "
                "set one of them above 1, or use host_memory")
        self._check_group()
        self._check_quantization()

    def _check_group(self) -> None:
        """A device group's refusals that need no model, here so that a job or an `LLM`
        fails before it starts processes or writes its output (parallel/plan.py's
        `check_grid` and the engine's async check repeat them with the model in hand)."""
        if self.tp_overlap_chunks > 1 and self.tensor_parallel_size == 1:
            raise EngineConfigError(
                f"tp_overlap_chunks {self.tp_overlap_chunks} splits the all-reduces of a "
                "tensor-parallel group, and tensor_parallel_size is 1; set "
                "tensor_parallel_size above 1, or leave tp_overlap_chunks at 1")
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.async_scheduling and ranks > 1:
            raise EngineConfigError(
                f"async_scheduling=True cannot run in a device group (tensor_parallel_size "
                f"{self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size}): it keeps its own batches in flight; leave "
                "async_scheduling unset or false")
        mode = self.tensor_parallel_mode
        if mode == "1d":
            return
        from fusegen.engine.parallel.tesseract import tesseract_grid

        try:
            tesseract_grid(self.tensor_parallel_size, self.tesseract_depth)
        except ValueError as exc:
            raise EngineConfigError(f"tensor_parallel_mode {mode!r}: {exc}") from None
        if self.pipeline_parallel_size > 1:
            raise EngineConfigError(
                f"tensor_parallel_mode {mode!r} runs with pipeline_parallel_size 1 (got "
                f"{self.pipeline_parallel_size}): the grid splits every layer; use "
                "tensor_parallel_mode '1d' with stages")
        if self.peer_memory is not None:
            raise EngineConfigError(f"tensor_parallel_mode {mode!r} has no peer tier: leave "
                                    f"peer_memory ({self.peer_memory!r}) unset")

    def _check_quantization(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise EngineConfigError(
                f"quantization={self.quantization!r}: fusegen does not run that; it runs "
                "None (the checkpoint's own form), 'dequantize' (every weight expanded as it "
                "loads), 'gguf' (a GGUF file's blocks, on CPUs and CUDA GPUs with Triton), 'int8' / "
                "'int4' (fusegen's group codes: its quantized checkpoints, or a 16-bit one "
                "quantized on load) and 'fp8' (Hugging Face FP8 checkpoints, or a 16-bit one "
                "quantized on load; CUDA GPUs of compute capability 8.9+); a checkpoint in "
                "another format converts with `fusegen quantize`")

    def _check_seed(self) -> None:
        _check_int(self, "seed", 0)

    @classmethod
    def from_kwargs(cls, options: dict) -> "EngineOptions":
        """`LLM(model, **options)`: fusegen's options, and the keywords of vLLM's
        `LLM(...)` that scripts pass: read as fusegen's where it has them (`ALIASES`),
        refused with the reason where it has not (`UNSUPPORTED`). Any other name is an
        error that lists the known ones."""
        return cls(**_from_vllm(options))


FIELDS = tuple(dataclasses.fields(EngineOptions))
NAMES = tuple(f.name for f in FIELDS)
OUTPUT_NAMES = tuple(f.name for f in FIELDS if f.metadata["affects_output"])


def _gpu_memory_utilization(value) -> dict:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise EngineConfigError(f"gpu_memory_utilization must be a fraction in (0, 1] of "
                                f"the free device memory; got {value!r}")
    return {"device_memory": float(value)}


# vLLM's names for what fusegen has under its own: each maps a value to fusegen's options.
ALIASES = {
    # vLLM's share of the GPU for weights, activations and KV cache: fusegen's device
    # budget, as a fraction of the free memory (on a CPU, a cap: engine/memory/plan.py).
    "gpu_memory_utilization": _gpu_memory_utilization,
}

# vLLM's options for what fusegen does not have: the value that asks for nothing (vLLM's
# default, accepted as a no-op), and what to do instead of any other.
UNSUPPORTED = {
    "trust_remote_code": (False, "fusegen runs its own code for each architecture it "
                                 "supports, never code from a checkpoint; leave it out"),
    "enable_lora": (False, "merge the adapter into the weights (peft's "
                           "merge_and_unload) and load the merged checkpoint"),
}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _is_bool(value) -> bool:
    return isinstance(value, bool)


# vLLM's options that ask for what fusegen does anyway: each name's accepted values (a
# test of the value, and how the error describes them) and why it changes nothing; any
# other value is refused with what to do instead.
NO_OPS = {
    "swap_space": (_is_number, "a number of GiB >= 0",
                   "vLLM's V1 engine swaps no KV blocks to the CPU either (it recomputes "
                   "preempted requests); fusegen's host KV pool is num_host_kv_blocks"),
    "disable_log_stats": (_is_bool, "true or false",
                          "fusegen's LLM logs no periodic engine stats; llm.stats() returns "
                          "them"),
    "enable_chunked_prefill": (lambda v: v is None or v is True, "True (or None)",
                               "fusegen always splits a prompt longer than "
                               "max_num_batched_tokens into chunks; to run each prompt in one "
                               "step, set max_num_batched_tokens to at least the longest "
                               "prompt's length instead"),
    "tokenizer_mode": (lambda v: v in ("auto", "hf"), "'auto' (or 'hf')",
                       "fusegen reads the model's tokenizer.json with the tokenizers library, "
                       "as vLLM's auto mode does; it has no slow or mistral tokenizer mode"),
    "kv_cache_dtype": (lambda v: v == "auto", "'auto'",
                       "fusegen keeps KV blocks in the dtype the model runs in"),
    "load_format": (lambda v: v in ("auto", "safetensors", "gguf"),
                    "'auto', 'safetensors' or 'gguf'",
                    "fusegen reads the format of the files the model path holds (pickle "
                    "files with allow_pickle=True)"),
}


def _from_vllm(options: dict) -> dict:
    """`options` with vLLM's names read as fusegen's; a name fusegen does not support,
    or a value of `UNSUPPORTED` or `NO_OPS` other than the ones that ask for nothing, is
    an error naming it."""
    out = {k: v for k, v in options.items() if k in NAMES}
    for name, value in options.items():
        if name in NAMES:
            continue
        if name in UNSUPPORTED:
            noop, instead = UNSUPPORTED[name]
            if value is not noop and value != noop:
                raise EngineConfigError(f"{name}={value!r}: fusegen does not support "
                                        f"{name}; {instead}")
        elif name in NO_OPS:
            accepts, values, why = NO_OPS[name]
            if not accepts(value):
                raise EngineConfigError(f"{name}={value!r}: fusegen accepts {name} only as "
                                        f"{values}, a no-op: {why}")
        elif name in ALIASES:
            _merge(out, ALIASES[name](value), name)
        else:
            raise EngineConfigError(
                f"{name}: fusegen does not support this engine option; the options are "
                f"{', '.join(NAMES)} (and vLLM's {', '.join(VLLM_NAMES)})")
    return out


# vLLM's keywords `LLM(...)` takes besides fusegen's own.
VLLM_NAMES = (*ALIASES, *NO_OPS, *UNSUPPORTED)


def describe_vllm() -> str:
    """vLLM's keywords that `LLM(...)` accepts, each with what it does here."""
    lines = ["    gpu_memory_utilization: read as device_memory, a fraction of the free "
             "device memory (on a CPU a cap: the KV pool is sized from max_num_seqs x "
             "max_model_len, never from the machine's whole memory)."]
    lines += [f"    {name} (only {values}): no-op; {why}."
              for name, (_, values, why) in NO_OPS.items()]
    lines += [f"    {name} (only {noop!r}): {instead}."
              for name, (noop, instead) in UNSUPPORTED.items()]
    return "vLLM's keywords:\n\n" + "\n".join(lines)


def _merge(out: dict, mapped: dict, alias: str) -> None:
    for name, value in mapped.items():
        if out.get(name) is not None:
            raise EngineConfigError(f"{alias} and {name} both set the {name}; pass one")
        out[name] = value


def describe() -> str:
    """One line per option with its default and help: the docstrings' list."""
    lines = []
    for f in FIELDS:
        default = f.metadata["unset"] if f.default is None else repr(f.default)
        lines.append(f"    {f.name} (default: {default}): {f.metadata['help']}")
    return "\n".join(lines)


EngineOptions.__doc__ = "What a user may set on an engine; every field:\n\n" + describe()


# Block tables hold int32 block ids; a split (cooperative) pool numbers the host pool's
# blocks after the device pool's.
MAX_KV_BLOCKS = 2**31 - 1


def _check_int(options: EngineOptions, name: str, minimum: int) -> None:
    value = getattr(options, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise EngineConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _parse(value, available, name: str) -> int:
    # A float is a fraction of what is free or a whole number of bytes: 1.5 would be
    # read as 1 byte, inf cannot be read at all.
    if isinstance(value, float) and value > 1 and not (math.isfinite(value)
                                                       and value.is_integer()):
        raise EngineConfigError(f"{name}: {value!r} is neither whole bytes nor a fraction "
                                "in (0, 1]; write bytes, a size like '24GiB' or a fraction "
                                "like 0.8")
    try:
        return parse_bytes(value, available, name)
    except ValueError as exc:
        raise EngineConfigError(str(exc)) from None
