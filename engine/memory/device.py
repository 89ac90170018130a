"""What the machine gives the plan: the device a run uses, the dtype it computes in (from
the CPU's flags, never a timing), and the memory free on each tier (`FreeMemory`)."""
from __future__ import annotations

import psutil
import torch

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.plan import FreeMemory

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# torch's probes of the CPU's flags, by the name fusegen reports each under
_CPU_FLAGS = {"avx2": "_is_avx2_supported", "avx512": "_is_avx512_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx": "_is_amx_tile_supported"}
_BF16_UNITS = ("amx", "avx512_bf16")  # the flags of bf16 matrix units


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_features() -> list[str]:
    """The CPU's vector and matrix flags that decide its fast dtypes (of `_CPU_FLAGS`)."""
    cpu = getattr(torch, "cpu", None)
    return [name for name, probe in _CPU_FLAGS.items()
            if getattr(cpu, probe, lambda: False)()]


def cpu_supports_bf16() -> bool:
    """Whether the CPU's flags show bf16 units (AMX tiles or AVX512_BF16): elsewhere bf16
    arithmetic is emulated, slow, and fp32 serves better."""
    return any(flag in _BF16_UNITS for flag in cpu_features())


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


def free_memory(device: str) -> FreeMemory:
    host = psutil.virtual_memory().available
    if device.startswith("cuda"):
        return FreeMemory(device=torch.cuda.mem_get_info(torch.device(device))[0], host=host,
                          on_gpu=True)
    return FreeMemory(device=host, host=host, on_gpu=False)


def group_free_memory(device: str, world: int) -> FreeMemory:
    """The memory each rank of a group may plan with: on CPUs the ranks share the
    machine's; on GPUs the least any rank's share of its GPU's free memory (a GPU named
    for n ranks, "cuda:0,0", gives each 1/n)."""
    host = psutil.virtual_memory().available
    if not device.startswith("cuda"):
        return FreeMemory(device=host // world, host=host // world, on_gpu=False)
    from fusegen.engine.parallel.plan import rank_devices, ranks_per_device

    devices = rank_devices(device, world, torch.cuda.device_count())
    sharing = ranks_per_device(devices)
    free = min(torch.cuda.mem_get_info(torch.device(d))[0] // n
               for d, n in zip(devices, sharing))
    return FreeMemory(device=free, host=host // world, on_gpu=True, shared_by=max(sharing))
