"""The templates' Jinja sandbox, bounded in size and in work. Prompt templates (a job's
--prompt-template, jobs/template.py) and chat templates (a checkpoint's, a GGUF file's, or
one passed in; engine/tokenizer.py) render through it: both are untrusted text.

Size: no value a template builds may hold more than `max_size` characters or items.

Jinja's own sandbox blocks unsafe attributes but lets `{{ prompt * 100000000 }}`,
`{{ prompt | center(10**9) }}` or a loop that doubles a string build values until the
worker runs out of memory. Here every operation that can build a value much larger than
its inputs is sized before it runs (an upper bound from its arguments): the operators
`* + ** % ~`, growing filters and string methods, and the conversion of nested lists to
text; every filter's and call's result is sized after; the rendered text is counted as it
streams. A template that passes the limit raises `TemplateSizeError`, failing its row only.

Work: every loop turn, block body, filter and call takes steps (by about what each
costs), and a render may take `MAX_STEPS` of them. Jinja compiles a loop to a Python `for`
whose body may call nothing, so the code generator puts a step at the top of every loop
body (and blocks take one as their text buffer is made). Steps are counted, not timed:
whether a template passes does not depend on the machine's load. No single step is slow:
values are bounded in size, numbers in digits (`MAX_INT_DIGITS`), and a render builds at
most `BUILD_FACTOR` x `max_size` characters or items in all (a loop building a large value
each turn adds up). `TIME_LIMIT` seconds of wall clock, checked at every step, are a
backstop. A render that passes a bound raises `TemplateTimeError` naming the template.
"""
from __future__ import annotations

import functools
import re
import string
import threading
import time
from dataclasses import dataclass

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

DEFAULT_MAX_SIZE = 1 << 24  # characters or items, when the engine's prompt limit is not known
# Steps one render may take, each kind weighed by about what it costs (a loop turn takes
# ~0.3 us, a filter ~2.5, a call of a function, method or macro ~7-10): about a second on
# a quiet machine. A chat template takes a few hundred per message.
MAX_STEPS = 4_000_000
TURN_STEPS, FILTER_STEPS, CALL_STEPS = 1, 10, 30
TIME_LIMIT = 10.0  # seconds of wall clock one render may run: a backstop to MAX_STEPS
BUILD_FACTOR = 64  # a render may build at most this many times max_size in all
MAX_INT_DIGITS = 4300  # Python's own limit for writing a number out as text
MAX_SOURCE = 1 << 20  # characters of template text: chat templates run to tens of thousands
# A printf conversion's width and precision: "%-10.3f", "%*s", "%(name)20s".
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_CONTAINERS = (list, tuple, set, frozenset, dict)
# Filters that never turn a list into text: a large list column may go through them.
_STRUCTURAL_FILTERS = frozenset((
    "attr", "batch", "count", "d", "default", "dictsort", "first", "groupby", "items", "last",
    "length", "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse",
    "select", "selectattr", "slice", "sort", "sum", "unique"))


class TemplateLimitError(Exception):
    """A template passed one of its bounds; the message names the bound."""


class TemplateSizeError(TemplateLimitError):
    """A template would build a value over its size limit. `output_limit`: where it is
    the rendered text that would pass it, the limit (characters), else None."""

    def __init__(self, message: str, output_limit: int | None = None):
        super().__init__(message)
        self.output_limit = output_limit


class TemplateTimeError(TemplateLimitError):
    """A render took more steps than `MAX_STEPS`, or ran past `TIME_LIMIT` seconds, or
    nested its macro calls past Python's recursion limit."""


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


def _depth(value, memo: dict | None = None) -> int:
    """How deeply containers nest in `value` (0: not a container)."""
    if not isinstance(value, _CONTAINERS):
        return 0
    memo = {} if memo is None else memo
    if id(value) not in memo:
        memo[id(value)] = 1
        items = value.values() if isinstance(value, dict) else value
        memo[id(value)] = 1 + max((_depth(v, memo) for v in items), default=0)
    return memo[id(value)]


def json_size(value, indent=None, separators=None) -> int:
    """`json.dumps(value, indent=..., separators=...)`: each item on a line indented by its
    depth, and its separators (without either the text is a few times `value`'s: sized
    after)."""
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) \
        else 0
    seps = sum(map(_size, separators)) if isinstance(separators, (list, tuple)) else 0
    if not width and not seps:
        return 0
    items = _size(value)
    return items + items * (max(width, 0) * _depth(value) + seps)


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
    "tojson": lambda value, indent=None: json_size(value, indent),  # Jinja's own
}
# Steps for the filters whose work grows faster than their input, or is slow per
# character, charged before they run (one call is otherwise one step: no hook inside it).
def _sum_steps(items, attribute=None, start=0) -> int:
    """Adding up lists copies the sum so far each time: quadratic."""
    if not isinstance(items, (list, tuple)) or not isinstance(start, (list, tuple)):
        return 0
    return len(items) * _size(items) // 1024


