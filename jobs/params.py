"""Sampling parameters as a job takes them: per-row columns (JSON text, or Arrow structs,
maps and lists), the job's JSON-valued options, and the input columns that look meant as
parameters but are none fusegen takes.

Which columns are parameters (`parameter_columns`): with `--param-columns` given, exactly
those; otherwise every column named exactly like a parameter (`ROW_PARAM_COLUMNS`), less
the columns the prompt is made of (the prompt, template, messages and id columns), which
stay data. Plain Python over plain values: no engine, no Dask.

A per-row cell may be text whatever the parameter: CSV columns are text, and a column
whose cells mix numbers and words (a JSONL column too, or a Parquet string column) is
read as text, so numeric text in a numeric parameter's cell is read as its number ("3"
is 3; "" keeps the job's value) and only a cell that is no number fails its row.
The job's own options and OpenAI batch bodies keep JSON's types.

Values parsed from a cell (JSON text, Arrow lists / structs / maps) nest at most
MAX_DEPTH levels of lists and objects: what reads them (here, the engine's checks, the
grammar compiler) recurses, and a value nested thousands of levels deep would exhaust
Python's stack: it is its row's `invalid_params` error (`TooDeep`) instead.
"""
from __future__ import annotations

import difflib
import json
import math

from fusegen.engine.sampling_params import FIELDS, NAMES
from fusegen.jobs.formats import MAX_JSON_DEPTH, JsonTooDeep, load_json

# Every SamplingParams field: a job sets each, job-wide or per row (the per-row columns
# are named as the fields), in --help order.
SAMPLING_FIELDS = NAMES
RESPONSE_FORMAT = "response_format"  # OpenAI's shape of a json_schema
CONSTRAINT_COLUMNS = ("json_schema", "regex", "choice", "grammar", RESPONSE_FORMAT)
ROW_PARAM_COLUMNS = SAMPLING_FIELDS + (RESPONSE_FORMAT,)
# Sampling options of other engines and APIs that fusegen does not take: a column named
# so is surely meant as one, and is reported rather than silently kept as data.
FOREIGN_PARAMS = frozenset({
    "best_of", "use_beam_search", "length_penalty", "early_stopping", "max_new_tokens",
    "max_completion_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "top_logprobs", "do_sample",
    "typical_p", "num_return_sequences", "no_repeat_ngram_size", "min_new_tokens"})
# The parameters whose text cells are read as numbers or words (`SamplingParams` kinds).
_INTS, _FLOATS, _BOOLS = (tuple(f.name for f in FIELDS if f.metadata["kind"] is kind)
                          for kind in (int, float, bool))
# Levels of lists and objects a parsed value may nest: the limit of a JSONL line
# (`jobs/formats.py` says why), so a value is refused alike whatever file holds it.
MAX_DEPTH = MAX_JSON_DEPTH


class ParamError(ValueError):
    """A value that cannot become its parameter; the message names the fix."""


class TooDeep(ParamError):
    """A parsed value nested more than MAX_DEPTH levels (its message follows its name)."""

    def __init__(self, limit: int = MAX_DEPTH):
        super().__init__(f"is nested more than {limit} levels deep (lists and objects); "
                         f"fusegen reads at most {limit}: flatten it")


def nesting_problem(value, limit: int = MAX_DEPTH) -> TooDeep | None:
    """TooDeep when lists / dicts in `value` nest deeper than `limit`, else None. Walked
    without recursion: the deep values are the ones that would exhaust the stack."""
    stack = [(value, 1)] if isinstance(value, (dict, list, tuple)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return TooDeep(limit)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list, tuple)))
    return None


def read_json(text: str | bytes, max_depth: int | None = MAX_DEPTH):
    """JSON text as its value. Raises TooDeep past `max_depth` levels (None: whatever
    json.loads reads without exhausting the stack) and ValueError for text that is no
    JSON (json's message)."""
    try:
        return json.loads(text) if max_depth is None else load_json(text, max_depth)
    except JsonTooDeep:
        raise TooDeep(max_depth) from None
    except RecursionError:  # json.loads recurses once per level
        raise TooDeep(MAX_DEPTH) from None


