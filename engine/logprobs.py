"""Log-probabilities of the model's raw logits (before penalties, masks and temperature,
as vLLM gives them by default): per generated token in the sampler, per prompt token in
the runner, as one dict per position, {token id: Logprob}, holding the chosen token (the
sampled one, or the prompt's next one) and the top k."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from fusegen.engine.request import Logprob

if TYPE_CHECKING:
    from fusegen.engine.request import Request


def position_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                      ks: list[int]) -> list[dict[int, Logprob]]:
    """logprobs [R, V] (log_softmax of the raw logits), chosen [R] token ids, ks the
    top-k per row -> one dict per row: the chosen token with its rank, then the top k
    ranked 1..k (vLLM's order: a chosen token among the top k keeps that entry)."""
    chosen = chosen.view(-1, 1)
    values = logprobs.gather(1, chosen)  # [R, 1]
    ranks = (logprobs >= values).sum(-1)  # [R]: ties rank the chosen token last, as vLLM
    k = max(ks)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)  # [R, k]
    rows = zip(chosen.view(-1).tolist(), values.view(-1).tolist(), ranks.tolist())
    top = zip(top_ids.tolist(), top_values.tolist()) if k else [None] * len(ks)
    out = []
    for (token, value, rank), row_k, row_top in zip(rows, ks, top):
        entry = {token: Logprob(value, rank)}
        if row_k:
            ids, vals = row_top
            for j in range(row_k):
                entry[ids[j]] = Logprob(vals[j], j + 1)
        out.append(entry)
    return out


def record_sampled(requests: list[Request], raw: torch.Tensor, sampled: torch.Tensor) -> None:
    """raw [R, V] fp32 logits of requests' rows (before any processing), sampled [R]:
    each request's entry for the token it just sampled, and its cumulative logprob."""
    logprobs = torch.log_softmax(raw, dim=-1)
    entries = position_logprobs(logprobs, sampled, [r.params.logprobs for r in requests])
    for request, entry, token in zip(requests, entries, sampled.tolist()):
        request.logprobs.append(entry)
        request.cumulative_logprob += entry[token].logprob


def prompt_positions(requests: list[Request], num_scheduled: list[int],
                     query_start: list[int]) -> tuple[list[int], list[int], list[Request]]:
    """Which rows of a step's token stream give prompt logprobs still missing: a prompt
    position p predicts token p + 1, so positions up to the prompt's last but one. With
    chunked prefill each chunk gives its own positions, in order; a recompute after
    preemption gives none again. -> (rows, the tokens they predict, each row's request)."""
    rows, targets, owners = [], [], []
    for i, (req, n) in enumerate(zip(requests, num_scheduled)):
        if req.prompt_logprobs is None:
            continue
        start = req.num_computed_tokens  # the step's first position of this request
        first = max(start, len(req.prompt_logprobs) - 1)
        last = min(start + n, req.num_prompt_tokens - 1)  # exclusive
        for p in range(first, last):
            rows.append(query_start[i] + p - start)
            targets.append(req.prompt_token_ids[p + 1])
            owners.append(req)
    return rows, targets, owners


def record_prompt_logprobs(requests: list[Request], num_scheduled: list[int],
                           query_start: list[int], row_logits: Callable, chunk: int) -> None:
    """Append the step's prompt logprobs to each request that asked for them;
    `row_logits(rows)` gives the raw logits [R, V] fp32 of rows of the token stream,
    called `chunk` rows at a time so the logits stay as small as the sampled ones."""
    rows, targets, owners = prompt_positions(requests, num_scheduled, query_start)
    for start in range(0, len(rows), chunk):
        part = slice(start, start + chunk)
        logits = row_logits(rows[part])
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = torch.tensor(targets[part], device=logits.device)
        entries = position_logprobs(logprobs, chosen,
                                    [r.params.prompt_logprobs for r in owners[part]])
        for request, entry in zip(owners[part], entries):
            request.prompt_logprobs.append(entry)
