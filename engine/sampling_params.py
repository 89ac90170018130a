"""Per-request sampling parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16  # generated tokens at most (the prompt does not count)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 keeps all
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token), in [0, 1]
    seed: int | None = None  # per-request generator: output independent of batching
    stop: list[str] = field(default_factory=list)  # cut from the text when produced
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> str | None:
        """The first broken limit as a user-facing message, or None when valid.

        The engine turns a message into an `invalid_params` error of that request
        only; the rest of the batch is unaffected.
        """
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            return f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
        if not _is_number(self.temperature) or math.isnan(self.temperature) or self.temperature < 0:
            return f"temperature must be a number >= 0, got {self.temperature!r}"
        if math.isinf(self.temperature):
            return "temperature must be finite, got inf"
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if not _is_int(self.top_k) or self.top_k < -1:
            return f"top_k must be an integer >= -1 (-1 or 0 disables it), got {self.top_k!r}"
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p!r}"
        if self.seed is not None and not _is_int(self.seed):
            return f"seed must be an integer or None, got {self.seed!r}"
        if any(not isinstance(s, str) or not s for s in self.stop):
            return f"stop must be a list of non-empty strings, got {self.stop!r}"
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            return f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
        return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
