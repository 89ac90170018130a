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
        # Only None, one string or a collection become a list: anything else (a number, a
        # mapping whose keys would pass as strings) stays as given for validate() to name.
        self.stop = _as_list([self.stop] if isinstance(self.stop, str) else self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> str | None:
        """The first broken limit as a user-facing message, or None when valid.

        The engine turns a message into an `invalid_params` error of that request
        only; the rest of the batch is unaffected.
        """
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            return f"max_tokens must be an integer >= 1, got {_show(self.max_tokens)}"
        if not _is_number(self.temperature) or self.temperature != self.temperature \
                or self.temperature < 0:
            return f"temperature must be a number >= 0, got {_show(self.temperature)}"
        if not _is_finite(self.temperature):  # it goes into a float tensor
            return f"temperature must be finite, got {_show(self.temperature)}"
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {_show(self.top_p)}"
        if not _is_int(self.top_k) or self.top_k < -1:
            return f"top_k must be an integer >= -1 (-1 or 0 disables it), got {_show(self.top_k)}"
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {_show(self.min_p)}"
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**64):
            # The generator takes 64 bits: a larger seed would fail the whole batch's step.
            return f"seed must be an integer in [0, 2**64) or None, got {_show(self.seed)}"
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s
                                                  for s in self.stop):
            return f"stop must be a list of non-empty strings, got {_show(self.stop)}"
        if not isinstance(self.stop_token_ids, list) or any(
                not _is_int(t) or t < 0 for t in self.stop_token_ids):
            return ("stop_token_ids must be non-negative integers, got "
                    f"{_show(self.stop_token_ids)}")
        return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _as_list(value):
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set, frozenset)) else value


def _show(value, limit: int = 200) -> str:
    """A value as an error message quotes it: its repr, cut short."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's int-to-text limit (4,300 digits)
        return f"an integer of {value.bit_length():,} bits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
