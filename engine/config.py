"""An engine's configuration: options in, a plan made, frozen."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import psutil
import torch

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.placement import PlacementPlan
from fusegen.engine.memory.plan import FreeMemory, ModelShape, plan_engine
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights.gguf_names import is_gguf
from fusegen.engine.weights.hub import resolve_model
from fusegen.engine.weights.packed import can_pack
from fusegen.engine.weights.quantized import gguf_kernel_types

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_supports_bf16() -> bool:
    """Whether the CPU's flags show bf16 units (AMX tiles or AVX512_BF16): elsewhere bf16
    arithmetic is emulated, slow, and fp32 serves better."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def read_model_config(model) -> ModelConfig:
    """A checkpoint directory's config.json, or a GGUF file's metadata."""
    if is_gguf(model):
        from fusegen.engine.weights.gguf import gguf_model_config  # the gguf package

        return gguf_model_config(model)
    return ModelConfig.from_dir(str(model))


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """The dtype a run computes in. "auto" follows only what is the same on every start of
    the same machine, since the dtype changes the tokens and a resumed job must make the
    ones its first start made: never a timing.
    - GPUs: bf16. A 16-bit checkpoint is never upcast; an fp32 one is halved; an fp16 one
      runs in bf16 too (some models' activations overflow fp16's narrow range).
    - CPUs with bf16 units (the flags: AMX, AVX512_BF16): bf16, whatever the checkpoint's
      dtype (an fp32 checkpoint is halved, as on GPUs).
    - other CPUs: fp32, a 16-bit checkpoint included: bf16 arithmetic is emulated there,
      and fp16 has no fast CPU path.
    So the checkpoint's own dtype changes no choice, and the choice needs no checkpoint:
    a job's driver resolves it before any model is read."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise EngineConfigError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


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
        # A head tied to the embedding is packed as a copy on CPUs (weights/packed.py).
        packed_head = (device == "cpu" and model_config.tie_word_embeddings
                       and can_pack(dtype))
        tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
        if tp * pp > 1:  # the plan is one rank's: every rank gets the same KV blocks
            from fusegen.engine.parallel.plan import check_parallel

            check_parallel(model_config, tp, pp)
            layer_bytes = None
            if quantization in COMPRESSED:  # a rank's slice of each layer, compressed
                layer_bytes = compressed_layer_bytes(model, model_config, dtype, quantization,
                                                     options, device, tp)
            stages = group_stages(model_config, dtype, tp, pp, layer_bytes)
            shape = rank_shape(model_config, dtype, tp, pp, packed_head, stages)
            if layer_bytes is not None:
                shape = dataclasses.replace(shape, layer_bytes=max(layer_bytes))
            return cls(model_config, device, dtype, shape, group_free_memory(device, tp * pp),
                       quantization, tuple(stages))
        fixed_bytes = (compressed_fixed_bytes(model, model_config, dtype, options, device)
                       if quantization == "gguf" else None)
        # A tied head kept as the embedding's blocks is no packed copy (quantized_fixed.py).
        shape = model_shape(model_config, dtype, packed_head=packed_head and fixed_bytes is None)
        if quantization in COMPRESSED:
            shape = dataclasses.replace(shape, layer_bytes=max(compressed_layer_bytes(
                model, model_config, dtype, quantization, options, device)),
                fixed_bytes=fixed_bytes)
        return cls(model_config, device, dtype, shape, free_memory(device), quantization)


# The resolved forms whose decoder linears stay compressed (weights/quantized.py).
COMPRESSED = ("gguf", "int8", "int4", "fp8")
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
    elif own is not None:
        forms = [f"None or {own.name!r} (its {own.name} codes as stored)", "'dequantize'"]
    else:
        forms = ["None or 'dequantize' (its own width)", "'int8'", "'int4'"] + (
            ["'fp8' (compute capability 8.9 or later)"] if device.startswith("cuda") else [])
    return f"on {device} this model runs with quantization={', '.join(forms)}"


def compressed_layer_bytes(model, cfg: ModelConfig, dtype: torch.dtype, quantization: str,
                           options: EngineOptions, device: str, tp: int = 1) -> list[int]:
    """Each decoder layer's weight bytes with its linears kept compressed: their
    components, the other weights dense in `dtype` (from the tensor tables; nothing
    read); with `tp` > 1 one rank's slice (a split inside a block is refused,
    engine/parallel/shard.py). Explicit quantization="gguf" on a file with a layer
    linear in a type no kernel takes is refused here, naming the tensor."""
    from fusegen.engine.parallel.shard import rank_layer_nbytes
    from fusegen.engine.weights.loader import checkpoint_tensors
    from fusegen.engine.weights.quantized import layer_nbytes

    state = checkpoint_tensors(model, cfg, dtype, quantization, options.allow_pickle)
    arch = get_architecture(cfg.architecture)
    sizes = []
    for i in range(cfg.num_layers):
        sources = arch.layer_sources(state, i, cfg)
        if options.quantization == "gguf":
            _check_kernels(sources, model, device)
        if quantization in ("int8", "int4"):
            _check_groups(sources, model, device, quantization)
        sizes.append(layer_nbytes(sources, dtype.itemsize, device) if tp == 1 else
                     rank_layer_nbytes(cfg, sources, tp, dtype.itemsize, i, device))
    return sizes


def compressed_fixed_bytes(model, cfg: ModelConfig, dtype: torch.dtype,
                           options: EngineOptions, device: str) -> int | None:
    """The embedding, final norm and LM head's bytes where a GGUF file's embedding (and a
    head tied to it) or untied head stay as their blocks on `device`
    (weights/quantized_fixed.py, as `CausalLM.load_fixed` keeps them); None where none
    does (the dense count, `model_shape`, holds)."""
    from fusegen.engine.weights.loader import checkpoint_tensors
    from fusegen.engine.weights.quantized_fixed import fixed_blocks

    state = checkpoint_tensors(model, cfg, dtype, "gguf", options.allow_pickle)
    sources = get_architecture(cfg.architecture).fixed_sources(state, cfg)
    embed = fixed_blocks(sources["embed"][0], device, dtype)
    head = sources.get("lm_head.weight")
    head = None if head is None or cfg.tie_word_embeddings else fixed_blocks(head[0], device,
                                                                              dtype)
    if embed is None and head is None:
        return None
    total = 0
    for name, parts in sources.items():
        if name == "embed" and embed is not None:
            total += embed.nbytes
        elif name == "lm_head.weight" and head is not None:
            total += head.nbytes
        else:
            total += sum(part.numel() for part in parts) * dtype.itemsize
    return total


def _check_groups(sources: dict, model, device: str, quantization: str) -> None:
    """Quantized on load: each linear's input channels must fill whole groups."""
    for parts in sources.values():
        for part in parts:
            source = getattr(part, "compressed", None)
            if source is not None and source.shape[1] % source.params[1]:
                raise EngineConfigError(
                    f"quantization={quantization!r} on {model} (device {device}): tensor "
                    f"{source.name!r} has {source.shape[1]} input channels, not a multiple of "
                    f"the on-load group size {source.params[1]}; pass "
                    "quantization='dequantize', or quantize it with `fusegen quantize` and a "
                    "group size that divides it")


