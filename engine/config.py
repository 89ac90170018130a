"""An engine's configuration: options in, a plan made, frozen.

The plan's inputs are gathered here (`PlanInputs.gather`) from the rooms that make them:
the weights' form (`resolve_quantization`, below), the machine (engine/memory/device.py:
device, dtype, free memory) and the model's sizes (engine/memory/shape.py); the plan
itself is engine/memory/plan.py."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.device import (default_device, free_memory, group_free_memory,
                                          resolve_dtype)
from fusegen.engine.memory.kv_split import DEVICE, KVSplit, plan_kv_split
from fusegen.engine.memory.placement import PlacementPlan
from fusegen.engine.memory.plan import FreeMemory, ModelShape, plan_engine
from fusegen.engine.memory.shape import COMPRESSED, plan_shape  # noqa: F401 (model_runner's)
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights.gguf_names import is_gguf
from fusegen.engine.weights.hub import resolve_model
from fusegen.engine.weights.quantized import gguf_kernel_types


def read_model_config(model) -> ModelConfig:
    """A checkpoint directory's config.json, or a GGUF file's metadata."""
    if is_gguf(model):
        from fusegen.engine.weights.gguf import gguf_model_config  # the gguf package

        return gguf_model_config(model)
    return ModelConfig.from_dir(str(model))


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the plan is made over besides the options: the model's config and sizes in
    the run's dtype, and the machine's resolved device and free memory."""
    model_config: ModelConfig
    device: str
    dtype: torch.dtype
    shape: ModelShape
    free: FreeMemory
    quantization: str = "dequantize"  # the form the weights run in (resolve_quantization)
    stages: tuple[range, ...] = ()  # a device group's pipeline stages (`group_stages`)

    @classmethod
    def gather(cls, model, options: EngineOptions) -> "PlanInputs":
        device = default_device() if options.device == "auto" else options.device
        quantization = resolve_quantization(options.quantization, model, device)
        model_config = read_model_config(model)
        dtype = resolve_dtype(options.dtype, device)
        shape, stages = plan_shape(model, model_config, dtype, quantization, options, device)
        world = options.tensor_parallel_size * options.pipeline_parallel_size
        free = free_memory(device) if world == 1 else group_free_memory(device, world)
        return cls(model_config, device, dtype, shape, free, quantization, stages)


FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on


def resolve_quantization(quantization: str | None, model, device: str) -> str:
    """The form a run keeps its weights in, from the option and the model, checked before
    anything loads: "dequantize" (every weight expanded as it loads), "gguf" (a GGUF
    file's blocks), "int8" / "int4" (fusegen's group codes: the checkpoint's own, or a
    16-bit checkpoint quantized on load), "fp8" (an FP8 checkpoint's codes, or a 16-bit
    checkpoint quantized on load). None: the checkpoint's own form, where it runs on
    `device`: a GGUF file's blocks where a kernel takes them (the C kernels on CPUs,
    Triton's on CUDA GPUs; `gguf_kernel_types`), an FP8 checkpoint's codes on GPUs with
    FP8 units (refused elsewhere: quantization="dequantize" expands them)."""
    from fusegen.engine.weights.fp8 import FP8Checkpoint
    from fusegen.engine.weights.loader import declared_format

    gguf = is_gguf(model)
    own = None if gguf else declared_format(model)  # ModelLoadError for a bad declaration
    fp8 = isinstance(own, FP8Checkpoint)
    if quantization == "dequantize":
        return quantization
    where = f"quantization={quantization!r} on {model} (device {device})"
    runs = _runs_here(model, device, gguf, own)
    if fp8 and quantization in (None, "fp8"):
        problem = _fp8_problem(device)
        if problem:
            raise EngineConfigError(
                f"{model} is an FP8 checkpoint (config.json's quantization_config.quant_method "
                f"'fp8'): its FP8 weights run on CUDA GPUs of compute capability 8.9 or later, "
                f"and {problem}; pass quantization='dequantize' to expand them to the run's "
                "dtype as they load")
        return "fp8"
    if quantization is None:
        if own is not None:
            return own.name
        return "gguf" if gguf and gguf_kernel_types(device) else "dequantize"
    if fp8:
        raise EngineConfigError(f"{where}: the checkpoint is FP8 already; {runs}")
    if quantization == "gguf":
        if not gguf:
            raise EngineConfigError(
                f"{where}: it keeps the blocks of a GGUF file, and this model is not one; "
                f"{runs}")
        if not gguf_kernel_types(device):
            raise EngineConfigError(
                f"{where}: kept GGUF blocks run on CPUs, and on CUDA GPUs through fusegen's "
                f"Triton kernel{', and Triton is not installed here' * device.startswith('cuda')}"
                f"; {runs}")
        return quantization
    if quantization in ("int8", "int4"):
        if gguf:
            raise EngineConfigError(
                f"{where}: a GGUF file is already quantized in its own types; {runs}")
        if own is not None and own.name != quantization:
            raise EngineConfigError(f"{where}: the checkpoint is quantized to {own.name} "
                                    f"already; {runs}")
        return quantization
    if quantization == "fp8":
        if not device.startswith("cuda"):
            raise EngineConfigError(f"{where}: FP8 weights need a CUDA GPU of compute "
                                    f"capability 8.9 or later; {runs}")
        if gguf or own is not None:
            raise EngineConfigError(f"{where}: FP8 quantizes a 16-bit checkpoint on load, "
                                    f"and this one is quantized already; {runs}")
        if not torch.cuda.is_available():
            raise EngineConfigError(f"{where}: no CUDA GPU is visible to this process; "
                                    f"{runs}")
        capability = torch.cuda.get_device_capability(torch.device(device.split(",")[0]))
        if capability < FP8_CAPABILITY:
            raise EngineConfigError(
                f"{where}: FP8 weights need compute capability 8.9 or later; this GPU has "
                f"{capability[0]}.{capability[1]}; {runs}")
        return quantization
    raise EngineConfigError(f"quantization={quantization!r}: not a form fusegen runs; "
                            f"{runs}")  # EngineOptions refuses it first


