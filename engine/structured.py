"""Structured output: a request's `json_schema`, `regex`, `choice` or `grammar` as a token
mask, through llguidance (why that library: setup.py).

- `StructuredCompiler` (one per engine) compiles each distinct constraint once against the
  engine's tokenizer; a request gets its own `StructuredState`, a copy of the compiled
  matcher (microseconds), which lives on the request.
- Each step, `apply_token_masks` fills the constrained rows' masks (bit i of word j allows
  token 32 j + i) and sets every disallowed logit of those rows to -inf in one batched op,
  greedy rows included; unconstrained rows are never touched.
- The matcher advances only on generated tokens (`StructuredState.accept`, from
  `Request.append_token`): recomputing a preempted request's KV samples nothing, so its
  state survives preemption, swapping and recompute as is.

The end-of-sequence tokens are allowed by the mask only where the grammar accepts, so a
request ends complete (finish_reason "stop", structured_valid True), cut by its length
limit (finish_reason "length", structured_valid False), or, when llguidance gives up on
the grammar mid-output (a limit on its work per token: a row of 5,000 alternatives, a
regex that expands past its lexer's budget), as that request's error (finish_reason
"error", `structured_output_limit`). An errored matcher also reports itself stopped and
its mask allows only end-of-sequence: taken at its word, it would end a cut-off output as
a normal stop. A constraint whose very first mask already fails is refused when the
request is made (`invalid_params`).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fusegen.engine.sampling_params import SamplingParams
    from fusegen.engine.tokenizer import Tokenizer

CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar")
INSTALL_HINT = "pip install 'fusegen[structured]' (or: pip install llguidance)"
_CACHE_SIZE = 256  # distinct constraints kept compiled per engine, least recently used out
_BITS = torch.arange(32, dtype=torch.int32)
STRUCTURED_LIMIT = "structured_output_limit"  # llguidance ran out of a budget mid-output
STRUCTURED_ERROR = "structured_output_error"  # its matcher failed otherwise
# How llguidance words its budgets' errors ("max is 2000", "limit 50000", "too many
# expressions", "too complex", lexer "fuel"); any other failure is STRUCTURED_ERROR.
_LIMIT_WORDS = re.compile(r"max is|limit|too many|too complex|fuel", re.IGNORECASE)
# JSON as json.dumps writes it: free whitespace would let a model pad an object with
# spaces and newlines until max_tokens runs out (a schema's "x-guidance" may override).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def constraint_of(params: SamplingParams) -> tuple[str, str] | None:
    """The request's constraint as (field, text), the text being the cache key. A schema
    given as a dict is dumped as it is: the output lists properties in the schema's order,
    so two orders are two constraints."""
    for name in CONSTRAINT_FIELDS:
        value = getattr(params, name, None)
        if value is None:
            continue
        if name == "json_schema" and not isinstance(value, str):
            return name, json.dumps(value)
        if name == "choice":
            return name, json.dumps(list(value))
        return name, value
    return None


def _grammar_text(llguidance, name: str, text: str) -> str:
    if name == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_LAYOUT)
    if name == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if name == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.grammar_from("grammar", text)  # Lark, or llama.cpp's GBNF


def _import_llguidance():
    try:
        import llguidance
    except ImportError:
        return None
    return llguidance


class StructuredState:
    """One request's position in its grammar."""

    __slots__ = ("matcher", "problem")

    def __init__(self, matcher):
        self.matcher = matcher
        # "code: message" set by the sampler when the request's own processors banned
        # every token the mask allows: what it drew then is no token of the grammar.
        self.problem: str | None = None

    def accept(self, token_id: int) -> bool:
        """Advance over a generated token; True when the request must stop here: the
        output is complete (nothing may follow) or, never with the mask applied, the
        token broke the grammar (then `complete` is False)."""
        return not self.matcher.consume_token(token_id) or self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return not self.matcher.is_error() and self.matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """"code: message" once the matcher has failed (it then also reports itself
        stopped, so `accept`'s True alone never means complete); None while it works."""
        if self.problem is not None:
            return self.problem
        if not self.matcher.is_error():
            return None
        problem = _first_line(self.matcher.get_error())
        code = STRUCTURED_LIMIT if _LIMIT_WORDS.search(problem) else STRUCTURED_ERROR
        return f"{code}: the structured output engine (llguidance) gave up on the " \
               f"constraint mid-output: {problem}"