def _check_kernels(sources: dict, model, device: str) -> None:
    from fusegen.kernels.quant_linear import SUPPORTED

    types = gguf_kernel_types(device)
    for param, parts in sources.items():
        for part in parts:
            source = getattr(part, "compressed", None)
            if param.endswith(".weight") and source is not None \
                    and source.params[0] not in types:
                from gguf import GGMLQuantizationType

                raise EngineConfigError(
                    f"quantization='gguf' on {model} (device {device}): tensor "
                    f"{source.name!r} is {GGMLQuantizationType(source.params[0]).name}, which "
                    f"no kernel on {device} multiplies as blocks (kept: "
                    f"{', '.join(SUPPORTED[t] for t in sorted(types))}); leave quantization "
                    "out to keep the blocks it can and dequantize the rest, or pass "
                    "quantization='dequantize'")


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

    @classmethod
    def build(cls, model, options: EngineOptions | None = None) -> "EngineConfig":
        """Resolve the model's name to local files (a hub id through the Hugging Face
        cache), read its config, measure the machine, plan (a pure function of the
        options, the model's sizes and the free memory), freeze."""
        options = options or EngineOptions()
        path = resolve_model(str(model), options.revision)
        inputs = PlanInputs.gather(path, options)
        plan = plan_engine(options, inputs.shape, inputs.free)
        return cls(path, str(model), inputs.model_config, options, inputs.device,
                   inputs.dtype, inputs.shape, plan.placement, plan.max_num_seqs,
                   plan.max_num_batched_tokens, plan.max_model_len, inputs.quantization,
                   inputs.stages)

    @property
    def block_size(self) -> int:
        return self.options.block_size


