"""What the benchmark ran on: the machine and the software versions."""
from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata

import torch

from fusegen.engine.memory.device import cpu_features


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe_machine(device: str) -> dict:
    import psutil

    info = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_features": cpu_features(),  # the flags that decide the bf16 ceiling
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": psutil.virtual_memory().total,
        "device": device,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
        info["gpu_count"] = torch.cuda.device_count()
    return info


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "fusegen": _version("fusegen"),
        "fusegen_commit": _git_commit(),
        "cuda": torch.version.cuda,
    }


def _git_commit() -> str | None:
    """The source tree's commit (with "+dirty" for local changes), when it is a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                capture_output=True, timeout=5)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True, timeout=5)
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
