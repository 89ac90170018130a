"""Row filters: a small, safe expression language over columns, evaluated with pyarrow.

The text is parsed with Python's `ast` and every node is checked against a short list
(comparisons, `and`/`or`/`not`, arithmetic, column names, literals, `is null`, a few
functions); anything else is refused at parse time. Nothing is ever passed to `eval`.
The accepted tree compiles to pyarrow compute calls, so a filter runs one record batch
at a time, vectorised, and type errors surface on an empty table of the input schema,
before any row is read.

    error is null and num_generated_tokens >= 8 and len(generated_text) < 400
    lower(label) in ['yes', 'maybe'] and not contains(generated_text, 'sorry')
    json(generated_text).label == 'pos' and json(generated_text)["score"] > 0.5

Nulls follow SQL: a comparison with null is null, and a row whose filter value is null
is dropped.

`json(text)` reads a column of JSON documents (structured outputs): `.field`,
`["field"]` and `[0]` walk into it. A row whose text is not valid JSON, or lacks the
field, gives null there, so such a row is dropped by a filter (never an error);
`json(text).label is null` selects them. Each document is parsed once per partition;
a field whose rows hold values of several JSON kinds keeps its most common kind (numbers
count as one) and is null in the other rows; an object or list value is its JSON text.
"""
from __future__ import annotations

import ast
import json
from collections import Counter
from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc

Compiled = Callable[[pa.Table], object]

_LITERAL_NAMES = {"null": None, "true": True, "false": False}
_COMPARE = {ast.Eq: pc.equal, ast.NotEq: pc.not_equal, ast.Lt: pc.less,
            ast.LtE: pc.less_equal, ast.Gt: pc.greater, ast.GtE: pc.greater_equal}
_ARITH = {ast.Add: "add", ast.Sub: pc.subtract, ast.Mult: pc.multiply, ast.Div: "div",
          ast.FloorDiv: "floordiv", ast.Mod: "mod"}
_FUNCTIONS = "len, lower, upper, strip, contains, startswith, endswith, matches, abs, " \
             "round, coalesce, col, json"
_INVALID = object()  # a row's text that is not JSON, or a path that is not in its document
# Bounds on what a filter may be: compiling and evaluating recurse once per level, and
# Python's own parser gives up (RecursionError, MemoryError) on deep or huge input.
MAX_LENGTH = 10_000  # characters
MAX_DEPTH = 100  # nested operations, calls and parentheses


class ExpressionError(ValueError):
    """The text is not a valid filter; the message points at the offending part."""


