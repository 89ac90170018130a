"""The embedding and the LM head kept as a GGUF file's blocks (quantization="gguf").

A small model's embedding table is a large share of its bytes (SmolLM2-135M: 49,152 x
576, 28 M of its 135 M values), and tied to the head it is read whole every decode
step: 57 MB in bf16 against 30 MB as the file's Q8_0 blocks. So where the file stores
the table (or an untied head) in a block type the kernel takes, it stays as those
blocks:

- `GGUFEmbedding`: the lookup expands only the looked-up rows ([T, h] in the run's
  dtype, each value as the table dequantized to that dtype holds it).
- `GGUFHead`: the head's product through kernels/quant_linear.py (a `GGUFLinear`), its
  greedy argmax taken from that product; tied to the embedding it shares its blocks
  (`GGUFEmbedding.tied_head`), which it repacks for its int8 product like any resident
  GGUFLinear, and the lookup then reads its rows from the repacked layout.

Kept on CPUs only (the kernel's device), in a dtype the kernel takes, for a model whose
lookup and head are its own (a tensor-parallel rank's vocabulary slices stay dense).
"""
from __future__ import annotations

import torch

from fusegen.engine.weights.quantized import GGUFLinear
from fusegen.kernels import use_native
from fusegen.kernels.quant_linear import (check, dequantize_native, dequantize_rows,
                                          has_kernel)
from fusegen.kernels.quant_vnni import packed_rows


def fixed_blocks(source: torch.Tensor, device, dtype: torch.dtype):
    """`source`'s GGUF `CompressedSource` where it can stay as its blocks on `device` for
    a `dtype` run (a 2-D block type with a CPU kernel for `dtype` x), else None."""
    compressed = getattr(source, "compressed", None)
    if (compressed is None or compressed.format != "gguf" or torch.device(device).type != "cpu"
            or len(compressed.shape) != 2 or not has_kernel(compressed.params[0], dtype)):
        return None
    return compressed


class GGUFEmbedding:
    """input_ids [T] -> [T, h] in `dtype`, the table held as `blocks` uint8 [V, row_bytes]
    of GGUF type `qtype`; only the looked-up rows are expanded."""

    def __init__(self, blocks: torch.Tensor, qtype: int, dim: int, dtype: torch.dtype):
        check(blocks, qtype, blocks.shape[0], dim)
        self.blocks, self.qtype, self.dim, self.dtype = blocks, int(qtype), dim, dtype
        self.head = None  # the GGUFHead tied to the table (tied_head), which may repack it

    def tied_head(self, linear) -> "GGUFHead":
        """The LM head tied to this table, `linear` (the model's `Linear`) as a GGUFHead
        over the same blocks: resident, so it repacks them in place at its first bf16 call
        (GGUFLinear); lookups then gather their rows from the repacked layout."""
        self.head = GGUFHead.from_blocks(linear, self.blocks, self.qtype, self.dim)
        self.head.may_repack = True
        return self.head

    @property
    def num_embeddings(self) -> int:
        return self.blocks.shape[0]

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.numel() and (int(input_ids.min()) < 0
                                  or int(input_ids.max()) >= self.num_embeddings):
            bad = input_ids[(input_ids < 0) | (input_ids >= self.num_embeddings)][0]
            raise IndexError(f"token id {int(bad)} is outside the embedding's "
                             f"{self.num_embeddings} rows")
        if self.head is not None and self.head.packed:  # [T, row_bytes] as stored
            rows = packed_rows(self.blocks, self.qtype, self.dim, input_ids)
        else:
            rows = self.blocks.index_select(0, input_ids.reshape(-1))
        if use_native(rows):
            values = dequantize_native(rows, self.qtype, self.dim)  # [T, h] fp32
        else:
            values = dequantize_rows(rows, self.qtype, self.dim)
        return values.to(self.dtype).view(*input_ids.shape, self.dim)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


class GGUFHead(GGUFLinear):
    """The LM head as its blocks: x [N, h] -> [N, V] in x's dtype (`GGUFLinear`), and the
    greedy tokens from that product."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[N, h] -> [N] int64: each row's first column of the maximum of `forward(x)`,
        as argmax(forward(x).float()) gives it."""
        from fusegen.kernels.argmax import argmax

        return argmax(self.forward(x))