def lone_surrogate(value) -> tuple[str, str, int] | None:
    """(where, character, index) of the first lone surrogate in a string of `value`, or
    None: JSON's "\\ud800" reads as one, and no UTF-8 file can hold it. `where` is the
    string's path from `value` ("", "[0].content", "['a b']", " key 'k'": a key)."""
    stack = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return where, item[exc.start], exc.start
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append((f"{where}.{key}" if str(key).isidentifier() else
                              f"{where}[{key!r}]", child))
                stack.append((f"{where} key {key!r}", key))
        elif isinstance(item, (list, tuple)):  # (a list of token ids: nothing to push)
            stack.extend((f"{where}[{i}]", child) for i, child in reversed(list(enumerate(item)))
                         if isinstance(child, (str, dict, list, tuple)))
    return None


def coerce(name: str, value, text_numbers: bool = False):
    """A cell (or option) as its SamplingParams value. Undoes storage widening (a nullable
    int column read as float) and reads JSON text; `text_numbers` (per-row cells): a
    numeric or boolean parameter's text is read as its value. What is still wrong is left
    for `SamplingParams.validate()` to name, or raises ParamError when it cannot be read
    (TooDeep: nested past MAX_DEPTH)."""
    if isinstance(value, (dict, list, tuple)):  # before anything walks it recursively
        problem = nesting_problem(value)
        if problem:
            raise problem
    if text_numbers and isinstance(value, str) and name in _INTS + _FLOATS + _BOOLS:
        value = _from_text(name, value)
    if name in _INTS and isinstance(value, float) and value.is_integer():
        return int(value)
    if name in _FLOATS and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if name in ("stop", "regex", "grammar"):
        return [value] if name == "stop" and isinstance(value, str) else value
    reader = _READERS.get(name)
    return reader(value) if reader else value


def _from_text(name: str, text: str):
    """A numeric or boolean parameter's text cell as its value; ParamError naming the
    value when it is none."""
    word = text.strip()
    if name in _BOOLS:
        if word.lower() in ("true", "false"):
            return word.lower() == "true"
        raise ParamError(f"must be true or false, got {_shown(text)}")
    try:
        return int(word)  # exact: a seed may pass 2**53
    except ValueError:
        pass
    try:
        number = float(word)
    except ValueError:
        number = None
    if name in _FLOATS and number is not None:
        return number
    if number is not None and math.isfinite(number) and number.is_integer():
        return int(number)
    raise ParamError(f"must be {'a number' if name in _FLOATS else 'an integer'}, "
                     f"got {_shown(text)}")


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "..."


def _json(value, what: str):
    """JSON text as its value (nested at most MAX_DEPTH levels); anything else as is."""
    if not isinstance(value, str):
        return value
    try:
        return read_json(value)
    except TooDeep:
        raise
    except ValueError as exc:
        raise ParamError(f"is not JSON ({exc}); write it as {what}") from None


def _token_ids(value):
    value = _json(value, "a JSON list of token ids")
    return [value] if isinstance(value, int) and not isinstance(value, bool) else value


def _logit_bias(value):
    value = _json(value, 'a JSON object of token id -> bias, e.g. {"50256": -100}')
    if isinstance(value, list):  # an Arrow map<int, float> reads as (key, value) pairs
        try:
            value = dict(value)
        except (TypeError, ValueError):
            raise ParamError("must map token ids to biases, e.g. {\"50256\": -100}") from None
    if not isinstance(value, dict):
        raise ParamError(f"must map token ids to biases, got {type(value).__name__}")
    bias = {}
    for key, b in value.items():
        if b is None:  # a struct column has every key in every row
            continue
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ParamError(f"keys must be token ids (integers), got {key!r}") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise ParamError(f"values must be numbers, got {b!r} for token {token}")
        bias[token] = float(b)
    return bias


def _words(value):
    """A list of strings; plain text (not a JSON list) is one word."""
    if isinstance(value, str) and not value.lstrip().startswith("["):
        return [value]
    return _json(value, 'a JSON list of strings, e.g. ["foo", "bar baz"]')


def _choice(value):
    return _json(value, 'a JSON list of strings, e.g. ["yes", "no"]')