class Expression:
    """A compiled filter. `columns` are the names it reads; `mask(table)` the rows kept."""

    def __init__(self, source: str):
        if not isinstance(source, str) or not source.strip():
            raise ExpressionError("a filter must be a non-empty expression, e.g. "
                                  "\"error is null and score > 3\"")
        self.source = source
        if len(source) > MAX_LENGTH:
            raise ExpressionError(f"is {len(source)} characters, longer than {MAX_LENGTH} "
                                  "characters; split the condition over several steps")
        try:
            tree = ast.parse(source.strip(), mode="eval")
        except SyntaxError as exc:
            if "too many nested" in str(exc.msg):
                raise _too_deep() from None
            raise ExpressionError(f"syntax error at column {exc.offset}: {exc.msg}") from None
        except (RecursionError, MemoryError):
            raise _too_deep() from None
        _check_depth(tree.body)
        self.columns: set[str] = set()
        self._parsed: dict[str, list] = {}  # json(arg) source -> its rows' documents
        self._fn = self._compile(tree.body)

    def __reduce__(self):
        # Compiled to closures, which only cloudpickle takes, by value: a Dask task (a
        # python step checking the columns its reader's filter needs) gets the source and
        # compiles it again
        return Expression, (self.source,)

    def evaluate(self, table: pa.Table):
        """The expression's value for every row (a boolean array for a valid filter)."""
        self._parsed = {}  # per table: json() parses each document once
        try:
            value = self._fn(table)
        finally:
            self._parsed = {}
        if isinstance(value, pa.Scalar):
            value = pa.array([value.as_py()] * table.num_rows, type=value.type)
        return value

    def mask(self, table: pa.Table):
        """The boolean filter mask; raises ExpressionError when the value is not boolean."""
        try:
            value = self.evaluate(table)
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ExpressionError(_arrow_message(exc)) from None
        value = _typed(value, pa.bool_())
        if not pa.types.is_boolean(value.type):
            raise ExpressionError(f"must be true or false for each row, but gives {value.type}; "
                                  "compare it with something (e.g. `x > 0`)")
        return value

    # -- compilation: one small function per node kind -----------------------------------

    def _compile(self, node: ast.AST) -> Compiled:
        handler = getattr(self, f"_{type(node).__name__}", None)
        if handler is None:
            raise ExpressionError(f"{_describe(node)} is not allowed in a filter; use "
                                  f"comparisons, and/or/not, arithmetic, column names, "
                                  f"literals, `is null` and the functions {_FUNCTIONS}")
        return handler(node)

    def _Constant(self, node: ast.Constant) -> Compiled:
        if node.value is not None and not isinstance(node.value, (bool, int, float, str)):
            raise ExpressionError(f"literal {node.value!r} is not allowed")
        scalar = pa.scalar(node.value)
        return lambda table: scalar

    def _Name(self, node: ast.Name) -> Compiled:
        if node.id in _LITERAL_NAMES:
            scalar = pa.scalar(_LITERAL_NAMES[node.id])
            return lambda table: scalar
        return self._column(node.id)

    def _column(self, name: str) -> Compiled:
        self.columns.add(name)
        return lambda table: table.column(name)

    def _BoolOp(self, node: ast.BoolOp) -> Compiled:
        fn = pc.and_kleene if isinstance(node.op, ast.And) else pc.or_kleene
        parts = [self._compile(v) for v in node.values]

        def run(table):
            value = _typed(parts[0](table), pa.bool_())
            for part in parts[1:]:
                value = fn(value, _typed(part(table), pa.bool_()))
            return value
        return run

    def _UnaryOp(self, node: ast.UnaryOp) -> Compiled:
        operand = self._compile(node.operand)
        if isinstance(node.op, ast.Not):
            return lambda table: pc.invert(_typed(operand(table), pa.bool_()))
        if isinstance(node.op, ast.USub):
            return lambda table: pc.negate(operand(table))
        if isinstance(node.op, ast.UAdd):
            return operand
        raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")

    def _BinOp(self, node: ast.BinOp) -> Compiled:
        op = _ARITH.get(type(node.op))
        if op is None:
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed; "
                                  "use + - * / // %")
        left, right = self._compile(node.left), self._compile(node.right)
        if op == "add":
            return lambda table: _add(left(table), right(table))
        if op == "div":  # true division, as in Python (arrow divides integers exactly)
            return lambda table: pc.divide(_float(left(table)), _float(right(table)))
        if op == "floordiv":
            return lambda table: pc.floor(pc.divide(_float(left(table)), _float(right(table))))
        if op == "mod":
            return lambda table: _modulo(left(table), right(table))
        return lambda table: op(left(table), right(table))

    def _Compare(self, node: ast.Compare) -> Compiled:
        # a < b < c means a < b and b < c, as in Python
        operands = [node.left, *node.comparators]
        checks = [self._compare(a, op, b) for a, op, b in zip(operands, node.ops, operands[1:])]

        def run(table):
            value = checks[0](table)
            for check in checks[1:]:
                value = pc.and_kleene(value, check(table))
            return value
        return run

    def _compare(self, left_node, op, right_node) -> Compiled:
        if isinstance(op, (ast.Is, ast.IsNot)):
            if not _is_null_literal(right_node):
                raise ExpressionError("`is` only compares with null: write `x is null` or "
                                      "`x is not null`")
            left = self._compile(left_node)
            fn = pc.is_null if isinstance(op, ast.Is) else pc.is_valid
            return lambda table: _as_array(fn(left(table)), table)
        if isinstance(op, (ast.In, ast.NotIn)):
            value_set = _value_set(_literal_list(right_node))
            left = self._compile(left_node)
            negate = isinstance(op, ast.NotIn)

            def is_in(table):
                value = pc.is_in(_typed(left(table), value_set.type), value_set=value_set,
                                 skip_nulls=True)
                return pc.invert(value) if negate else value
            return is_in
        if _is_null_literal(left_node) or _is_null_literal(right_node):
            raise ExpressionError("comparing with null is always null; write `x is null` or "
                                  "`x is not null`")
        left, right = self._compile(left_node), self._compile(right_node)
        fn = _COMPARE[type(op)]
        return lambda table: fn(left(table), right(table))

    def _Call(self, node: ast.Call) -> Compiled:
        if not isinstance(node.func, ast.Name):
            raise ExpressionError(f"only these functions can be called: {_FUNCTIONS}")
        name = node.func.id
        if node.keywords:
            raise ExpressionError(f"{name}() takes positional arguments only")
        build = _CALLS.get(name)
        if build is None:
            raise ExpressionError(f"unknown function {name}(); the functions are {_FUNCTIONS}")
        return build(self, node.args)

    def _Attribute(self, node: ast.Attribute) -> Compiled:
        return self._json_path(node)

    def _Subscript(self, node: ast.Subscript) -> Compiled:
        return self._json_path(node)

    def _json_path(self, node) -> Compiled:
        """json(text).a["b"][0]: a chain of keys and indexes under one json() call."""
        outer, path = node, []
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            path.append(node)
            node = node.value
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "json"):
            raise ExpressionError(f"{_describe(outer)} is only allowed on json(...): "
                                  "json(generated_text).label == 'pos'")
        keys = [_json_key(step) for step in reversed(path)]
        if node.keywords:
            raise ExpressionError("json() takes positional arguments only")
        documents = self._json_documents(node.args)
        return lambda table: _json_values(documents(table), keys)

    def _json_documents(self, args: list):
        """The rows' parsed documents (_INVALID where a text is not JSON), parsed once per
        table however often the expression reads into them."""
        _arity("json", args, 1, "json(text_column)")
        arg, key = self._compile(args[0]), ast.dump(args[0])

        def documents(table):
            if key not in self._parsed:
                self._parsed[key] = _parse_json(_typed(arg(table), pa.string()), table)
            return self._parsed[key]
        return documents

    def _List(self, node) -> Compiled:
        raise ExpressionError("a list is only allowed on the right of `in` / `not in`")

    _Tuple = _Set = _List


