"""The GGUF block formats fusegen multiplies: their type ids, block sizes, the check of a
weight's blocks and the gguf package's dequantization (the references' ground truth).
Shared by the dispatcher (kernels/quant_linear.py) and the int8 product
(kernels/quant_vnni.py), which import it and not each other's checks."""
from __future__ import annotations

import functools

import numpy as np
import torch

# GGMLQuantizationType values (gguf.constants), kept here so the dispatchers need no
# gguf import on their hot path.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = \
    0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
SUPPORTED = {
    Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
    Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
}
# (values per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES says
BLOCK_SIZES = {
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}

def check(blocks: torch.Tensor, qtype: int, out_features: int, in_features: int,
          x: torch.Tensor | None = None) -> int:
    """row_bytes of a valid call; ValueError naming the problem otherwise."""
    row_bytes = _row_bytes(qtype, in_features)
    if x is not None and (x.dim() == 0 or x.shape[-1] != in_features):
        raise ValueError(f"x {list(x.shape)} does not end in in_features={in_features}")
    if blocks.dtype != torch.uint8 or blocks.shape != (out_features, row_bytes):
        raise ValueError(f"{SUPPORTED[qtype]} blocks for a {out_features} x {in_features} "
                         f"weight are uint8 [{out_features}, {row_bytes}]; got "
                         f"{blocks.dtype} {list(blocks.shape)}")
    return row_bytes


@functools.lru_cache(maxsize=None)
def _row_bytes(qtype: int, in_features: int) -> int:
    # cached: a decode step checks every linear's call, a few microseconds each otherwise
    if qtype not in SUPPORTED:
        raise ValueError(
            f"GGUF quantization type {qtype} has no quant_linear kernel or reference; "
            f"supported: {', '.join(SUPPORTED.values())} (load the model with "
            f"quantization='dequantize' to expand it to 16 bits instead)")
    block_size, type_size = BLOCK_SIZES[qtype]
    if in_features % block_size:
        raise ValueError(f"{SUPPORTED[qtype]} weight rows hold whole blocks of {block_size} "
                         f"values; in_features={in_features} is not a multiple")
    return in_features // block_size * type_size


def dequantize_rows(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """[rows, row_bytes] uint8 blocks -> [rows, in_features] fp32, by the gguf package."""
    from gguf.quants import dequantize

    data = blocks.contiguous().numpy()
    dense = dequantize(data, qtype).reshape(blocks.shape[0], in_features)
    return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))
