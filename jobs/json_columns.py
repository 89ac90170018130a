"""JSONL rows as Arrow columns, every value exactly or not at all.

A column takes the type that holds every value of its first value's kind in the file
(numbers, strings, booleans, arrays, objects; ints and floats together are float64, nested
types widened as pyarrow widens them). Reading converts each value to that type and checks it
came back the same: a value that does not fit (`true` in a float64 column, `"hot"` in a
numeric one, an int past float64's exact range) is its row's error, never truncated or
changed (`0.9` into int64 would read as 0).
"""
from __future__ import annotations

import json
import math

import pyarrow as pa

CONVERT_ERRORS = (pa.ArrowException, ValueError, TypeError, OverflowError)
_KIND_TYPES = {"number": pa.int64(), "string": pa.string(), "boolean": pa.bool_()}


def row_schema(rows: list[dict], kinds: dict) -> pa.Schema:
    """Columns in order of first appearance, each of `column_type`. `kinds`: each
    column's kind, set by its first value in the file (this adds the columns new here),
    so that every group of rows of a file types a column by the same kind."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    fields = []
    for name in names:
        values = [v for v in (r.get(name) for r in rows) if v is not None]
        if values:
            kinds.setdefault(name, _kind(values[0]))
        fields.append(pa.field(name, column_type(values, kinds.get(name))))
    return pa.schema(fields)


def column_type(values: list, kind: str | None) -> pa.DataType:
    """The type holding every non-null value of `kind` (see the module's docstring);
    null when there is none."""
    values = [v for v in values if v is not None and _kind(v) == kind]
    if not values:
        return pa.null()
    try:
        return pa.array(values).type
    except CONVERT_ERRORS:
        pass
    found = None  # value by value, in order: those that do not fit are errors when read
    for v in values:
        try:
            new = pa.array([v]).type
        except CONVERT_ERRORS:
            continue
        found = new if found is None else (widen(found, new) or found)
    return found or _KIND_TYPES.get(kind, pa.null())


def _kind(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def widen(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """The type both widen to (int64 + float64 -> float64, null + x -> x); None if none."""
    try:
        return pa.unify_schemas([pa.schema([("x", a)]), pa.schema([("x", b)])],
                                promote_options="permissive").field(0).type
    except (pa.ArrowException, TypeError):
        return None


def to_table(rows: list[dict | None], schema: pa.Schema) -> tuple[pa.Table, dict]:
    """The rows (None: an unreadable line) as a table of `schema`, and {row index: what
    is wrong} for each row holding a value its column cannot hold exactly (a row of
    nulls in the table)."""
    arrays, misfits = _columns(rows, schema)
    if misfits:
        rows = [None if i in misfits else r for i, r in enumerate(rows)]
        arrays, _ = _columns(rows, schema)
    return pa.Table.from_arrays(arrays, schema=schema), misfits


def _columns(rows: list[dict | None], schema: pa.Schema) -> tuple[list, dict]:
    arrays, misfits = [], {}
    for field in schema:
        values = [None if r is None else r.get(field.name) for r in rows]
        array, bad = _column(values, field.type)
        for i in bad:
            misfits.setdefault(i, _misfit(values[i], field))
        arrays.append(array)
    return arrays, misfits


def _misfit(value, field: pa.Field) -> str:
    if isinstance(value, str) and _has_lone_surrogate(value):
        return (f"has {_short(value)} in column {field.name!r}: a lone surrogate (an "
                "escaped \\ud800-\\udfff without its pair), which is no Unicode text")
    return (f"has {_short(value)} in column {field.name!r}, which holds {field.type} (set "
            "by the column's first value in the file)")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _column(values: list, type_: pa.DataType) -> tuple[pa.Array | None, list[int]]:
    """The values as an array of `type_`, and the indices of those it cannot hold exactly
    (then the array is None or holds changed values: the caller reads again without
    them)."""
    try:
        array = pa.array(values, type_)
    except CONVERT_ERRORS:
        array = None
    if array is not None:
        if type_ in (pa.string(), pa.null()):  # these convert exactly or not at all
            return array, []
        got = array.to_pylist()
        # Python's == tells truncation apart (0.9 != 0, 2**60 + 1 != its float64) but
        # not a boolean made a number (True == 1.0): only then is a closer look needed.
        if values == got and not (_holds_float(type_) and _has_bool(values, type_)):
            return array, []
        return array, [i for i, (v, g) in enumerate(zip(values, got))
                       if v is not None and not _same(v, g)]
    bad = []
    for i, v in enumerate(values):
        try:
            if v is not None and not _same(v, pa.array([v], type_)[0].as_py()):
                bad.append(i)
        except CONVERT_ERRORS:
            bad.append(i)
    return None, bad


def _holds_float(type_: pa.DataType) -> bool:
    if pa.types.is_floating(type_):
        return True
    return any(_holds_float(type_.field(i).type) for i in range(type_.num_fields))


def _has_bool(values: list, type_: pa.DataType) -> bool:
    """Whether a boolean may hide in `values` (nested types: assume so)."""
    return type_.num_fields > 0 or any(v.__class__ is bool for v in values)


def _same(value, got) -> bool:
    """Whether Arrow gave back `value` itself: the same kind, the same number (an int as
    an equal float), the same strings, lists and keys (keys the row lacks read as null)."""
    if isinstance(value, bool) or isinstance(got, bool):
        return type(value) is type(got) and value == got
    if isinstance(value, (int, float)):
        if isinstance(value, float) and math.isnan(value):
            return isinstance(got, float) and math.isnan(got)
        return isinstance(got, (int, float)) and value == got
    if isinstance(value, list):
        return isinstance(got, list) and len(value) == len(got) and \
            all(_same(v, g) for v, g in zip(value, got))
    if isinstance(value, dict):
        return isinstance(got, dict) and all(k in got and _same(v, got[k])
                                             for k, v in value.items()) and \
            all(got[k] is None for k in got.keys() - value.keys())
    return type(value) is type(got) and value == got


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