# -- functions ----------------------------------------------------------------------------

def _arity(name: str, args: list, n: int, hint: str):
    if len(args) != n:
        raise ExpressionError(f"{name}() takes {n} argument(s): {hint}")


def _unary(name: str, fn, hint: str, takes=None):
    """`takes`: the type a value of no known type (an all-null json() field) is read as."""
    def build(expr: Expression, args):
        _arity(name, args, 1, hint)
        arg = expr._compile(args[0])
        return lambda table: fn(_typed(arg(table), takes))
    return build


def _with_pattern(name: str, fn):
    def build(expr: Expression, args):
        _arity(name, args, 2, f"{name}(column, 'text')")
        if not (isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)):
            raise ExpressionError(f"{name}()'s second argument must be a quoted string")
        arg, pattern = expr._compile(args[0]), args[1].value
        return lambda table: fn(_typed(arg(table), pa.string()), pattern)
    return build


def _len(value):
    t = value.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pc.list_value_length(value)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pc.binary_length(value)
    return pc.utf8_length(value)


def _build_round(expr: Expression, args):
    if len(args) not in (1, 2) or (len(args) == 2 and not (
            isinstance(args[1], ast.Constant) and type(args[1].value) is int)):
        raise ExpressionError("round() takes a value and optionally a literal number of "
                              "digits: round(score, 1)")
    arg, digits = expr._compile(args[0]), args[1].value if len(args) == 2 else 0
    return lambda table: pc.round(arg(table), ndigits=digits)


