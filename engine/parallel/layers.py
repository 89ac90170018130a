"""The modules of a tensor-parallel rank that talk to the other ranks of its stage.

`parallelize` turns a decoder built from `shard.rank_model_config` into one rank's
share of the model: o and down (or a mixture of experts' output) sum the ranks' partial
products with one all-reduce each, the embedding looks up the rank's vocabulary rows and
sums, the LM head gathers the ranks' logits. Everything else in the decoder runs on local
shapes unchanged.

With `chunks` > 1 the o projection and the MLP run in chunks of the step's tokens, each
chunk's all-reduce started while the next chunk computes (overlap.py says why rows); the
sums are waited for before the residual add.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusegen.engine.parallel.overlap import SumTimes, summed_in_chunks
from fusegen.engine.weights.linear import Linear


class TPGroup:
    """A rank's tensor-parallel group, counting the bytes its collectives move (ring
    algorithms: an all-reduce of n bytes sends and receives 2 (T - 1) / T * n per rank,
    an all-gather (T - 1) / T of the gathered bytes)."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        self.bytes_sent = 0
        self.num_calls = 0
        self.times: dict[str, SumTimes] = {}  # "layer.part" ("3.o", "3.mlp") -> its totals

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
            self._count(self.all_reduce_bytes(t))
        return t

    def start_all_reduce(self, t: torch.Tensor):
        """Start summing `t` in place over the group; wait on the returned work handle
        before reading it."""
        work = dist.all_reduce(t, group=self.group, async_op=True)
        self._count(self.all_reduce_bytes(t))
        return work

    def all_reduce_bytes(self, t: torch.Tensor) -> int:
        """Bytes a rank sends (and receives) in a ring all-reduce of `t`."""
        return 2 * (self.size - 1) * t.numel() * t.element_size() // self.size

    def overlap_stats(self) -> dict[str, dict]:
        """Per layer and part, its sums' totals (overlap.SumTimes) as plain values."""
        return {key: dataclasses.asdict(t) for key, t in self.times.items()}

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' tensors (equal shapes) concatenated along `dim` in rank order."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        self._count((self.size - 1) * t.numel() * t.element_size())
        return torch.cat(parts, dim=dim)

    def _count(self, nbytes: int) -> None:
        self.bytes_sent += nbytes
        self.num_calls += 1


class _RankShare(nn.Module):
    """A module over one rank's share `inner` (any storage form): the loader sets its
    weights and reads its weight and bytes through the wrapper."""

    inner: Linear

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        self.inner.set_weight(name, tensor)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class RowParallelLinear(_RankShare):
    """A linear whose input columns are split over the ranks: each computes its partial
    product through `inner` (any storage form, built without bias), the partials are
    summed (in `chunks` runs of rows, overlap.summed_in_chunks), the bias (whole) is
    added once after the sum. `times` None: the partial product alone, which the caller
    sums and adds the bias to (a chunked MLP, `_ChunkedMlp`)."""

    def __init__(self, inner: Linear, bias: bool, group: TPGroup, chunks: int = 1,
                 times: SumTimes | None = None):
        super().__init__()
        self.inner, self.group, self.chunks, self.times = inner, group, chunks, times
        self.bias = torch.empty(0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.times is None:
            return self.inner(x)
        out = summed_in_chunks(self.inner, x, self.group, self.chunks, self.times)
        return out if self.bias is None else out + self.bias

    __call__ = forward

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            self.bias = tensor
        else:
            super().set_weight(name, tensor)

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.bias is None else
                                 self.bias.numel() * self.bias.element_size())


class VocabParallelHead(_RankShare):
    """The LM head split by vocabulary rows: `forward` gives the whole [N, V] logits
    (the ranks' slices gathered in rank order), so a model's `logits` (soft-capping
    included) runs unchanged; `argmax` gives argmax(forward(h)) to the bit, exchanging
    one (value, index) pair per row and rank instead of the logits."""

    def __init__(self, inner: Linear, vocab_start: int, group: TPGroup):
        super().__init__()
        self.inner, self.vocab_start, self.group = inner, vocab_start, group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.inner(h), dim=-1)

    __call__ = forward

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        # The rank's logits are the columns the whole head would compute for its rows
        # (each output element is summed the same way), so the first maximum over the
        # ranks' first maxima, in rank order, is the whole row's first maximum.
        values, index = self.inner(h).float().max(dim=-1)  # [N] each, first maximum
        pairs = self.group.all_gather(torch.stack([values, (index + self.vocab_start)
                                                   .float()], dim=1), dim=1)  # [N, 2T]
        values, indexes = pairs[:, 0::2], pairs[:, 1::2]
        best = values.argmax(dim=1, keepdim=True)  # first rank holding the maximum
        return indexes.gather(1, best).squeeze(1).long()


def parallelize(model, group: TPGroup, vocab: tuple[int, int], chunks: int = 1) -> None:
    """Make `model` (built from rank_model_config, weights not yet loaded) one rank's
    share: row-parallel o and down (a mixture of experts: its output summed), a
    vocabulary-parallel lookup and head. A tied head stays the embedding's slice
    (CausalLM.load_fixed points it there). `chunks` > 1: o and the MLP summed in that
    many runs of the step's rows, each run's all-reduce overlapping the next's compute."""
    from fusegen.engine.models.moe import MoeLayer

    if group.size == 1:
        return
    for index, layer in enumerate(model.layers):
        layer.o = _row_parallel(layer.o, group, chunks, group.times.setdefault(
            f"{index}.o", SumTimes()))
        times = group.times.setdefault(f"{index}.mlp", SumTimes())
        if isinstance(layer, MoeLayer):  # the experts' down stays local; one sum after
            layer._mlp = _ChunkedMlp(layer._mlp, None, group, chunks, times)
        elif chunks > 1:  # down gives its partial product; the whole MLP is chunked
            layer.down = _row_parallel(layer.down, group, chunks, None)
            layer._mlp = _ChunkedMlp(layer._mlp, layer.down, group, chunks, times)
        else:
            layer.down = _row_parallel(layer.down, group, chunks, times)
    start, end = vocab
    model.lookup = _vocab_lookup(model, start, end, group)
    model.lm_head = VocabParallelHead(model.lm_head, start, group)


def _row_parallel(linear: Linear, group: TPGroup, chunks: int,
                  times: SumTimes | None) -> RowParallelLinear:
    return RowParallelLinear(Linear(bias=False), linear.bias is not None, group, chunks, times)


class _ChunkedMlp:
    """A layer's MLP (its own `_mlp`, down giving the rank's partial product) summed
    over the group in `chunks` runs of rows, then down's bias (`down` None: none, a
    mixture of experts)."""

    def __init__(self, mlp, down: RowParallelLinear | None, group: TPGroup, chunks: int,
                 times: SumTimes):
        self.mlp, self.down, self.group, self.chunks, self.times = mlp, down, group, chunks, times

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = summed_in_chunks(self.mlp, x, self.group, self.chunks, self.times)
        bias = None if self.down is None else self.down.bias
        return out if bias is None else out + bias


def _vocab_lookup(model, start: int, end: int, group: TPGroup):
    def lookup(input_ids: torch.Tensor) -> torch.Tensor:
        # ids outside the slice look up row 0 and are zeroed: after the sum each token
        # has exactly its one rank's row (x + 0 == x, bit for bit)
        outside = (input_ids < start) | (input_ids >= end)
        rows = F.embedding((input_ids - start).masked_fill(outside, 0), model.embed)
        return group.all_reduce(rows.masked_fill_(outside.unsqueeze(1), 0.0))
    return lookup
