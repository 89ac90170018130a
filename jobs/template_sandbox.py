"""The prompt templates' Jinja sandbox, bounded: no value a template builds may hold more
than `max_size` characters or items.

Jinja's own sandbox blocks unsafe attributes but lets `{{ prompt * 100000000 }}`,
`{{ prompt | center(10**9) }}` or a loop that doubles a string build values until the
worker runs out of memory. Here every operation that can build a value much larger than
its inputs is sized before it runs (an upper bound from its arguments): the operators
`* + ** % ~`, growing filters and string methods, and the conversion of nested lists to
text; every filter's and call's result is sized after; the rendered text is counted as it
streams. A template that passes the limit raises `TemplateSizeError`, failing its row only.
(Time is not bounded: the sandbox's `range` stops at 100,000 items, but loops can nest.)
"""
from __future__ import annotations

import functools
import re
import string

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

DEFAULT_MAX_SIZE = 1 << 24  # characters or items, when the engine's prompt limit is not known
# A printf conversion's width and precision: "%-10.3f", "%*s", "%(name)20s".
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_CONTAINERS = (list, tuple, set, frozenset, dict)
# Filters that never turn a list into text: a large list column may go through them.
_STRUCTURAL_FILTERS = frozenset((
    "attr", "batch", "count", "d", "default", "dictsort", "first", "groupby", "items", "last",
    "length", "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse",
    "select", "selectattr", "slice", "sort", "sum", "unique"))


class TemplateSizeError(Exception):
    """A template would build a value over its size limit."""


def _size(value, memo: dict | None = None) -> int:
    """Characters or items: a string's characters, a number's decimal digits, a
    container's items plus theirs at every depth (the text `str()` would make of it is
    about as long); shared parts count each time they appear, as `str()` repeats them."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, bool) or not isinstance(value, (int, *_CONTAINERS)):
        return 0
    if isinstance(value, int):
        return value.bit_length() * 3 // 10  # digits, rounded down: log10(2) > 0.3
    memo = {} if memo is None else memo
    if id(value) not in memo:
        memo[id(value)] = 0  # a container met again inside itself counts once
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        memo[id(value)] = len(items) + sum(_size(v, memo) for v in items)
    return memo[id(value)]


def _ints(values) -> int:
    return sum(abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool))


def _printf_size(fmt: str, args) -> int:
    """`fmt % args`: its text, its arguments' and the widths and precisions it asks for."""
    values = tuple(args.values()) if isinstance(args, dict) else \
        args if isinstance(args, tuple) else (args,)
    widths = [w for spec in _PRINTF_SPEC.findall(fmt) for w in spec if w]
    size = len(fmt) + sum(map(_size, values)) + sum(int(w) for w in widths if w != "*")
    return size + (_ints(values) if "*" in widths else 0)


def _format_size(fmt: str, args, kwargs) -> int:
    """`fmt.format(*args, **kwargs)`, sized the same way (a nested `{}` width comes from
    the arguments)."""
    values = (*args, *kwargs.values())
    specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(fmt)]
    size = len(fmt) + sum(map(_size, values))
    size += sum(int(d) for spec in specs for d in re.findall(r"\d+", spec))
    return size + (_ints(values) if any("{" in s for s in specs) else 0)


def _replaced_size(s, old, new, count=None, *_) -> int:
    n = s.count(old) if old else len(s) + 1
    return len(s) + (n if count is None or count < 0 else min(n, count)) * _size(new)


def _joined_size(items, sep) -> int:
    if not isinstance(items, (list, tuple, str)):
        return 0  # an iterator: sizing it would consume it; its result is sized after
    return sum(_size(i) or 20 for i in items) + len(items) * _size(sep)


def _widened(s, width=80, *_) -> int:
    return max(_size(s), width if isinstance(width, int) else 0)


def _repeated(seq, n) -> int:
    return _size(seq) * n if isinstance(n, int) and not isinstance(seq, int) else 0


