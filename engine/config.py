"""The engine's knobs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.models.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_supports_bf16() -> bool:
    """bf16 only pays on CPUs with bf16 matrix units; elsewhere it is emulated and slow."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise EngineConfigError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


@dataclass(slots=True)
class EngineConfig:
    model: str  # a local Hugging Face checkpoint directory
    dtype: str = "auto"  # auto: bf16 on GPUs and bf16-capable CPUs, fp32 otherwise
    device: str = "auto"  # auto: cuda when present, else cpu
    max_num_seqs: int | None = None  # running requests at most; None: from the machine
    max_num_batched_tokens: int | None = None  # tokens per step; None: from the machine
    block_size: int = 16  # tokens per KV block
    # Bytes for the KV block pool; None: from free memory. With device_memory set and
    # layers streaming, the share of that budget kept for KV before layers are placed.
    kv_cache_memory: int | str | None = None  # bytes or a size like "16GiB"
    num_kv_blocks: int | None = None  # exact pool size (overrides kv_cache_memory)
    max_model_len: int | None = None  # context limit; None: max_position_embeddings
    allow_pickle: bool = False  # load *.bin / *.pt checkpoints (weights_only) when True
    seed: int = 0  # the engine-wide generator for requests without their own seed
    # The memory pool (engine/memory/placement.py). Bytes, a size like "24GiB", or a fraction
    # of what is free. device_memory None: no limit, every layer stays on the device.
    device_memory: int | str | float | None = None
    host_memory: int | str | float | None = None  # pinned host tier: streamed layers, swap
    prefetch_depth: int = 1  # streamed layers loaded ahead of the one computing
    num_host_kv_blocks: int | None = None  # exact host swap pool size (tests)
    model_config: ModelConfig | None = field(default=None, repr=False)

    def __post_init__(self):
        self.model = str(self.model)
        if self.device == "auto":
            self.device = default_device()
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise EngineConfigError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}")
        resolve_dtype(self.dtype, self.device)
        if isinstance(self.kv_cache_memory, str):  # a size like "16GiB"
            from fusegen.engine.memory.placement import parse_bytes

            try:
                self.kv_cache_memory = parse_bytes(self.kv_cache_memory, None, "kv_cache_memory")
            except ValueError as exc:
                raise EngineConfigError(str(exc)) from None
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                     "num_kv_blocks", "max_model_len", "prefetch_depth"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise EngineConfigError(f"{name} must be a positive integer; got {value!r}")
        if self.num_host_kv_blocks is not None and self.num_host_kv_blocks < 0:
            raise EngineConfigError(f"num_host_kv_blocks must be >= 0; got "
                                    f"{self.num_host_kv_blocks}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise EngineConfigError(f"block_size must be a power of two up to 128; "
                                    f"got {self.block_size}")
        if self.model_config is None:
            self.model_config = ModelConfig.from_dir(self.model)
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise EngineConfigError(f"max_model_len {self.max_model_len} exceeds the model's "
                                    f"max_position_embeddings {limit}")

    def resolve_limits(self, streaming: bool) -> None:
        """Fill the batch limits the user left unset. When layers stream, every step
        pays their transfer, so the defaults grow to amortise it over more tokens
        (FlexGen's lesson: offloading wants the largest batch memory allows)."""
        on_gpu = self.device.startswith("cuda")
        scale = 4 if streaming else 1
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 * scale
        if self.max_num_batched_tokens is None:
            # A CPU is compute-bound from a few hundred tokens per step on: a bigger
            # step only has to hold a decode step of every running request.
            self.max_num_batched_tokens = 8192 * scale if on_gpu else \
                max(2048, self.max_num_seqs)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)