def _build_coalesce(expr: Expression, args):
    if len(args) < 2:
        raise ExpressionError("coalesce() takes two or more values: coalesce(x, 'default')")
    parts = [expr._compile(a) for a in args]

    def run(table):
        values = [p(table) for p in parts]
        known = next((v.type for v in values if not pa.types.is_null(v.type)), None)
        return pc.coalesce(*[_typed(v, known) for v in values])
    return run


def _build_col(expr: Expression, args):
    if len(args) != 1 or not (isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)):
        raise ExpressionError("col() takes one quoted column name: col('my column')")
    return expr._column(args[0].value)


def _build_json(expr: Expression, args):
    """Bare json(text): the whole document (its JSON text for an object or list), null
    where the text is not JSON, so `json(text) is not null` keeps the valid rows."""
    documents = expr._json_documents(args)
    return lambda table: _json_values(documents(table), [])


_CALLS = {
    "len": _unary("len", _len, "len(text_or_list_column)", pa.string()),
    "lower": _unary("lower", pc.utf8_lower, "lower(text)", pa.string()),
    "upper": _unary("upper", pc.utf8_upper, "upper(text)", pa.string()),
    "strip": _unary("strip", pc.utf8_trim_whitespace, "strip(text)", pa.string()),
    "abs": _unary("abs", pc.abs, "abs(number)"),
    "contains": _with_pattern("contains", lambda v, p: pc.match_substring(v, p)),
    "startswith": _with_pattern("startswith", lambda v, p: pc.starts_with(v, p)),
    "endswith": _with_pattern("endswith", lambda v, p: pc.ends_with(v, p)),
    "matches": _with_pattern("matches", lambda v, p: pc.match_substring_regex(v, p)),
    "round": _build_round,
    "coalesce": _build_coalesce,
    "col": _build_col,
    "json": _build_json,
}


# -- json() -------------------------------------------------------------------------------

def _json_key(node) -> str | int:
    if isinstance(node, ast.Attribute):
        return node.attr
    index = node.slice
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub) and \
            isinstance(index.operand, ast.Constant) and type(index.operand.value) is int:
        return -index.operand.value  # [-1]: the last item
    if isinstance(index, ast.Constant) and type(index.value) in (str, int):
        return index.value
    raise ExpressionError("json(...)[...] takes a quoted field name or a literal index: "
                          "json(generated_text)[\"label\"] or json(generated_text).items[0]")


def _parse_json(value, table: pa.Table) -> list:
    """Each row's document; _INVALID for a null or non-JSON text."""
    if isinstance(value, pa.Scalar):
        value = pa.array([value.as_py()] * table.num_rows, type=value.type)
    if not (pa.types.is_string(value.type) or pa.types.is_large_string(value.type)):
        raise ExpressionError(f"json() reads text (a column of JSON documents), not "
                              f"{value.type}")
    out = []
    for text in value.to_pylist():
        try:
            out.append(_INVALID if text is None else json.loads(text))
        except ValueError:  # JSONDecodeError, and numbers too large for a float
            out.append(_INVALID)
    return out


def _json_values(documents: list, path: list) -> pa.Array:
    """The value at `path` in every document, as one Arrow array of one JSON kind."""
    values = [_walk(doc, path) for doc in documents]
    kinds = Counter(_kind(v) for v in values if v is not _INVALID and v is not None)
    if not kinds:
        return pa.nulls(len(values))
    kind = kinds.most_common(1)[0][0]  # ties: the kind seen first
    keep = [None if v is _INVALID or v is None or _kind(v) != kind else v for v in values]
    if kind == "json":
        return pa.array([None if v is None else json.dumps(v) for v in keep], pa.string())
    if kind == "number":
        ints = all(type(v) is int and -2**63 <= v < 2**63 for v in keep if v is not None)
        return pa.array([v if v is None or ints else float(v) for v in keep],
                        pa.int64() if ints else pa.float64())
    return pa.array(keep, pa.bool_() if kind == "bool" else pa.string())


def _walk(doc, path: list):
    for step in path:
        if isinstance(step, str) and isinstance(doc, dict) and step in doc:
            doc = doc[step]
        elif type(step) is int and isinstance(doc, list) and -len(doc) <= step < len(doc):
            doc = doc[step]
        else:
            return _INVALID
    return doc


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else "json"