# Upper bounds of a result's size from the call's arguments, for the calls whose result can
# be much larger than their inputs (0 when the arguments do not fit: the call then fails
# on its own, or its result is sized after it runs).
_METHODS = {
    "center": _widened, "ljust": _widened, "rjust": _widened, "zfill": _widened,
    "expandtabs": lambda s, tabsize=8: len(s) + str(s).count("\t") * tabsize,
    "replace": _replaced_size,
    "join": lambda sep, items: _joined_size(items, sep),
    "format": lambda fmt, *args, **kwargs: _format_size(fmt, args, kwargs),
    "format_map": lambda fmt, mapping: _format_size(fmt, (), mapping),
    "translate": lambda s, table: len(s) * (1 + max(map(_size, table.values()), default=0)),
    "to_bytes": lambda n, length=1, *_, **__: length,
}
_FILTERS = {
    "center": _widened,
    "indent": lambda s, width=4, *_: len(s) + (s.count("\n") + 1) * (
        width if isinstance(width, int) else len(width)),
    "wordwrap": lambda s, width=79, long=True, wrapstring=None, *_: len(s) * (
        1 + len(wrapstring or "\n")),
    "replace": _replaced_size,
    "join": lambda items, d="", *_: _joined_size(items, d),
    "format": lambda fmt, *args, **kwargs: _printf_size(fmt, args or kwargs),
    "batch": lambda items, linecount, fill_with=None: _size(items) + linecount,
    "slice": lambda items, slices, fill_with=None: _size(items) + slices,
}
_BINOPS = {
    "*": lambda a, b: _repeated(a, b) or _repeated(b, a) or _size(a) + _size(b),
    "+": lambda a, b: _size(a) + _size(b),
    "**": lambda a, b: abs(a).bit_length() * b * 3 // 10 if abs(a) > 1 else 0,
    "%": lambda a, b: _printf_size(a, b) if isinstance(a, str) else 0,
}


def _bound(estimate, *args, **kwargs) -> int:
    try:
        return int(estimate(*args, **kwargs))
    except (TypeError, ValueError, AttributeError, OverflowError, RecursionError):
        return 0


class _CodeGenerator(CodeGenerator):
    def visit_Concat(self, node, frame) -> None:
        """`a ~ b` through `environment.join_values`, which sizes it first."""
        self.write("environment.join_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def buffer(self, frame) -> None:
        """The text of a macro, a call block or `{% set x %}...{% endset %}` collects in a
        `_TextBuffer`, which counts what is appended (a loop in a macro adds up)."""
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.text_buffer()")


class _TextBuffer(list):
    def __init__(self, env: BoundedSandbox):
        super().__init__()
        self._env, self._size = env, 0

    def append(self, part) -> None:
        self._add(len(str(part)))
        super().append(part)

    def extend(self, parts) -> None:
        parts = tuple(parts)
        self._add(sum(len(str(p)) for p in parts))
        super().extend(parts)

    def _add(self, size: int) -> None:
        self._size += size
        self._env.check("a macro or block's text", self._size)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset(_BINOPS)

    def __init__(self, max_size: int | None = None, **options):
        super().__init__(finalize=self._finalize, **options)
        self.max_size = max_size or DEFAULT_MAX_SIZE
        del self.globals["lipsum"]  # lipsum(n=10**9) writes n paragraphs
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(name, fn)

    def check(self, what: str, size: int, verb: str = "would build") -> None:
        if size > self.max_size:
            raise TemplateSizeError(f"{what} {verb} a value of {size:,} characters or items; "
                                    f"a prompt template may build at most {self.max_size:,}")

    def call_binop(self, context, operator: str, left, right):
        self.check(repr(operator), _bound(_BINOPS[operator], left, right))
        return super().call_binop(context, operator, left, right)

    def join_values(self, parts: tuple) -> str:
        self.check("'~'", sum(_bound(_size, p) for p in parts))
        return str_join(parts)

    def text_buffer(self) -> _TextBuffer:
        return _TextBuffer(self)

    def _finalize(self, value):
        """Each `{{ value }}` before it becomes text (a nested list's text can be huge)."""
        self.check("'{{ }}'", _bound(_size, value), "would write")
        return value

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, (str, bytes, int)) and name in _METHODS:
            __self.check(f"method {name!r}", _bound(_METHODS[name], owner, *args, **kwargs))
        result = super().call(__context, __obj, *args, **kwargs)
        __self.check(f"calling {name or type(__obj).__name__!r}", _bound(_size, result), "built")
        return result

    def _bounded_filter(self, name: str, fn):
        skip = 1 if _PassArg.from_obj(fn) is not None else 0  # context / eval_ctx first
        estimate = _FILTERS.get(name)
        stringifies = name not in _STRUCTURAL_FILTERS

        @functools.wraps(fn)
        def bounded(*args, **kwargs):
            value = args[skip] if len(args) > skip else None
            if stringifies and isinstance(value, _CONTAINERS):
                self.check(f"filter {name!r}", _bound(_size, value))
            if estimate is not None:
                self.check(f"filter {name!r}", _bound(estimate, *args[skip:], **kwargs))
            result = fn(*args, **kwargs)
            self.check(f"filter {name!r}", _bound(_size, result), "built")
            return result

        return bounded

    def render(self, template: jinja2.Template, variables: dict) -> str:
        """The template's text, counted as it streams out (so loops add up)."""
        parts, size = [], 0
        for part in template.generate(variables):
            size += len(part)
            if size > self.max_size:
                raise TemplateSizeError(f"the rendered prompt would pass {self.max_size:,} "
                                        "characters, the most a prompt template may build")
            parts.append(part)
        return "".join(parts)
