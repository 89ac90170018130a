"""Rows -> engine requests: the prompt, the row's sampling parameters, or a coded error.

Plain Python over plain values: no engine, no Dask. `chat` is the one engine-dependent
step (the tokenizer's chat template), passed in as a function.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.tokenizer import (PromptError, PromptLimit, messages_problem,
                                      prompt_problem)
from fusegen.jobs import errors
from fusegen.jobs.errors import JobError
from fusegen.jobs.params import (CONSTRAINT_COLUMNS, ParamError, TooDeep, column_warnings,
                                 lone_surrogate, nesting_problem, parameter_columns,
                                 read_json, row_changes)
from fusegen.jobs.spec import MESSAGES_COLUMN, OUTPUT_COLUMNS, ROW_ID_COLUMN, JobSpec
from fusegen.jobs.template import PromptTemplate

ChatFn = Callable[[list], "str | list[int]"]  # messages -> prompt for the engine
# Output columns a per-row parameter column of the same name may hold in the input: the
# output's list column replaces it.
_REPLACED = frozenset({"logprobs", "prompt_logprobs"})
_CONSTRAINTS = frozenset(CONSTRAINT_COLUMNS)


@dataclass(slots=True)
class RowRequest:
    prompt: str | list[int] | None = None
    params: SamplingParams | None = None
    error: str | None = None  # "code: message"; the row is not submitted
    where: str = ""  # "row 12 (id='a')": how errors name the row, the engine's included


class RowPreparer:
    """Builds the requests of one partition's rows for one job."""

    def __init__(self, spec: JobSpec, chat: ChatFn | None = None,
                 prompt_limit: PromptLimit | None = None):
        """`prompt_limit`: the engine's; without it prompts are not sized here (the engine
        still refuses a prompt too large to fit) and templates get a default bound."""
        self.spec = spec
        self.limit = prompt_limit
        self.template = None
        if spec.prompt_template:  # no value it builds may be larger than a prompt can be
            self.template = PromptTemplate(spec.prompt_template,
                                           prompt_limit and prompt_limit.max_bytes)
        # The columns a prompt is made of: an unreadable cell there fails the row.
        self.prompt_columns = self.template.columns if self.template else \
            {spec.prompt_column, MESSAGES_COLUMN, spec.messages_column} - {None}
        self.chat = chat
        self.base = spec.sampling_params()
        self.param_columns: list[str] = []  # of the table being prepared

    def id_column(self, columns) -> str | None:
        """The column naming rows: --id-column, else an input `row_id` (a job's output
        fed to another keeps its ids); None: the output gets a `row_id` column."""
        if self.spec.id_column:
            return self.spec.id_column
        return ROW_ID_COLUMN if ROW_ID_COLUMN in columns else None

    def data_columns(self, columns) -> set:
        """The columns the prompt is made of, and the id: never parameters by default."""
        return self.prompt_columns | ({self.id_column(columns)} - {None})

    def parameters(self, columns) -> list[str]:
        """The input's per-row parameter columns (`jobs/params.py` says which)."""
        return parameter_columns(columns, self.spec.param_columns, self.data_columns(columns))

    def column_warnings(self, columns) -> list[str]:
        """Columns that look meant as parameters but are not: shown before the job runs."""
        return column_warnings(columns, self.spec.param_columns, self.data_columns(columns))

    def input_columns(self, columns) -> list[str]:
        """The columns the rows need; raises JobError naming a missing one."""
        names = set(columns)
        params = self.parameters(columns)
        clash = sorted(names & set(OUTPUT_COLUMNS) - (_REPLACED & set(params)))
        if clash:
            raise JobError(f"input already has output column(s) {', '.join(clash)}; rename "
                           "or drop them (e.g. when feeding a job's output to another job)")
        if self.template is not None:
            needed = {c: "--prompt-template" for c in self.template.columns}
        elif self.spec.messages_column:
            needed = {self.spec.messages_column: "--messages-column"}
        elif self.spec.chat and MESSAGES_COLUMN in names:
            needed = {MESSAGES_COLUMN: "--chat"}
        else:
            needed = {self.spec.prompt_column: "--prompt-column"}
        if self.spec.id_column:
            needed[self.spec.id_column] = "--id-column"
        missing = [f"{c!r} (from {how})" for c, how in needed.items() if c not in names]
        if missing:
            raise JobError(f"column {', '.join(missing)} not in the input; its columns are "
                           f"{', '.join(columns)}")
        return sorted(set(needed) | set(params) | ({self.id_column(columns)} - {None}))

    def prepare(self, table: pa.Table, first_row: int) -> list[RowRequest]:
        columns = self.input_columns(table.column_names)
        self.param_columns = self.parameters(table.column_names)
        rows = read_rows(table.select(columns))
        return [self.prepare_row(row, first_row + i) for i, row in enumerate(rows)]

    def constrained(self, columns) -> bool:
        """Whether any row of a table with these columns can be constrained."""
        return bool(self.base_constraint or _CONSTRAINTS & set(self.parameters(columns)))

    @property
    def base_constraint(self) -> bool:
        return any(getattr(self.base, n, None) is not None for n in CONSTRAINT_COLUMNS[:4])

    def prepare_row(self, row: dict, index: int) -> RowRequest:
        """`index`: the row's global position (over all input files): names it, seeds it."""
        error = self._unreadable(row)
        prompt, error = (None, error) if error else self._prompt(row)
        if error is None:
            params, error = self._params(row, index)
        where = self._where(row, index)
        if error is not None:
            return RowRequest(error=f"{error[0]}: {where}: {error[1]}", where=where)
        return RowRequest(prompt=prompt, params=params, where=where)

    def _where(self, row: dict, index: int) -> str:
        id_column = self.id_column(row)
        if id_column:
            shown = repr(row.get(id_column))
            shown = shown if len(shown) <= 80 else shown[:80] + "..."
            return f"row {index} ({id_column}={shown})"
        return f"row {index}"

    def _unreadable(self, row: dict):
        """(code, message) for the first cell that could not be read, or None. An id alone
        does not fail its row: it only names it (shown with the bad bytes escaped)."""
        for column, value in row.items():
            if not isinstance(value, Unreadable) or (
                    column == self.id_column(row) and column not in self.prompt_columns):
                continue
            code = errors.INVALID_PARAMS if column in self.param_columns else \
                errors.INVALID_PROMPT
            return code, f"column {column!r} {value.reason}; fix or drop this value in the input"
        return None

    def _prompt(self, row: dict):
        """(prompt, None) or (None, (code, message))."""
        if self.spec.messages_column:
            return self._chat(row[self.spec.messages_column], self.spec.messages_column)
        if self.template is not None:
            try:
                text = self.template.render(row)
            except Exception as exc:  # noqa: BLE001 - any failure is this row's error
                return None, (errors.TEMPLATE_ERROR, f"prompt_template: {type(exc).__name__}: {exc}")
            if not text:
                return None, (errors.EMPTY_PROMPT, "prompt_template rendered an empty prompt")
        elif self.spec.chat and MESSAGES_COLUMN in row:
            return self._chat(row[MESSAGES_COLUMN])
        else:
            text = row[self.spec.prompt_column]
            col = self.spec.prompt_column
            if text is None:
                return None, (errors.NULL_PROMPT, f"column {col!r} is null")
            if not isinstance(text, str):
                return None, (errors.INVALID_PROMPT,
                              f"column {col!r} holds {type(text).__name__}, not a string")
            if not text:
                return None, (errors.EMPTY_PROMPT, f"column {col!r} is empty")
        problem = prompt_problem(text, self.limit)
        if problem:
            return None, tuple(problem.split(": ", 1))
        if self.spec.chat:
            return self._chat([{"role": "user", "content": text}])
        return text, None

    def _chat(self, messages, column: str = MESSAGES_COLUMN):
        """A list of messages (Parquet list<struct<role, content>>, or that list as JSON
        text) through the chat template."""
        if messages is None:
            return None, (errors.NULL_PROMPT, f"column {column!r} is null")
        if isinstance(messages, str):
            try:
                messages = read_json(messages)
            except TooDeep as exc:
                return None, (errors.INVALID_PROMPT, f"column {column!r} {exc}")
            except ValueError as exc:
                return None, (errors.INVALID_PROMPT, f"column {column!r} is not a JSON list "
                              f"of messages ({exc})")
        messages, problem = conversation(messages, f"column {column!r}",
                                         self.spec.system_prompt, self.limit)
        if problem:
            return None, problem
        try:
            return self.chat(messages), None
        except PromptError as exc:  # past the prompt limit, or the tokenizer failed on it
            return None, (exc.code, str(exc))
        except Exception as exc:  # noqa: BLE001
            return None, (errors.TEMPLATE_ERROR, f"chat template: {type(exc).__name__}: {exc}")

    def _params(self, row: dict, index: int):
        """(SamplingParams, None) or (None, (code, message)), the row's overrides applied."""
        seed = None if self.base.seed is None else row_seed(self.base.seed, index)
        try:
            changes = {"seed": seed, **row_changes(row, self.param_columns)}
        except ParamError as exc:
            return None, (errors.INVALID_PARAMS, f"{exc} (per-row column)")
        if _CONSTRAINTS & changes.keys():  # the row's constraint replaces the job's
            changes = {**dict.fromkeys(CONSTRAINT_COLUMNS[:4]), **changes}
        params = dataclasses.replace(self.base, **changes)
        problem = params.validate()
        if problem:
            return None, (errors.INVALID_PARAMS, f"{problem} (per-row column override)")
        return params, None