class StructuredCompiler:
    """Compiles constraints against one tokenizer; thread-safe (requests are made on the
    producers' threads)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width: ids past the tokenizer stay masked
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._lltok = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()

    def state_for(self, params: SamplingParams) -> tuple[StructuredState | None, str | None]:
        """(a fresh matcher state, None), (None, None) for an unconstrained request, or
        (None, "code: message") when the constraint does not compile."""
        try:
            key = constraint_of(params)
        except (TypeError, ValueError) as exc:  # a dict holding what JSON cannot write
            return None, f"invalid_params: json_schema is not JSON: {exc}"
        if key is None:
            return None, None
        llguidance = _import_llguidance()
        if llguidance is None:
            return None, (f"missing_package: {key[0]} needs the llguidance package; "
                          f"install it with {INSTALL_HINT}")
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._compile(llguidance, *key)
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            if isinstance(compiled, str):
                return None, compiled
            return StructuredState(compiled.deep_copy()), None

    def _compile(self, llguidance, name: str, text: str):
        """A matcher at the grammar's start (copied per request), or the error text."""
        try:
            grammar = _grammar_text(llguidance, name, text)
        except (ValueError, TypeError) as exc:
            return f"invalid_params: {name} is not valid: {exc}"
        try:
            lltok = self._llguidance_tokenizer(llguidance)
        except ValueError as exc:  # a tokenizer.json llguidance cannot read
            return f"unsupported_tokenizer: {name} needs a tokenizer llguidance reads: {exc}"
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=_limits(llguidance))
        if not matcher.is_error():
            # The first mask, on a copy: a constraint that fails it (a $ref loop with no
            # finite value, a first row past llguidance's limits) can produce nothing.
            probe = matcher.deep_copy()
            probe.compute_bitmask()
            if probe.is_error():
                return (f"invalid_params: {name} fails at its first token in the structured "
                        f"output engine (llguidance): {_first_line(probe.get_error())}")
        if matcher.is_error():
            problem = _first_line(matcher.get_error())
            return f"invalid_params: {name} is not valid: {problem}"
        return matcher

    def _llguidance_tokenizer(self, llguidance):
        # Built once per engine (about half a second for a 49k vocabulary), from the same
        # tokenizer.json the engine encodes with, so token bytes match exactly.
        if self._lltok is None:
            backend = self._tokenizer._backend  # the `tokenizers` object fusegen encodes with
            n_vocab = max(self._vocab_size, self._tokenizer.vocab_size)
            self._lltok = llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab,
                                                 eos_token=self._eos or None)
        return self._lltok


def _limits(llguidance):
    # llguidance's default budgets; its errors without the parser's state and grammar,
    # which would copy a request's whole schema into its row's error and the logs.
    return llguidance.LLParserLimits(verbose_errors=False)


def _first_line(message: str) -> str:
    # llguidance appends its state, or a Rust backtrace after a panic, below the message
    return message.strip().split("\n", 1)[0].strip()


_executor = None


def _fill_masks(states: list[StructuredState], vocab_size: int) -> torch.Tensor:
    """The rows' allowed-token bitmasks, [R, ceil(V / 32)] int32, filled on llguidance's
    thread pool in one call."""
    global _executor
    if _executor is None:
        import llguidance
        _executor = llguidance.LLExecutor()
    bitmask = torch.empty((len(states), (vocab_size + 31) // 32), dtype=torch.int32)
    # Row k's mask is written at data_ptr + k * row bytes (a contiguous CPU tensor).
    _executor.unsafe_compute_mask_ptr([(s.matcher, k) for k, s in enumerate(states)],
                                      bitmask.data_ptr(), bitmask.shape[1] * 4, len(states))
    return bitmask


def apply_token_masks(logits: torch.Tensor, rows: list[int],
                      states: list[StructuredState]) -> torch.Tensor:
    """Set the disallowed tokens of the constrained `rows` of `logits` [N, V] to -inf,
    in place, with one masked fill over those rows; `states[k]` is row `rows[k]`'s."""
    vocab = logits.shape[-1]
    bitmask = _fill_masks(states, vocab).to(logits.device, non_blocking=True)
    bits = _BITS.to(logits.device)
    # [R, W] -> [R, W, 32] -> [R, 32 W] -> [R, V]: bit i of word j is token 32 j + i
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]
    if len(rows) == logits.shape[0]:
        return logits.masked_fill_(~allowed, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def response_format_schema(response_format) -> dict | str | None:
    """OpenAI's `response_format` as the `json_schema` it asks for: {"type": "text"} (or
    None) -> None, {"type": "json_object"} -> any JSON object, {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}} -> that schema. Raises ValueError
    naming what is wrong."""
    if response_format is None:
        return None
    if isinstance(response_format, str):
        try:
            response_format = json.loads(response_format)
        except ValueError as exc:
            raise ValueError(f"response_format is not JSON: {exc}") from None
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object such as "
                         f'{{"type": "json_object"}}, got {type(response_format).__name__}')
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise ValueError('response_format.type must be "text", "json_object" or '
                         f'"json_schema", got {kind!r}')
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError('response_format of type "json_schema" needs '
                         '"json_schema": {"name": ..., "schema": {...}}')
    return schema