def model_shape(cfg: ModelConfig, dtype: torch.dtype, packed_head: bool = False) -> ModelShape:
    """The sizes the plan works over, from config.json alone (no weights are read).
    `packed_head`: a tied head also kept as a packed copy."""
    arch = get_architecture(cfg.architecture)
    layer_params, fixed_params = arch.layer_numel(cfg), arch.fixed_numel(cfg)
    if packed_head:
        fixed_params += cfg.vocab_size * cfg.hidden_size
    # Alive at once inside a layer, per token: the hidden stream, residual and norms,
    # q/k/v, and the MLP's gate/up; in a mixture of experts (models/moe.py), three
    # copies of the token's k routed rows, one expert's gate/up, the router's logits.
    mlp = (3 * cfg.num_experts_per_tok * cfg.hidden_size + 3 * cfg.moe_intermediate_size
           + cfg.num_experts if cfg.num_experts else 3 * cfg.intermediate_size)
    width = 4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + mlp
    return ModelShape(num_layers=cfg.num_layers, layer_params=layer_params,
                      fixed_params=fixed_params, kv_width=2 * cfg.num_kv_heads * cfg.head_dim,
                      activation_width=width, vocab_size=cfg.vocab_size,
                      max_position_embeddings=cfg.max_position_embeddings,
                      dtype_bytes=torch.finfo(dtype).bits // 8)


def group_stages(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int,
                 layer_bytes: list[int] | None = None) -> list[range]:
    """A device group's pipeline stages, balanced by each layer's bytes as one rank
    loads them (`layer_bytes`: a rank's compressed slices, `compressed_layer_bytes`; None:
    dense, every layer the same) with the LM head (a rank's slice of it) on the last."""
    from fusegen.engine.parallel.plan import layer_stages, model_stages

    head = cfg.vocab_size * cfg.hidden_size
    if layer_bytes is None:
        whole = get_architecture(cfg.architecture).layer_numel(cfg)  # as the runner splits
        return model_stages(whole, cfg.num_layers, head, pp)
    return layer_stages(layer_bytes, head * dtype.itemsize // tp, pp)


def rank_shape(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int,
               packed_head: bool, stages: list[range] | None = None) -> ModelShape:
    """What one rank of a device group holds: its stage's layers (the stage of most
    layers, of `stages` or the dense split), its slice of each layer and of the
    embedding and head; the logits stay whole (the last stage gathers them). Refuses a
    split the model cannot take."""
    from fusegen.engine.parallel.plan import check_parallel
    from fusegen.engine.parallel.shard import rank_model_config

    check_parallel(cfg, tp, pp)
    local = model_shape(rank_model_config(cfg, tp), dtype, packed_head=packed_head)
    stages = stages or group_stages(cfg, dtype, tp, pp)
    return dataclasses.replace(local, num_layers=max(len(s) for s in stages),
                               fixed_params=-(-local.fixed_params // tp))


def group_free_memory(device: str, world: int) -> FreeMemory:
    """The memory each rank of a group may plan with: on CPUs the ranks share the
    machine's; on GPUs the least any of the group's GPUs has free."""
    host = psutil.virtual_memory().available
    if not device.startswith("cuda"):
        return FreeMemory(device=host // world, host=host // world, on_gpu=False)
    from fusegen.engine.parallel.plan import rank_devices

    devices = rank_devices(device, world, torch.cuda.device_count())
    free = min(torch.cuda.mem_get_info(torch.device(d))[0] for d in devices)
    return FreeMemory(device=free, host=host // world, on_gpu=True)


def free_memory(device: str) -> FreeMemory:
    host = psutil.virtual_memory().available
    if device.startswith("cuda"):
        return FreeMemory(device=torch.cuda.mem_get_info(torch.device(device))[0], host=host,
                          on_gpu=True)
    return FreeMemory(device=host, host=host, on_gpu=False)