def _schema(value):
    value = _json(value, "a JSON Schema object")
    return _drop_nulls(value) if isinstance(value, dict) else value


def _response_format(value):
    """OpenAI's response_format -> the json_schema it asks for (None: plain text)."""
    from fusegen.engine.structured import response_format_schema

    try:
        return response_format_schema(_drop_nulls(_json(value, '{"type": "json_object"}')))
    except ParamError:
        raise
    except ValueError as exc:
        raise ParamError(f"is not a valid response_format: {exc}") from None


def _drop_nulls(value):
    """A struct column's value without the keys other rows have and this one lacks."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


_READERS = {"stop_token_ids": _token_ids, "logit_bias": _logit_bias, "bad_words": _words,
            "choice": _choice, "json_schema": _schema, RESPONSE_FORMAT: _response_format}


def row_changes(row: dict, columns) -> dict:
    """The row's non-null parameter cells as SamplingParams changes (`response_format`
    becomes `json_schema`); numeric text read as its number, and blank text in a numeric
    column is no value, as an empty CSV cell of a numeric column is null. Raises
    ParamError with the column named."""
    changes = {}
    for name in columns:
        value = row.get(name)
        if value is None or (name in _INTS + _FLOATS + _BOOLS and isinstance(value, str)
                             and not value.strip()):
            continue
        try:
            changes["json_schema" if name == RESPONSE_FORMAT else name] = coerce(
                name, value, text_numbers=True)
        except ParamError as exc:
            raise ParamError(f"column {name!r} {exc}") from None
    if "json_schema" in changes and changes["json_schema"] is None:
        del changes["json_schema"]  # response_format {"type": "text"}: no constraint
    if RESPONSE_FORMAT in columns and row.get(RESPONSE_FORMAT) is not None \
            and row.get("json_schema") is not None:
        raise ParamError("columns 'json_schema' and 'response_format' are both set; a "
                         "row's schema comes from one of them: leave the other null")
    return changes


def parameter_columns(columns, declared: list[str] | None, data: set) -> list[str]:
    """The input's per-row parameter columns: `declared` (--param-columns) when given,
    else those named like a parameter that the prompt is not made of (`data`)."""
    if declared is not None:
        return [c for c in declared if c in set(columns)]
    return [c for c in columns if c in ROW_PARAM_COLUMNS and c not in data]


def column_warnings(columns, declared: list[str] | None, data: set) -> list[str]:
    """One message per input column that looks meant as a sampling parameter but will not
    be one. None with --param-columns: the user said which columns are parameters."""
    if declared is not None:
        return []
    return [w for w in (_warning(c, c in data) for c in columns) if w]


def _warning(column: str, feeds_prompt: bool) -> str | None:
    if column in ROW_PARAM_COLUMNS:
        return (f"column {column!r} feeds the prompt, so it is data, not the per-row "
                f"{column!r} parameter; list it in --param-columns to make it both"
                ) if feeds_prompt else None
    if feeds_prompt:
        return None
    name = column.strip().lower().replace("-", "_").replace(" ", "_")
    if name in ROW_PARAM_COLUMNS:
        return (f"column {column!r} is not a parameter column: they are named exactly like "
                f"the parameter ({name!r}); it is kept as data and does not change generation")
    if name in FOREIGN_PARAMS:
        return (f"column {column!r} names a sampling parameter this fusegen does not take; "
                "it is kept as data and does not change generation")
    close = difflib.get_close_matches(name, ROW_PARAM_COLUMNS, n=1, cutoff=0.8)
    if close:
        return (f"column {column!r} is not a parameter fusegen knows (did you mean "
                f"{close[0]!r}?); it is kept as data and does not change generation")
    return None


def check_declared(declared: list[str]) -> None:
    """--param-columns names parameters only; raises ParamError naming a close one."""
    for name in declared:
        if name not in ROW_PARAM_COLUMNS:
            close = difflib.get_close_matches(name, ROW_PARAM_COLUMNS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ParamError(f"param_columns: {name!r} is not a sampling parameter; {hint}"
                             f"parameters: {', '.join(ROW_PARAM_COLUMNS)}")
