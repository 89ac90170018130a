"""Prompt templates: Jinja over a row's columns, sandboxed, strict about missing names."""
from __future__ import annotations

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fusegen.jobs.errors import JobError

_ENV = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined,
                                     keep_trailing_newline=True)


class PromptTemplate:
    def __init__(self, source: str):
        try:
            names = meta.find_undeclared_variables(_ENV.parse(source))
            self.columns = frozenset(names - set(_ENV.globals))  # columns it reads
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise JobError(f"prompt_template line {exc.lineno}: {exc.message}") from None

    def render(self, row: dict) -> str:
        """Raises on a row the template cannot render (the caller makes it an error row).

        Null values are left undefined rather than rendered as "None": using one fails
        the row, while `{% if x is defined %}` or `{{ x | default('') }}` handle it."""
        try:
            return self._template.render({k: v for k, v in row.items() if v is not None})
        except jinja2.UndefinedError as exc:
            raise jinja2.UndefinedError(f"{exc.message} (null in this row)") from None
