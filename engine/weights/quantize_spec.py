"""What `fusegen quantize` is asked for and what it works on and reports: `QuantizeSpec`
(bits, group size, method), `Source` (a checkpoint's tensors, none read yet), `Report`,
and `QuantizeError`, a bad input with the option it comes from. Shared by the writer
(weights/quantize.py) and the AWQ search (weights/awq.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fusegen.engine.models.config import ModelConfig

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
METHODS = ("rtn", "awq")
# The decoder-layer parameters written as codes
QUANTIZED_PARAMS = ("qkv.weight", "o.weight", "gate_up.weight", "down.weight")


class QuantizeError(ValueError):
    """A bad input, with the option (`--bits`, `--model`, ...) it comes from."""

    def __init__(self, message: str, option: str):
        super().__init__(message)
        self.option = option


@dataclass(frozen=True, slots=True)
class QuantizeSpec:
    bits: int  # 8 or 4: code width
    group_size: int  # input channels sharing one scale (and zero point)
    symmetric: bool  # no zero points: codes centred on the range's middle
    method: str = "rtn"  # rtn: round to nearest; awq: activation-aware scales first

    def __post_init__(self):
        if self.bits not in BITS:
            raise QuantizeError(f"bits must be 8 or 4, got {self.bits!r}", "bits")
        if self.group_size not in GROUP_SIZES:
            raise QuantizeError(f"group size must be 32, 64 or 128, got {self.group_size!r}",
                                "group-size")
        if self.method not in METHODS:
            raise QuantizeError(f"method must be rtn or awq, got {self.method!r}", "method")

    def config_entry(self) -> dict:
        return {"quant_method": "fusegen", "bits": self.bits, "group_size": self.group_size,
                "symmetric": self.symmetric, "method": self.method}


@dataclass(slots=True)
class Report:
    """What a run did, for the command to print."""
    output: Path
    num_quantized: int = 0  # source tensors written as codes
    num_copied: int = 0  # source tensors written as they are (or folded)
    bytes_before: int = 0  # the source tensors written, in the source's dtypes
    bytes_after: int = 0  # what the output's weight files hold
    num_files: int = 0
    # AWQ: per (layer, group) the alpha chosen, its error and RTN's (alpha 0); an MoE
    # layer's groups are "moe gate_up" (every expert's, one scale) and "expert {e} down"
    searches: dict[tuple[int, str], tuple[float, float, float]] = field(default_factory=dict)
    # AWQ: the (layer, "expert {e} down") left round-to-nearest: no calibration row
    # was routed to that expert
    round_to_nearest: list[tuple[int, str]] = field(default_factory=list)


@dataclass(slots=True)
class Source:
    """A checkpoint's tensors under Hugging Face names, none read yet."""
    path: Path
    cfg: ModelConfig
    tensors: dict[str, torch.Tensor]  # memory-mapped views, or a GGUF file's LazyTensors
    write_metadata: Callable[[Path, dict], None]  # (out dir, config.json entries added)
    out_dtype: torch.dtype | None = None  # None: each tensor's own; a GGUF file: bf16

    def read(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        return tensor.load() if hasattr(tensor, "load") else tensor

    def nbytes(self, name: str) -> int:
        tensor = self.tensors[name]
        return tensor.numel() * (self.out_dtype or tensor.dtype).itemsize