def conversation(messages, what: str, system_prompt: str | None,
                 limit: PromptLimit | None):
    """(messages, None): the conversation as the chat template gets it, `system_prompt`
    first unless it opens with its own; (None, (code, message)) when it cannot be a prompt.
    Everything is checked before the template renders it, since rendering and tokenizing
    cost memory per byte of content (a 20 MB message would take gigabytes): its nesting,
    its shape, its text (no lone surrogate), its size against `limit`. `what` names the
    value in messages ("column 'messages'", "body.messages")."""
    problem = nesting_problem(messages) or messages_problem(messages)
    if problem:
        return None, (errors.INVALID_PROMPT, f"{what} {problem}")
    bad = lone_surrogate(messages)
    if bad:
        where, char, at = bad
        return None, (errors.INVALID_PROMPT, f"{what} holds a lone surrogate U+{ord(char):04X} "
                      f"(character {at} of {where.lstrip('.')}), which is not valid Unicode; "
                      "remove it")
    if system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    too_long = limit and limit.conversation_too_long(messages)
    if too_long:
        return None, tuple(too_long.split(": ", 1))
    return messages, None


class Unreadable:
    """A cell pyarrow could not turn into a Python value (invalid UTF-8 in a string
    column, a date out of Python's range): it fails its row, not the partition."""

    def __init__(self, reason: str, shown: str):
        self.reason = reason  # "is not valid UTF-8 (...)"
        self.shown = shown  # the value with bad bytes escaped, to name a row by its id

    def __repr__(self) -> str:
        return repr(self.shown)


