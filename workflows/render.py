"""Workflow variables in the file's strings: parameters and the run's own variables.

Each run sets three (RUN_VARIABLES): `run_date` (YYYY-MM-DD, the fire's date on the
schedule's clock, or --run-date), `run_time` (the fire time, ISO 8601 in UTC:
2026-11-26T14:30:00Z; a manual run's start, or --run-time) and `run_id` (the run store's
id of the run's first attempt: a resumed run keeps it, so it continues in the same
outputs). A schedule more often than daily puts {{ run_time }} in its outputs to keep each
fire's apart, or {{ run_date }} to let the later fires of a day find them up to date.

Any string value may use `{{ name }}` (full Jinja, sandboxed, strict about unknown names).
A value that is exactly one `{{ name }}` keeps the variable's type, so
`max_tokens: "{{ max_tokens }}"` stays an integer.

`prompt_template` is itself Jinja over each row's columns, rendered later per row. In it,
only `{{ name }}` of a workflow variable is replaced now; every other expression is left
for the rows (so a column cannot be named like a parameter there).
"""
from __future__ import annotations

import re

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

RUN_DATE = "run_date"
RUN_TIME = "run_time"
RUN_ID = "run_id"
RUN_VARIABLES = (RUN_DATE, RUN_TIME, RUN_ID)
ROW_TEMPLATE_KEYS = frozenset({"prompt_template"})  # rendered per row by the job
_ENV = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined)
_ONE_NAME = re.compile(r"^\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}$")
_NAME = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class TemplateError(ValueError):
    pass


def names_in(text: str, key: str) -> set[str]:
    """The workflow variables a string uses; raises TemplateError on bad Jinja."""
    if "{" not in text:
        return set()
    if key in ROW_TEMPLATE_KEYS:
        return set(_NAME.findall(text))
    try:
        return set(meta.find_undeclared_variables(_ENV.parse(text))) - set(_ENV.globals)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"template line {exc.lineno}: {exc.message}") from None


def render(value, variables: dict, key: str):
    """The value with variables filled in; dicts and lists recursively (keys dotted)."""
    if isinstance(value, dict):
        return {k: render(v, variables, f"{key}.{k}" if key else str(k))
                for k, v in value.items()}
    if isinstance(value, list):
        return [render(v, variables, key) for v in value]
    if not isinstance(value, str) or "{" not in value:
        return value
    if key.rsplit(".", 1)[-1] in ROW_TEMPLATE_KEYS:
        return _NAME.sub(lambda m: _literal(variables[m[1]]) if m[1] in variables else m[0],
                         value)
    one = _ONE_NAME.match(value.strip())
    if one and one[1] in variables:
        return variables[one[1]]
    try:
        return _ENV.from_string(value).render(variables)
    except jinja2.TemplateError as exc:
        raise TemplateError(str(exc)) from None


def _literal(value) -> str:
    """A variable's text inside a row template, protected from being read as Jinja."""
    text = str(value)
    if any(s in text for s in ("{{", "{%", "{#")):
        return "{% raw %}" + text + "{% endraw %}"
    return text


def template_keys(data, prefix: str):
    """(dotted key, string) of every string under data."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from template_keys(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(data, list):
        for v in data:
            yield from template_keys(v, prefix)
    elif isinstance(data, str):
        yield prefix, data
