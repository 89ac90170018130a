"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong in two ways: a character whose UTF-8 bytes span
several tokens (byte-level BPE pieces, SentencePiece `<0xE2>` byte-fallback tokens) comes
out as U+FFFD, and SentencePiece decoders strip the leading space of the first token they
see, so " world" after a prompt would lose its space. Instead every step decodes a short
window `ids[prefix_offset:]` that starts a few tokens back (in the prompt at first) and
keeps only what lies beyond the already-committed `ids[prefix_offset:read_offset]`. The
offsets advance only when the window's text ends in a whole character.

The result equals decode(prompt + output) minus decode(prompt), as transformers'
pipelines compute it.

A finished request's text (`output_text`) is vLLM's: special tokens left out unless
`skip_special_tokens` is False, and the stop string or stop token that ended it (an
end-of-sequence or `stop_token_ids` token) left out unless `include_stop_str_in_output`.
"""
from __future__ import annotations

from fusegen.engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context: enough for any decoder's leading-space rule
_REPLACEMENT = "\ufffd"  # what the decoders emit for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop_str  # the text ends after the stop string, not before
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])  # the window never looks further back
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)  # decode(ids[prefix_offset:read_offset])
        self._stop = [s for s in stop if s]
        self._lookback = max((len(s) for s in self._stop), default=1) - 1
        self._committed = ""  # text of whole characters, searched for stop strings
        self._pending = ""  # an incomplete character at the end (U+FFFD), replaced once completed
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched, once stopped

    @property
    def text(self) -> str:
        """Generated text so far; once stopped, everything before the stop string."""
        return self._committed + self._pending

    def add(self, token_ids: list[int]) -> bool:
        """Feed newly generated ids; True once a stop string has matched (later calls are no-ops)."""
        for token_id in token_ids:  # one at a time: a stop ends generation at the token completing it
            if self.add_token(token_id):
                break
        return self.stopped

    def add_token(self, token_id: int) -> bool:
        """Feed one generated id (the step's path: no list per token); True once stopped."""
        if self.stopped:
            return True
        self._ids.append(token_id)
        new_text = self._next_text()
        if new_text:
            self._check_stop(new_text)
        return self.stopped

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _next_text(self) -> str:
        """Text of whole characters added since the last call; advances the window."""
        window_text = self._decode(self._ids[self._prefix_offset:])
        if window_text.endswith(_REPLACEMENT):
            # Wait for the character's remaining bytes; still show it as U+FFFD meanwhile
            # so that generation cut here reads like transformers' decode.
            self._pending = window_text[len(self._prefix_text):]
            return ""
        self._pending = ""
        new_text = window_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:])
        # Drop ids the window will never look at again, so memory stays bounded.
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        return new_text

    def _check_stop(self, new_text: str) -> None:
        # A stop string can end only in the new text and start at most len(stop)-1 chars
        # before it; of the matches, the earliest in the text wins.
        start = max(len(self._committed) - self._lookback, 0)
        self._committed += new_text
        found = [(i, s) for s in self._stop if (i := self._committed.find(s, start)) != -1]
        if found:
            at, self.stop_string = min(found, key=lambda hit: hit[0])  # first listed on ties
            if self._include_stop:
                at += len(self.stop_string)
            self._committed = self._committed[:at]
            self._pending = ""
            self.stopped = True


def output_text(tokenizer: Tokenizer, request) -> str:
    """A finished request's text: its detokenizer's (cut at the stop string) or the
    output decoded once, without the text of the stop token that ended it unless its
    params include it."""
    params, output_ids = request.params, request.output_token_ids
    detok = request.detokenizer
    if detok is not None and detok.stopped:
        return detok.text
    if ended_by_stop_token(request) and not params.include_stop_str_in_output:
        output_ids = output_ids[:-1]
    elif detok is not None:
        return detok.text
    return detokenize(tokenizer, request.prompt_token_ids, output_ids,
                      params.skip_special_tokens)


def ended_by_stop_token(request) -> bool:
    """Whether the request's last token is the end-of-sequence or `stop_token_ids` token
    that stopped it."""
    if request.finish_reason != "stop" or not request.output_token_ids:
        return False
    last, params = request.output_token_ids[-1], request.params
    return last in params.stop_token_ids or (not params.ignore_eos
                                             and last in request.eos_token_ids)


def detokenize(tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int],
               skip_special_tokens: bool = True) -> str:
    """One-shot: the text IncrementalDetokenizer produces for `output_ids` with no stop strings."""
    context = list(prompt_ids[-_CONTEXT_TOKENS:])
    prefix_text = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(context + list(output_ids), skip_special_tokens=skip_special_tokens)[len(prefix_text):]
