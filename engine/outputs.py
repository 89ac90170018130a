"""What a finished request gives back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fusegen.engine.detokenizer import detokenize

if TYPE_CHECKING:
    from fusegen.engine.request import Request
    from fusegen.engine.tokenizer import Tokenizer


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

    @classmethod
    def from_request(cls, request: Request, tokenizer: Tokenizer) -> RequestOutput:
        """A finished request's output. With stop strings its detokenizer holds the text,
        already cut at the match; without, the whole output is decoded once, here."""
        output_ids = request.output_token_ids
        detok = request.detokenizer
        text = detok.text if detok is not None else \
            detokenize(tokenizer, request.prompt_token_ids, output_ids)
        return cls(request.request_id, text, output_ids, request.finish_reason,
                   request.num_prompt_tokens)
