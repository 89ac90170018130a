"""Prompt templates: Jinja over a row's columns, sandboxed, bounded in size and in work
(engine/template_sandbox.py, which chat templates share), strict about missing names."""
from __future__ import annotations

import jinja2
from jinja2 import meta

from fusegen.engine.template_sandbox import (BoundedSandbox, TemplateSizeError,  # noqa: F401
                                              TemplateTimeError)
from fusegen.jobs.errors import JobError


class PromptTemplate:
    def __init__(self, source: str, max_size: int | None = None):
        """`max_size`: the most characters or items any value it builds may hold (the
        engine's prompt limit in bytes: no longer text could be a prompt)."""
        self._env = BoundedSandbox(max_size, undefined=jinja2.StrictUndefined,
                                   keep_trailing_newline=True)
        try:
            names = meta.find_undeclared_variables(self._env.parse(source))
            self.columns = frozenset(names - set(self._env.globals))  # columns it reads
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise JobError(f"prompt_template line {exc.lineno}: {exc.message}") from None
        except TemplateSizeError as exc:
            raise JobError(f"prompt_template: {exc}") from None

    def render(self, row: dict) -> str:
        """Raises on a row the template cannot render (the caller makes it an error row),
        TemplateSizeError and TemplateTimeError (too many steps) included.

        Null values are left undefined rather than rendered as "None": using one fails
        the row, while `{% if x is defined %}` or `{{ x | default('') }}` handle it."""
        try:
            return self._env.render(self._template,
                                    {k: v for k, v in row.items() if v is not None})
        except jinja2.UndefinedError as exc:
            raise jinja2.UndefinedError(f"{exc.message} (null in this row)") from None
