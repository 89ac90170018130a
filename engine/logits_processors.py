"""vLLM's logits processors, batched over the rows of one [N, V] fp32 logits tensor that
use them, in vLLM's order: bad_words, min_tokens, logit_bias, then the penalties
(repetition, frequency, presence). Each is one indexed op over its rows; rows whose
request sets none of them are never indexed (the sampler passes only processed rows).

A request's penalty counts live in its `LogitsState` ([V] tensors on the logits'
device), brought up to date with the tokens generated since the last step, so a long
output costs one small update a step, not a recount.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fusegen.engine.request import Request
    from fusegen.engine.sampling_params import SamplingParams
    from fusegen.engine.tokenizer import Tokenizer


@dataclass(slots=True, eq=False)
class LogitsState:
    """One request's processor state; None where its params do not need it."""
    counts: torch.Tensor | None = None  # [V] fp32: generated tokens' counts (presence, frequency)
    seen: torch.Tensor | None = None  # [V] bool: prompt and generated tokens (repetition)
    bias_ids: torch.Tensor | None = None  # [B] int64: logit_bias's tokens
    bias_values: torch.Tensor | None = None  # [B] fp32: their biases
    stop_ids: list[int] | None = None  # masked while short of min_tokens (a list: no sync)
    num_counted: int = 0  # generated tokens already in counts / seen

    @classmethod
    def make(cls, request: Request, vocab: int, device) -> LogitsState:
        p = request.params
        state = cls()
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            state.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if p.repetition_penalty != 1.0:
            state.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            state.seen[torch.tensor(request.prompt_token_ids, device=device)] = True
        if p.logit_bias:
            state.bias_ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
            state.bias_values = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32,
                                             device=device)
        if p.min_tokens > 0:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else request.eos_token_ids)
            state.stop_ids = sorted(stops)
        return state

    def catch_up(self, request: Request) -> None:
        """Count the tokens generated since the last call (one, after the first step)."""
        if self.counts is None and self.seen is None:
            return
        new = request.token_ids[request.num_prompt_tokens + self.num_counted:]
        if not new:
            return
        device = (self.counts if self.counts is not None else self.seen).device
        ids = torch.tensor(new, dtype=torch.int64, device=device)
        if self.counts is not None:
            self.counts.index_put_((ids,), torch.ones(len(new), device=device), accumulate=True)
        if self.seen is not None:
            self.seen[ids] = True
        self.num_counted += len(new)


def apply_logits_processors(logits: torch.Tensor, rows: list[int],
                            requests: list[Request]) -> None:
    """logits [N, V] fp32, changed in place on `rows` (processed requests' rows);
    `requests[i]` is row i's request."""
    vocab, device = logits.shape[-1], logits.device
    masked, biased, repeated, penalized = [], [], [], []  # (row, request, state)
    for row in rows:
        req = requests[row]
        if req.logits_state is None:
            req.logits_state = LogitsState.make(req, vocab, device)
        state = req.logits_state
        state.catch_up(req)
        p = req.params
        if req.bad_words_ids or (state.stop_ids is not None
                                 and req.num_output_tokens < p.min_tokens):
            masked.append((row, req, state))
        if state.bias_ids is not None:
            biased.append((row, req, state))
        if state.seen is not None:
            repeated.append((row, req, state))
        if state.counts is not None:
            penalized.append((row, req, state))
    if masked:
        _mask(logits, masked)
    if biased:
        _bias(logits, biased)
    if repeated:
        _repetition_penalty(logits, repeated)
    if penalized:
        _presence_frequency(logits, penalized)


def _mask(logits: torch.Tensor, rows) -> None:
    # bad_words' banned tokens and, short of min_tokens, the stop tokens -> -inf
    index_rows, index_ids = [], []
    for row, req, state in rows:
        ids = _banned_words(req)
        if state.stop_ids is not None and req.num_output_tokens < req.params.min_tokens:
            ids += state.stop_ids
        index_rows += [row] * len(ids)
        index_ids += ids
    if index_ids:
        where = (torch.tensor(index_rows, device=logits.device),
                 torch.tensor(index_ids, device=logits.device))
        logits.index_put_(where, torch.tensor(float("-inf"), device=logits.device))


def _banned_words(req: Request) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when its tokens before the last
    are the last tokens generated (a one-token word always)."""
    banned = []
    num_output = req.num_output_tokens
    for ids in req.bad_words_ids:
        k = len(ids) - 1
        if k == 0 or (k <= num_output and req.token_ids[-k:] == ids[:-1]):
            banned.append(ids[-1])
    return banned


def _bias(logits: torch.Tensor, rows) -> None:
    index_rows = torch.cat([torch.full_like(s.bias_ids, row) for row, _, s in rows])
    index_ids = torch.cat([s.bias_ids for _, _, s in rows])
    values = torch.cat([s.bias_values for _, _, s in rows])
    logits.index_put_((index_rows, index_ids), values, accumulate=True)


def _repetition_penalty(logits: torch.Tensor, rows) -> None:
    # transformers' RepetitionPenaltyLogitsProcessor over each row's seen tokens
    index = torch.tensor([row for row, _, _ in rows], device=logits.device)
    penalty = torch.tensor([r.params.repetition_penalty for _, r, _ in rows],
                           device=logits.device).unsqueeze(1)  # [R, 1]
    seen = torch.stack([s.seen for _, _, s in rows])  # [R, V]
    sub = logits[index]  # [R, V]
    penalized = torch.where(sub < 0, sub * penalty, sub / penalty)
    logits[index] = torch.where(seen, penalized, sub)


def _presence_frequency(logits: torch.Tensor, rows) -> None:
    # OpenAI's: logit -= frequency * count + presence * (count > 0), generated tokens only
    index = torch.tensor([row for row, _, _ in rows], device=logits.device)
    frequency = torch.tensor([r.params.frequency_penalty for _, r, _ in rows],
                             device=logits.device).unsqueeze(1)  # [R, 1]
    presence = torch.tensor([r.params.presence_penalty for _, r, _ in rows],
                            device=logits.device).unsqueeze(1)  # [R, 1]
    counts = torch.stack([s.counts for _, _, s in rows])  # [R, V]
    sub = logits[index]
    sub -= frequency * counts
    sub -= presence * (counts > 0)
    logits[index] = sub


# -- when the request is made ------------------------------------------------------------

def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word's token ids as it is (leading spaces stripped), and again
    after a space when that gives a different first token and as many tokens (the word
    in the middle of a text)."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            sequences.append(plain)
        if spaced and (not plain or spaced[0] != plain[0] and len(spaced) == len(plain)):
            sequences.append(spaced)
    return sequences


def vocabulary_problem(params: SamplingParams, vocab_size: int) -> str | None:
    """logit_bias's token ids against the model's vocabulary, as a user-facing message."""
    outside = sorted(t for t in params.logit_bias or () if t >= vocab_size)
    if outside:
        return (f"logit_bias has token id {outside[0]} outside the vocabulary "
                f"[0, {vocab_size})")
    return None
