"""What a finished request gives back, in the shape of vLLM's offline API: one
`RequestOutput` per prompt holding one `CompletionOutput` per completion (`n` of them),
plus fusegen's own fields (`error`, `num_cached_tokens`, `structured_valid`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusegen.engine.detokenizer import output_text
from fusegen.engine.request import RequestGroup  # noqa: F401 - where callers found it

if TYPE_CHECKING:
    from fusegen.engine.logprobs import Logprob
    from fusegen.engine.request import Request
    from fusegen.engine.tokenizer import Tokenizer

# One dict per position: the sampled (or prompt) token and the top-k, by token id.
PositionLogprobs = dict[int, "Logprob"]


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the prompt's n completions, 0 .. n-1
    text: str  # generated text, special tokens skipped, cut before a matched stop string
    token_ids: list[int]  # generated ids (eos/stop ids included)
    finish_reason: str | None  # "stop", "length", "error" or "abort"
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs
    logprobs: list[PositionLogprobs] | None = None  # one per generated token, when asked
    stop_reason: int | str | None = None  # the stop string or token id that ended it; None for eos
    structured_valid: bool | None = None  # output completes its grammar; None: unconstrained

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: int
    prompt: str | None  # the prompt's text; None when it was given as token ids
    prompt_token_ids: list[int]
    # sorted by index; one (finish_reason "error") for a prompt that produced nothing, all
    # n when a completion failed mid-output (that one's finish_reason "error")
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first entry None
    finished: bool = True
    error: str | None = None  # "code: message" when finish_reason == "error"
    num_cached_tokens: int = 0  # prompt tokens whose KV blocks came from the prefix cache

    # fusegen's properties before completions had their own objects: the first one's.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.outputs)

    @property
    def error_code(self) -> str | None:
        return None if self.error is None else self.error.split(": ", 1)[0]

    @classmethod
    def failed(cls, request_id: int, error: str, prompt: str | None = None,
               prompt_token_ids: list[int] | None = None) -> RequestOutput:
        """A prompt that produced nothing: one completion, finish_reason "error", whatever
        its `n` (the prompt failed once, not each completion)."""
        return cls(request_id, prompt, list(prompt_token_ids or []),
                   [CompletionOutput(0, "", [], "error")], error=error)

    @classmethod
    def from_requests(cls, request_id: int, requests: list[Request],
                      tokenizer: Tokenizer) -> RequestOutput:
        """One prompt's finished requests (its n completions, any order) as one output;
        what the prompt shares (its ids, logprobs, cached tokens) is read off the first."""
        requests = sorted(requests, key=lambda r: r.index)
        first = requests[0]
        decode = _TokenText(tokenizer)
        # A completion that ended in error makes the prompt's output an error (its first).
        error = next((r.error for r in requests if r.error is not None), None)
        return cls(request_id, first.prompt, first.prompt_token_ids,
                   [completion(r, tokenizer, decode) for r in requests],
                   prompt_logprobs=decode.fill(first.prompt_logprobs),
                   num_cached_tokens=first.num_cached_tokens, error=error)

    @classmethod
    def from_request(cls, request: Request, tokenizer: Tokenizer) -> RequestOutput:
        return cls.from_requests(request.request_id, [request], tokenizer)


def completion(request: Request, tokenizer: Tokenizer,
               decode: _TokenText | None = None) -> CompletionOutput:
    """A finished request's completion. With stop strings its detokenizer holds the text,
    already cut at the match; without, the whole output is decoded once, here
    (`output_text`)."""
    output_ids = request.output_token_ids
    text = output_text(tokenizer, request)
    decode = decode or _TokenText(tokenizer)
    return CompletionOutput(request.index, text, output_ids, request.finish_reason,
                            cumulative_logprob=request.cumulative_logprob,
                            logprobs=decode.fill(request.logprobs),
                            stop_reason=_stop_reason(request, output_ids),
                            structured_valid=request.structured_valid)


def _stop_reason(request: Request, output_ids: list[int]) -> int | str | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the completion;
    None for eos and length."""
    if request.finish_reason != "stop" or not output_ids:
        return None
    if request.detokenizer is not None and request.detokenizer.stopped:
        return request.detokenizer.stop_string
    last = output_ids[-1]
    eos = not request.params.ignore_eos and last in request.eos_token_ids
    return last if last in request.params.stop_token_ids and not eos else None


class _TokenText:
    """Each token id's text, decoded once per output: `Logprob.decoded_token`."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def fill(self, positions: list[PositionLogprobs | None] | None):
        if positions is None:
            return None
        for logprobs in positions:
            for token_id, logprob in (logprobs or {}).items():
                if logprob.decoded_token is None:
                    logprob.decoded_token = self._text(token_id)
        return positions

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text
