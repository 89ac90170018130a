"""What a finished request gives back."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    text: str  # generated text, special tokens skipped, cut before a matched stop string
    token_ids: list[int] = field(default_factory=list)  # generated ids (eos/stop ids included)
    finish_reason: str = "length"  # "stop", "length" or "error"
    num_prompt_tokens: int = 0
    error: str | None = None  # "code: message" when finish_reason == "error"

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)
