"""Baseline for the offload presets: transformers with accelerate's `device_map`
offload under the same memory budgets fusegen gets (on the device, the bytes fusegen's
plan spends on weights: accelerate keeps no KV pool and reserves no activations).

accelerate places what fits `max_memory` on the device and the rest in CPU memory or
on disk, and moves each offloaded layer to the device inside its forward hook, every
step, with no overlap. Batches are static, as in `hf_static`."""
from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from fusegen.jobs.bench.hf_static import TORCH_DTYPES, run_hf_static
from fusegen.jobs.bench.results import EngineResult
from fusegen.jobs.bench.workload import BenchRequest


def load_offloaded_model(model_dir: Path, dtype: str, device: str, device_memory: int,
                         host_memory: int, offload_dir: str | None = None):
    from transformers import AutoModelForCausalLM

    offload_dir = offload_dir or tempfile.mkdtemp(prefix="fusegen-accelerate-")
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        max_memory = {index: device_memory, "cpu": host_memory}
    else:
        # On a CPU-only machine the CPU is the device: what exceeds its budget goes to
        # disk, as fusegen's disk tier does when host_memory is 0.
        max_memory = {"cpu": device_memory}
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=TORCH_DTYPES[dtype], device_map="auto", max_memory=max_memory,
        offload_folder=offload_dir, offload_state_dict=True)
    return model.eval()


def offload_summary(model) -> dict:
    placement = getattr(model, "hf_device_map", {}) or {}
    tiers: dict[str, int] = {}
    for where in placement.values():
        tiers[str(where)] = tiers.get(str(where), 0) + 1
    return tiers


def run_hf_offload(model, requests: list[BenchRequest], warmup: list[BenchRequest], *,
                   batch_size: int, device: str, device_memory: int,
                   progress: Callable[[str], None]) -> EngineResult:
    result = run_hf_static(model, requests, warmup, batch_size=batch_size, device=device,
                           progress=lambda line: progress(line.replace("hf static", "hf offload")))
    result.name, result.label = "hf_offload", f"hf accelerate offload, static bs {batch_size}"
    result.extra["device_map"] = offload_summary(model)
    result.extra["device_memory"] = device_memory
    return result