def _typed(value, type_):
    """A value of no known type (all null: a json() field no row has) read as `type_`, so
    a function or operator that needs `type_` gives null rather than a type error."""
    if type_ is not None and pa.types.is_null(value.type):
        return value.cast(type_)
    return value


# -- helpers ------------------------------------------------------------------------------

def _add(a, b):
    if pa.types.is_string(a.type) and pa.types.is_string(b.type):
        return pc.binary_join_element_wise(a, b, "")
    return pc.add(a, b)


def _modulo(a, b):
    """Python's `%` (the sign of the divisor): pyarrow's `modulo` where this pyarrow has
    it, else the same from division, exactly in integers (pyarrow's integer division
    truncates and refuses zero, as `modulo` does)."""
    if hasattr(pc, "modulo"):
        return pc.modulo(a, b)
    if pa.types.is_integer(a.type) and pa.types.is_integer(b.type):
        rem = pc.subtract(a, pc.multiply(b, pc.divide(a, b)))  # the sign of the dividend
        wrong_sign = pc.and_(pc.not_equal(rem, 0), pc.not_equal(pc.less(rem, 0), pc.less(b, 0)))
        return pc.if_else(wrong_sign, pc.add(rem, b), rem)
    a, b = _float(a), _float(b)
    return pc.subtract(a, pc.multiply(b, pc.floor(pc.divide(a, b))))


def _float(value):
    if pa.types.is_integer(value.type):
        return pc.cast(value, pa.float64())
    return value


def _as_array(value, table: pa.Table):
    if isinstance(value, pa.Scalar):  # `null is null`: one value for every row
        return pa.array([value.as_py()] * table.num_rows, type=pa.bool_())
    return value


def _is_null_literal(node) -> bool:
    return (isinstance(node, ast.Constant) and node.value is None) or (
        isinstance(node, ast.Name) and node.id == "null")


def _literal_list(node) -> list:
    if not isinstance(node, (ast.List, ast.Tuple, ast.Set)) or not all(
            isinstance(e, ast.Constant) and isinstance(e.value, (bool, int, float, str))
            for e in node.elts):
        raise ExpressionError("`in` takes a list of literals: x in ['a', 'b'] or x in [1, 2]")
    return [e.value for e in node.elts]


def _value_set(values: list) -> pa.Array:
    kinds = list(dict.fromkeys(type(v).__name__ for v in values))
    # bool is an int to Python and arrow would make [1, True] one type: keep them apart
    if len(kinds) > 1 and kinds != ["int", "float"] and kinds != ["float", "int"]:
        raise ExpressionError(f"the list after `in` mixes types ({', '.join(kinds)}); use "
                              "values of one type: x in ['a', 'b'] or x in [1, 2]")
    return pa.array(values)


def _too_deep() -> ExpressionError:
    return ExpressionError(f"is nested more than {MAX_DEPTH} levels deep; write it flatter "
                           "(a and b and c rather than nested parentheses)")


def _check_depth(root: ast.AST) -> None:
    """Refuse a tree deeper than MAX_DEPTH, walking it without recursion."""
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _describe(node: ast.AST) -> str:
    kinds = {"Attribute": "attribute access (x.y)", "Subscript": "indexing (x[i])",
             "Lambda": "lambda", "IfExp": "`a if c else b`", "JoinedStr": "an f-string",
             "NamedExpr": "`:=`", "ListComp": "a comprehension",
             "GeneratorExp": "a generator", "Starred": "`*`"}
    return kinds.get(type(node).__name__, type(node).__name__)


def _arrow_message(exc: Exception) -> str:
    text = str(exc).split("\n")[0]
    if "no kernel matching input types" in text:
        fn = text.split("'")[1] if "'" in text else "an operation"
        types = text.rsplit("(", 1)[-1].rstrip(")")
        return f"{fn} cannot take values of types ({types}); compare like with like " \
               "(text with 'quoted text', numbers with numbers)"
    return text
