"""Batched sampling with per-request parameters.

All rows are handled in one pass: temperature, top-k, min-p and top-p become masks
over one [N, vocab] tensor, and the draw is an exponential race (argmax of p / q with
q ~ Exp(1)), which samples from p without normalising. A request with a `seed` draws
its q from its own generator, so its tokens do not depend on what it was batched
with; the others share the engine's generator in one call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fusegen.engine.request import Request
from fusegen.engine.sampling_params import SamplingParams
from fusegen.kernels.argmax import argmax


@dataclass(slots=True)
class SamplingBatch:
    params: list[SamplingParams]  # one per logits row
    generators: list[torch.Generator | None]  # per-row generator for seeded requests


class Sampler:
    def __init__(self, device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def generator_for(self, request: Request) -> torch.Generator | None:
        """The request's own generator if it is seeded and samples, made on its first
        draw; it lives on the request, so after a preemption its stream goes on."""
        params = request.params
        if params.seed is None or params.temperature == 0.0:
            return None
        if request.generator is None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(params.seed)
        return request.generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # logits [N, vocab] fp32 -> token ids [N]
        params = batch.params
        if all(p.temperature == 0.0 for p in params):
            return argmax(logits)
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 for p in params):
            logits = _top_k(logits, [p.top_k for p in params])
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=probs.device)
            floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < floor, 0.0)
        if any(p.top_p < 1.0 for p in params):
            probs = _top_p(probs, torch.tensor([p.top_p for p in params], device=probs.device))
        q = torch.empty_like(probs)
        if not all(batch.generators):  # rows without a seed share the engine's stream
            q.exponential_(generator=self.generator)
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                q[row].exponential_(generator=gen)
        sampled = argmax(probs.div_(q))
        greedy = torch.tensor([p.temperature == 0.0 for p in params], device=logits.device)
        if greedy.any():
            sampled = torch.where(greedy, argmax(logits), sampled)
        return sampled


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in ks]
    k = torch.tensor(ks, device=logits.device).unsqueeze(1)
    top = logits.topk(max(ks), dim=-1).values  # [N, max_k], descending
    kth = top.gather(1, k - 1)  # [N, 1]: the k-th largest of each row
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # Keep the smallest set of most likely tokens whose mass reaches top_p.
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p.unsqueeze(1) * sorted_probs.sum(-1, keepdim=True)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
