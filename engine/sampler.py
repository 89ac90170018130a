"""Batched sampling with per-request parameters.

All rows are handled in one pass: temperature, top-k, min-p and top-p become masks
over one [N, vocab] tensor, and the draw is an exponential race (argmax of p / q with
q ~ Exp(1)), which samples from p without normalising. A request with a `seed` draws
its q from its own generator, so its tokens do not depend on what it was batched
with; the others share the engine's generator in one call.

Before the draw, only for the rows that use them: logprobs of the raw logits, vLLM's
logits processors (engine/logits_processors.py), then structured output's token masks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fusegen.engine.logits_processors import apply_logits_processors
from fusegen.engine.logprobs import record_sampled
from fusegen.engine.request import Request
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.structured import apply_token_masks
from fusegen.kernels.argmax import argmax


@dataclass(slots=True)
class SamplingBatch:
    params: list[SamplingParams]  # one per logits row
    generators: list[torch.Generator | None]  # per-row generator for seeded requests
    requests: list[Request] = field(default_factory=list)  # one per logits row


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

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """[N, vocab] fp32 logits of these requests' rows -> their tokens [N], each row
        drawn with its request's parameters and, when seeded, its own generator."""
        return self(logits, SamplingBatch([r.params for r in requests],
                                          [self.generator_for(r) for r in requests],
                                          requests))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # logits [N, vocab] fp32 -> token ids [N]
        # One pass decides whether any row needs more than temperature and top-k/p:
        # an option-free batch goes straight to the draw, building nothing else.
        rows = [i for i, r in enumerate(batch.requests)
                if r.processed or r.structured is not None]
        if not rows:
            return self._sample(logits, batch)
        requests = batch.requests
        logprob_rows = [i for i in rows if requests[i].logprobs is not None]
        # logprobs are of the raw logits: kept before anything below changes them
        raw = logits[self._index(logprob_rows, logits)] if logprob_rows else None
        processed = [i for i in rows if requests[i].processed]
        if processed:
            apply_logits_processors(logits, processed, requests)
        # Structured output: the constrained rows' token masks (greedy rows too), after
        # the processors, before temperature and the draw.
        constrained = [i for i in rows if requests[i].structured is not None]
        if constrained:
            apply_token_masks(logits, constrained, [requests[i].structured for i in constrained])
            _check_drawable(logits, [i for i in constrained if requests[i].processed], requests)
        sampled = self._sample(logits, batch)
        if raw is not None:
            record_sampled([requests[i] for i in logprob_rows], raw,
                           sampled[self._index(logprob_rows, logits)])
        return sampled

    @staticmethod
    def plain_greedy(requests: list[Request]) -> bool:
        """Whether every row's token is just the argmax of its logits: greedy, no
        processor, no logprobs, no structured output. Then the runner may take the
        argmax without the logits (a head that computes it directly)."""
        return all(r.params.temperature == 0.0 and not r.processed and r.structured is None
                   for r in requests)

    @staticmethod
    def _index(rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        return _on(logits.device, torch.tensor(rows))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        params = batch.params
        if all(p.temperature == 0.0 for p in params):
            return argmax(logits)
        device = logits.device
        # the rows' parameters in one host tensor, one copy to the device (no sync)
        top_k = any(p.top_k > 0 for p in params)
        min_p = any(p.min_p > 0 for p in params)
        top_p = any(p.top_p < 1.0 for p in params)
        columns = _on(device, torch.tensor([(p.temperature or 1.0, p.min_p, p.top_p)
                                            for p in params], dtype=torch.float32))
        logits = logits / columns[:, 0:1]
        if top_k:
            logits = _top_k(logits, [p.top_k for p in params])
        probs = logits.softmax(dim=-1)
        if min_p:
            floor = probs.amax(dim=-1, keepdim=True) * columns[:, 1:2]
            probs = probs.masked_fill(probs < floor, 0.0)
        if top_p:
            probs = _top_p(probs, columns[:, 2])
        q = torch.empty_like(probs)
        if not all(batch.generators):  # rows without a seed share the engine's stream
            q.exponential_(generator=self.generator)
        for row, gen in enumerate(batch.generators):
            if gen is not None:
                q[row].exponential_(generator=gen)
        sampled = argmax(probs.div_(q))
        greedy = [p.temperature == 0.0 for p in params]
        if any(greedy):
            sampled = torch.where(_on(device, torch.tensor(greedy)), argmax(logits), sampled)
        return sampled


def _check_drawable(logits: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
    """A constrained row whose processors (bad_words; min_tokens, which bans the end of
    sequence) banned every token its grammar allows has nothing to draw: its request
    ends as an error, not with a token of no grammar. Only processed rows can: the
    model's own logits are finite."""
    if not rows:
        return
    drawable = (logits[torch.tensor(rows, device=logits.device)] > float("-inf")).any(-1)
    for i, ok in zip(rows, drawable.tolist()):
        if not ok:
            requests[i].structured.problem = (
                "invalid_params: the request's bad_words or min_tokens ban every token its "
                "structured output constraint allows at output token "
                f"{requests[i].num_output_tokens + 1}; loosen one of them")


def _on(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """A small host tensor on `device`: on a GPU through pinned memory, queued behind
    the stream's work instead of waiting for it (a copy from pageable memory waits)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in ks]
    k = _on(logits.device, torch.tensor(ks)).unsqueeze(1)
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
