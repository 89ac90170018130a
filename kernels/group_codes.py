"""fusegen's group-quantized int8 / int4 codes (docs/quantization.md): the format's
constants, the check of a weight's tensors, and int4's packing. Shared by the dispatcher
(kernels/group_linear.py) and the int8 product (kernels/group_vnni.py), which import it
and not each other."""
from __future__ import annotations

import functools

import torch

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
SYMMETRIC_ZERO = {8: 128, 4: 8}  # the code range's middle
MAX_CODE = {8: 255, 4: 15}
RUN = 32  # int4 codes are packed in runs of 32 channels (16 bytes)


def check(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
          group_size: int, out_features: int, in_features: int,
          x: torch.Tensor | None = None) -> None:
    """ValueError naming the bad option, tensor, shape or dtype; None for a valid call."""
    _check_format(bits, group_size, in_features)
    if x is not None and (x.dim() == 0 or x.shape[-1] != in_features):
        raise ValueError(f"x {list(x.shape)} does not end in in_features={in_features}")
    if x is not None and x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x is {x.dtype}; group_linear takes float32, bfloat16 or float16 x")
    groups = in_features // group_size
    expected = [("qweight", qweight, torch.uint8, (out_features, in_features * bits // 8)),
                ("scales", scales, torch.float16, (out_features, groups))]
    if zeros is not None:
        expected.append(("zeros", zeros, torch.uint8, (out_features, groups)))
    for name, tensor, dtype, shape in expected:
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"int{bits} {name} for a {out_features} x {in_features} weight in groups of "
                f"{group_size} is {dtype} {list(shape)}; got {tensor.dtype} "
                f"{list(tensor.shape)}")


@functools.lru_cache(maxsize=None)
def _check_format(bits: int, group_size: int, in_features: int) -> None:
    # cached: a decode step checks every linear's call
    if bits not in BITS:
        raise ValueError(f"bits={bits}: group quantization is int8 or int4 (bits 8 or 4)")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size}: must be one of {GROUP_SIZES}")
    if in_features <= 0 or in_features % group_size:
        raise ValueError(f"in_features={in_features} is not a positive multiple of "
                         f"group_size={group_size}")


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, in / 2] -> codes uint8 [rows, in] in channel order."""
    rows = qweight.shape[0]
    runs = qweight.reshape(rows, -1, RUN // 2)  # [rows, in / 32, 16]
    return torch.stack([runs & 0xF, runs >> 4], dim=2).reshape(rows, -1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [rows, in] (0..15, in a multiple of 32) -> uint8 [rows, in / 2]."""
    rows = codes.shape[0]
    runs = codes.reshape(rows, -1, 2, RUN // 2)  # [rows, in / 32, low | high, 16]
    return (runs[:, :, 0] | runs[:, :, 1] << 4).reshape(rows, -1)
