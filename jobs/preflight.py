"""Job-wide options checked once on the driver, before any model loads or any output is
written: an option that would fail every row fails the job with one line naming it,
instead of a run of identical error rows.

- The job's constraint (`--json-schema`, `--response-format`, `--regex`, `--choice`,
  `--grammar`) is compiled by the structured output engine's grammar builder and
  validated by llguidance without a tokenizer (a constraint that compiles but fails at
  its first token against the model's vocabulary is still each row's `invalid_params`).
- `--prompt-template` is rendered on sample rows of the first partition (rows whose
  columns it reads are not null, when there are such): failing on every one of them, the
  template is broken, not the rows.
"""
from __future__ import annotations

import dataclasses

from fusegen.jobs.errors import JobError
from fusegen.jobs.plan import Partition
from fusegen.jobs.redact import redact_url
from fusegen.jobs.rows import RowPreparer, read_rows
from fusegen.jobs.spec import JobSpec

SAMPLE_ROWS = 8  # rows the prompt template is rendered on
_SCAN_ROWS = 256  # rows of the first partition searched for rows without nulls


def check_job_options(spec: JobSpec, preparer: RowPreparer, plan: list[Partition],
                      columned: list) -> None:
    """Raise JobError naming the job option that would fail every row. `columned`: the
    input files with columns (none for an OpenAI batch file, whose lines are requests)."""
    check_constraint(spec)
    if preparer.template is not None and columned and plan:
        check_template(spec, preparer, plan[0])


def check_constraint(spec: JobSpec) -> None:
    from fusegen.engine.structured import INSTALL_HINT, _grammar_text, constraint_of

    try:
        key = constraint_of(spec.sampling_params())
    except (TypeError, ValueError) as exc:  # a schema holding what JSON cannot write
        raise JobError(f"{_flag(spec, 'json_schema')} is not JSON: {exc}") from None
    if key is None:
        return
    name, text = key
    flag = _flag(spec, name)
    try:
        import llguidance
    except ImportError:
        raise JobError(f"{flag} needs the llguidance package; install it with "
                       f"{INSTALL_HINT}") from None
    try:
        problem = llguidance.LLMatcher.validate_grammar(_grammar_text(llguidance, name, text))
    except (ValueError, TypeError) as exc:
        problem = str(exc)
    if problem:
        raise JobError(f"{flag} is not valid: {_one_line(problem)}; every row would fail "
                       "with it")


def _one_line(problem: str) -> str:
    """llguidance's message without the source excerpt and caret below it; a first line
    that ends in ":" (a regex's) gets the line that says what is wrong ("error: ...")."""
    lines = [line.strip() for line in problem.strip().splitlines() if line.strip()]
    first, cause = lines[0], [line for line in lines[1:] if line.startswith("error:")]
    if first.endswith(":") and cause:
        first += " " + cause[0].removeprefix("error:").strip()
    return first


def _flag(spec: JobSpec, name: str) -> str:
    """The option as the user gave it: a schema from response_format is that option's."""
    if name == "json_schema" and spec.response_format is not None:
        name = "response_format"
    return "--" + name.replace("_", "-")


def check_template(spec: JobSpec, preparer: RowPreparer, first: Partition) -> None:
    """Render the prompt template on SAMPLE_ROWS rows of the first partition; JobError
    naming the first row and its failure when it renders none of them."""
    from fusegen.jobs.storage import filesystem, read_partition

    fs, _ = filesystem(spec.input, spec.storage_options)
    if first.text is None:  # Parquet: only the first rows are read
        first = dataclasses.replace(first, stop=min(first.stop, first.start + _SCAN_ROWS))
    table = read_partition(fs, first, {})
    used = preparer.template.columns & set(table.column_names)
    id_column = preparer.id_column(table.column_names)
    columns = sorted(used | ({id_column} & set(table.column_names) - {None}))
    rows = read_rows(table.select(columns).slice(0, _SCAN_ROWS))
    indexed = list(enumerate(rows))
    whole = [(i, r) for i, r in indexed if all(r[c] is not None for c in used)]
    sample = (whole or indexed)[:SAMPLE_ROWS]
    failures = []
    for i, row in sample:
        try:
            if preparer.template.render(row):
                return
            failures.append((i, "it rendered an empty prompt"))
        except Exception as exc:  # noqa: BLE001 - any failure is the template's here
            failures.append((i, f"{type(exc).__name__}: {exc}"))
    if failures:
        i, problem = failures[0]
        named = f" ({id_column}={rows[i][id_column]!r})" if id_column in rows[i] else ""
        also = f" (and on the {len(failures) - 1} other rows tried)" if len(failures) > 1 else ""
        raise JobError(f"--prompt-template fails on row {first.first_row + i}{named} of "
                       f"{redact_url(first.path)}{also}: {problem}; every row would fail "
                       "with it")