def read_rows(table: pa.Table) -> list[dict]:
    """The table's rows as dicts; a cell that cannot be read becomes `Unreadable`."""
    try:
        return table.to_pylist()
    except Exception:  # noqa: BLE001 - rare: find the cells, column by column
        columns = {name: _read_column(table.column(name)) for name in table.column_names}
        return [dict(zip(columns, values)) for values in zip(*columns.values())] \
            if columns else [{} for _ in range(table.num_rows)]


def _read_column(column: pa.ChunkedArray) -> list:
    try:
        return column.to_pylist()
    except Exception:  # noqa: BLE001
        return [_read_cell(cell) for cell in column]


def _read_cell(cell: pa.Scalar):
    try:
        return cell.as_py()
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        reason = f"is not valid UTF-8 (byte 0x{byte:02x} at offset {exc.start}: {exc.reason})"
    except Exception as exc:  # noqa: BLE001
        reason = f"cannot be read ({type(exc).__name__}: {exc})"
    try:
        shown = cell.cast(pa.binary()).as_py().decode("utf-8", "backslashreplace")
    except Exception:  # noqa: BLE001 - not a string: name it by its type
        shown = f"<unreadable {cell.type}>"
    return Unreadable(reason, shown)


def row_seed(base: int, index: int) -> int:
    """A well-mixed 63-bit seed per row (splitmix64), stable across partitioning and resume."""
    z = (base * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1
