"""Greedy sampling: the index of each row's largest logit (the first one on ties).

Shapes:
  logits   [N, V] fp32 (or bf16 on CPUs: a bf16 head's own product, compared exactly
           as the fp32 values it widens to)
  returns  [N] int64

On CPUs the C kernel (kernels/csrc/argmax.c) replaces torch's argmax, which does not
vectorise; on CUDA and elsewhere torch's argmax serves.
"""
from __future__ import annotations

import torch

from fusegen.kernels import use_native

_NATIVE = {torch.float32: "argmax_f32", torch.bfloat16: "argmax_bf16"}


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Dispatcher: the C kernel for fp32 and bf16 CPU logits, torch's argmax elsewhere."""
    if logits.dtype in _NATIVE and logits.dim() == 2 and logits.shape[1] > 0 \
            and use_native(logits):
        return argmax_native(logits)
    return argmax_reference(logits)


def argmax_native(logits: torch.Tensor) -> torch.Tensor:
    from fusegen.kernels import native

    assert logits.stride(-1) == 1, "the vocabulary dimension must be contiguous"
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel = getattr(native.library(), _NATIVE[logits.dtype])
    kernel(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1],
           logits.stride(0), torch.get_num_threads())
    return out


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)