_FILTER_STEPS = {
    # markupsafe removes one tag at a time, copying the text each time
    "striptags": lambda s: str(s).count("<") * len(s) // 8192 + len(s) // 16,
    "sum": _sum_steps,
    "urlize": lambda s, *_, **__: len(s) * 4,  # about 1.3 us a character
    "wordwrap": lambda s, *_, **__: len(s) * 4,
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
    def enter_frame(self, frame) -> None:
        """Every turn of a loop takes a step at the top of its body, whatever the body
        does (Jinja makes one loop frame per `for`, entered inside the Python loop;
        `loop(...)` of a recursive loop runs the same body)."""
        super().enter_frame(frame)
        if frame.loop_frame:
            self.writeline("environment.step()")

    def visit_Concat(self, node, frame) -> None:
        """`a ~ b` through `environment.join_values`, which sizes it first."""
        self.write("environment.join_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def buffer(self, frame) -> None:
        """The text of a macro, a call block or `{% set x %}...{% endset %}` collects in a
        `_TextBuffer`, which counts what is appended (a loop in a macro adds up); making
        one is a step."""
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


@dataclass(slots=True)
class _Budget:
    """One render's work so far (each thread renders its own: a chat template's compiled
    form is shared by the threads that submit conversations)."""
    origin: str  # "the chat template in model.gguf's metadata": what errors name
    max_steps: int
    max_built: int
    deadline: float  # time.monotonic()
    steps: int = 0
    built: int = 0


class _Budgets(threading.local):
    current: _Budget | None = None


class _BoundedTemplate(jinja2.Template):
    def render(self, *args, **kwargs) -> str:
        """Bounded like `BoundedSandbox.render` (which callers use to name the template)."""
        return self.environment.render(self, dict(*args, **kwargs))


class BoundedSandbox(ImmutableSandboxedEnvironment):
    code_generator_class = _CodeGenerator
    template_class = _BoundedTemplate
    intercepted_binops = frozenset(_BINOPS)

    def __init__(self, max_size: int | None = None, kind: str = "prompt", **options):
        """`kind`: "prompt" or "chat", as the errors call the template."""
        super().__init__(finalize=self._finalize, **options)
        self.max_size = max_size or DEFAULT_MAX_SIZE
        self.kind = kind
        self._budgets = _Budgets()
        del self.globals["lipsum"]  # lipsum(n=10**9) writes n paragraphs
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(name, fn)

    def add_filter(self, name: str, fn, estimate=None) -> None:
        """`fn` as filter `name`, bounded like the built-in ones; `estimate`: an upper
        bound of its result's size from its arguments, where it can be much larger."""
        self.filters[name] = self._bounded_filter(name, fn, estimate)

    def _parse(self, source: str, name, filename):
        """Parsing and compiling take time and memory in proportion to the text."""
        if len(source) > MAX_SOURCE:
            raise TemplateSizeError(f"the {self.kind} template has {len(source):,} "
                                    f"characters; a template may have at most {MAX_SOURCE:,}")
        return super()._parse(source, name, filename)

    def unsafe_undefined(self, obj, attribute: str):
        """An unsafe attribute fails the render where it is named (Jinja's sandbox gives
        an undefined value that fails only when used, and renders as "" when printed)."""
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} "
                            "object is unsafe.")

    def step(self, steps: int = TURN_STEPS) -> None:
        budget = self._budgets.current
        if budget is None:
            raise RuntimeError("a bounded template renders through BoundedSandbox.render")
        budget.steps += steps
        if budget.steps > budget.max_steps:
            raise TemplateTimeError(
                f"{budget.origin} took more than {budget.max_steps:,} steps in one render "
                f"(a loop turn counts {TURN_STEPS}, a filter {FILTER_STEPS} or more, a call "
                f"{CALL_STEPS}), the most a template may take: its loops or recursion never "
                "end, or grow too fast with the input")
        if time.monotonic() >= budget.deadline:
            raise TemplateTimeError(
                f"{budget.origin} ran past {TIME_LIMIT:g} s in one render ({budget.steps:,} "
                "steps), the longest a template may run: its loops never end, or grow too "
                "fast with the input")

    def check(self, what: str, size: int, verb: str = "would build") -> None:
        if size > self.max_size:
            raise TemplateSizeError(f"{what} {verb} a value of {size:,} characters or items; "
                                    f"a {self.kind} template may build at most "
                                    f"{self.max_size:,}")

    def built(self, size: int) -> None:
        """A value of `size` was built (its size checked): within the render's total."""
        budget = self._budgets.current
        if budget is not None:
            budget.built += size
            if budget.built > budget.max_built:
                raise TemplateSizeError(
                    f"{budget.origin} built {budget.built:,} characters or items in all in "
                    f"one render; a {self.kind} template may build at most "
                    f"{budget.max_built:,} ({BUILD_FACTOR} x {self.max_size:,})")

    def call_binop(self, context, operator: str, left, right):
        if operator == "+" and type(left) is str and type(right) is str:
            size = len(left) + len(right)  # most of a chat template's operators
        else:
            size = _bound(_BINOPS[operator], left, right)
        if size > self.max_size:
            self.check(repr(operator), size)
        if size > MAX_INT_DIGITS and operator in ("*", "**") and isinstance(left, int) \
                and isinstance(right, int):  # a product of huge numbers takes seconds
            raise TemplateSizeError(f"{operator!r} would build a number of {size:,} digits; "
                                    f"a template's numbers may have at most {MAX_INT_DIGITS:,}")
        self.built(size)
        return self.binop_table[operator](left, right)

    def join_values(self, parts: tuple) -> str:
        size = sum(len(p) if type(p) is str else _bound(_size, p) for p in parts)
        self.check("'~'", size)
        self.built(size)
        return str_join(parts)

    def text_buffer(self) -> _TextBuffer:
        self.step()
        return _TextBuffer(self)

    def _finalize(self, value):
        """Each `{{ value }}` before it becomes text (a nested list's text can be huge)."""
        if type(value) is not str:
            self.check("'{{ }}'", _bound(_size, value), "would write")
        elif len(value) > self.max_size:
            self.check("'{{ }}'", len(value), "would write")
        return value

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        __self.step(CALL_STEPS)
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, (str, bytes, int)) and name in _METHODS:
            __self.check(f"method {name!r}", _bound(_METHODS[name], owner, *args, **kwargs))
        result = super().call(__context, __obj, *args, **kwargs)
        size = len(result) if type(result) is str else _bound(_size, result)
        if size > __self.max_size:
            __self.check(f"calling {name or type(__obj).__name__!r}", size, "built")
        __self.built(size)
        return result

    def _bounded_filter(self, name: str, fn, estimate=None):
        skip = 1 if _PassArg.from_obj(fn) is not None else 0  # context / eval_ctx first
        estimate = estimate or _FILTERS.get(name)
        cost = _FILTER_STEPS.get(name)
        stringifies = name not in _STRUCTURAL_FILTERS

        what = f"filter {name!r}"

        @functools.wraps(fn)
        def bounded(*args, **kwargs):
            self.step(FILTER_STEPS + (_bound(cost, *args[skip:], **kwargs) if cost else 0))
            value = args[skip] if len(args) > skip else None
            if stringifies and isinstance(value, _CONTAINERS):
                self.check(what, _bound(_size, value))
            if estimate is not None:
                self.check(what, _bound(estimate, *args[skip:], **kwargs))
            result = fn(*args, **kwargs)
            size = len(result) if type(result) is str else _bound(_size, result)
            self.check(what, size, "built")
            self.built(size)
            return result

        return bounded

    def render(self, template: jinja2.Template, variables: dict,
               origin: str | None = None) -> str:
        """The template's text, counted as it streams out (so loops add up), within its
        step, build and time budget. `origin`: how errors name the template ("the chat
        template in model.gguf's metadata"); "the prompt template" by default."""
        budget = _Budget(origin or f"the {self.kind} template", MAX_STEPS,
                         BUILD_FACTOR * self.max_size, time.monotonic() + TIME_LIMIT)
        outer, self._budgets.current = self._budgets.current, budget
        try:
            parts, size = [], 0
            for part in template.generate(variables):
                size += len(part)
                if size > self.max_size:
                    text = "prompt" if self.kind == "prompt" else "text"
                    raise TemplateSizeError(
                        f"the rendered {text} would pass {self.max_size:,} characters, the "
                        f"most a {self.kind} template may build", self.max_size)
                parts.append(part)
            return "".join(parts)
        except RecursionError:
            raise TemplateTimeError(
                f"{budget.origin} nested its macro calls or recursive loops past Python's "
                "recursion limit in one render") from None
        finally:
            self._budgets.current = outer