def _fp8_problem(device: str) -> str | None:
    """Why FP8 weights cannot run on `device` (None: they can)."""
    if not device.startswith("cuda"):
        return f"device {device} is not one"
    if not torch.cuda.is_available():
        return f"device {device}: no CUDA GPU is visible to this process"
    first = torch.device(device.split(",")[0])
    capability = torch.cuda.get_device_capability(first)
    if capability < FP8_CAPABILITY:
        return (f"{device} ({torch.cuda.get_device_name(first)}) has compute capability "
                f"{capability[0]}.{capability[1]}")
    return None


def _runs_here(model, device: str, gguf: bool, own) -> str:
    """What quantization runs `model` on `device`: the end of a refusal."""
    if gguf:
        keeps = bool(gguf_kernel_types(device))
        forms = ["None (its blocks kept where a kernel takes them)" if keeps else "None",
                 "'dequantize'"] + (["'gguf'"] if keeps else [])
    elif own is not None and own.name == "fp8":
        forms = ["None or 'fp8' (its FP8 weights as stored, compute capability 8.9 or "
                 "later)"] * device.startswith("cuda") + ["'dequantize'"]
    elif own is not None and own.name == "sparse":  # a "sparsity_config" (weights/sparse.py)
        forms = ["None (its sparse tiles as stored)", "'dequantize'"]
    elif own is not None:
        forms = [f"None or {own.name!r} (its {own.name} codes as stored)", "'dequantize'"]
    else:
        forms = ["None or 'dequantize' (its own width)", "'int8'", "'int4'"] + (
            ["'fp8' (compute capability 8.9 or later)"] if device.startswith("cuda") else [])
    return f"on {device} this model runs with quantization={', '.join(forms)}"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """An engine's resolved configuration: the options as given, the model, and what the
    plan made of them. Built once by `EngineConfig.build`; nothing changes it after."""
    model: str  # what the engine reads: a local checkpoint path (a hub id resolved)
    model_name: str  # the model as the caller named it (a hub id, a path)
    model_config: ModelConfig = field(repr=False)
    options: EngineOptions
    device: str  # resolved: cpu, cuda or cuda:N
    torch_dtype: torch.dtype  # resolved from options.dtype for this device
    shape: ModelShape = field(repr=False)  # the model's sizes the plan was made over
    placement: PlacementPlan = field(repr=False)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # the form the weights run in: "dequantize", "gguf", "int8", "int4" or "fp8", the
    # option resolved against the model and device (`resolve_quantization`)
    quantization: str = "dequantize"
    # a device group's pipeline stages, each a run of layers (`group_stages`); () alone
    stages: tuple[range, ...] = ()
    kv_split: KVSplit = DEVICE  # where running requests' KV blocks live (memory/kv_split.py)

    @classmethod
    def build(cls, model, options: EngineOptions | None = None) -> "EngineConfig":
        """Resolve the model's name to local files (a hub id through the Hugging Face
        cache), read its config, measure the machine, plan (a pure function of the
        options, the model's sizes and the free memory), freeze."""
        options = options or EngineOptions()
        path = resolve_model(str(model), options.revision)
        inputs = PlanInputs.gather(path, options)
        plan = plan_engine(options, inputs.shape, inputs.free)
        kv_split = plan_kv_split(
            options.kv_placement, plan.placement.num_device_kv_blocks,
            plan.placement.num_host_kv_blocks, plan.max_num_seqs, plan.max_model_len,
            options.block_size, deterministic=options.deterministic,
            unsupported=_split_unsupported(inputs.model_config, options),
            on_gpu=inputs.free.on_gpu)
        return cls(path, str(model), inputs.model_config, options, inputs.device,
                   inputs.dtype, inputs.shape, plan.placement, plan.max_num_seqs,
                   plan.max_num_batched_tokens, plan.max_model_len, inputs.quantization,
                   inputs.stages, kv_split)

    @property
    def block_size(self) -> int:
        return self.options.block_size


def _split_unsupported(cfg: ModelConfig, options: EngineOptions) -> str | None:
    """Why this engine cannot split a request's KV between device and host (None: it can)."""
    if options.tensor_parallel_size * options.pipeline_parallel_size > 1:
        return "a device group keeps each rank's KV on its device"
    if any(cfg.layer_window(i) for i in range(cfg.num_layers)) or cfg.attn_softcap:
        return "the model has sliding-window or soft-capped attention layers"
    return None
