"""One run's workflow: variables filled in, every step built, every column checked.

Nothing runs here and no rows are read: input datasets are opened for their Parquet
footers only (the schema), and each step's output schema is derived from its input's
(a generate step adds the generation columns; a transform is applied to an empty table).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from fusegen.jobs import (MESSAGES_COLUMN, OUTPUT_COLUMNS, JobError, JobSpec, PromptTemplate,
                          Redactor, build_spec, filesystem, list_input_files, output_table)
from fusegen.engine.weights.hub import looks_like_hub_id
from fusegen.workflows.errors import Problem, ValidationError
from fusegen.workflows.expr import ExpressionError
from fusegen.workflows.render import (RUN_DATE, RUN_ID, RUN_TIME, TemplateError, names_in,
                                      render, template_keys)
from fusegen.workflows.credentials import public_params, secret_params, secret_values
from fusegen.workflows.pyfunc import FunctionError, PythonFunction
from fusegen.workflows.spec import Step, Workflow
from fusegen.workflows.store import state_dir
from fusegen.workflows.transform import Transform


# The options of `defaults:` that say where a python step's tasks run when no generate
# step opened a Dask client before it.
CLUSTER_KEYS = ("scheduler", "workers", "partitions_per_worker")
# jobs.open_client takes a JobSpec, which names a model; a python step loads none.
_NO_MODEL = "fusegen/no-model"


@dataclass(slots=True)
class ResolvedStep:
    name: str
    kind: str  # generate | transform | python
    input: str  # dataset URL (another step's output directory for `from:`)
    output: str
    parents: list[str] = field(default_factory=list)
    job: JobSpec | None = None  # generate steps
    transform: Transform | None = None  # transform steps
    python: PythonFunction | None = None  # python steps
    cluster: JobSpec | None = None  # python steps: CLUSTER_KEYS, for jobs.open_client
    # python steps: the steps reading its output, whose columns each returned table needs
    readers: list["ResolvedStep"] = field(default_factory=list)
    partition_rows: int = 0  # transform and python steps
    storage_options: dict = field(default_factory=dict)
    schema: pa.Schema | None = None  # its output's columns, derived before anything runs
    in_workdir: bool = False  # output is the workflow's own (no `output:` in the file)


@dataclass(slots=True)
class ResolvedWorkflow:
    workflow: Workflow
    run_date: str
    params: dict  # defaults with the --param overrides applied
    workdir: str
    steps: list[ResolvedStep]  # run order
    secret: set[str] = field(default_factory=set)  # the params that are credentials
    run_time: str = ""  # ISO 8601 UTC: the fire time, or a manual run's
    run_id: int = 0  # the run store's id of the run's first attempt (0: not recorded)

    @property
    def public_params(self) -> dict:
        """The params as the run store and every message show them."""
        return public_params(self.params, self.secret)

    def redactor(self, step: ResolvedStep | None = None) -> Redactor:
        """Blanks the credential params, and the step's credentials, in any text."""
        secrets = secret_values(self.params, self.secret)
        if step is None:
            return Redactor(secrets=secrets)
        return Redactor(step.storage_options, urls=(step.input, step.output), secrets=secrets)


def effective_params(workflow: Workflow, overrides: dict | None) -> dict:
    problems = _unknown_params(workflow, overrides)
    if problems:
        raise ValidationError(workflow.source, problems)
    return {**workflow.params, **(overrides or {})}


def _unknown_params(workflow: Workflow, overrides: dict | None) -> list[Problem]:
    unknown = sorted(set(overrides or {}) - set(workflow.params))
    if not unknown:
        return []
    known = ", ".join(workflow.params) or "none"
    return [Problem(None, "params", f"unknown parameter(s) {', '.join(unknown)} (from "
                    f"--param); the file declares: {known}")]


def resolve(workflow: Workflow, overrides: dict | None, run_date: str, *,
            run_time: str | None = None, run_id: int = 0) -> ResolvedWorkflow:
    """Raises ValidationError listing every problem found. `run_time` defaults to the run
    date's midnight (UTC); `run_id` to 0, for a run not yet recorded."""
    resolved, problems = resolve_all(workflow, overrides, run_date, run_time=run_time,
                                     run_id=run_id)
    if problems:
        raise ValidationError(workflow.source, problems)
    return resolved


def resolve_all(workflow: Workflow, overrides: dict | None, run_date: str,
                tolerate: frozenset[str] = frozenset(), *, run_time: str | None = None,
                run_id: int = 0) -> tuple[ResolvedWorkflow, list[Problem]]:
    """The steps that could be built, and every problem found on the way: a broken step
    leaves out only the steps that read it, and every other step's columns are checked.
    `tolerate`: steps with problems already reported; one that cannot be built is left
    out instead of raising."""
    problems = _unknown_params(workflow, overrides)
    params = {**workflow.params, **{k: v for k, v in (overrides or {}).items()
                                    if k in workflow.params}}
    run_variables = {RUN_DATE: run_date, RUN_TIME: run_time or f"{run_date}T00:00:00Z",
                     RUN_ID: run_id}
    variables = _variables(params, run_variables, problems)
    workdir = _workdir(workflow, params, variables, run_date, problems)
    steps: dict[str, ResolvedStep] = {}
    for name in workflow.order:
        try:
            step = _build(workflow, workflow.steps[name], variables, workdir, steps, problems)
        except Exception:  # noqa: BLE001 - only where the file's problem is already named
            if name not in tolerate:
                raise
            step = None
        if step is not None:
            steps[name] = step
    _check_columns(workflow, steps, problems)
    for step in steps.values():
        if step.python is not None:
            step.readers = [s for s in steps.values() if step.name in s.parents]
    secret = secret_params(workflow, params, run_date, run_variables)
    return (ResolvedWorkflow(workflow, run_date, params, workdir, list(steps.values()), secret,
                             run_variables[RUN_TIME], run_id), problems)


def uses_variable(workflow: Workflow, name: str) -> bool:
    """Whether any string of the file (params, workdir, steps) reads variable `name`."""
    strings = [("params", workflow.params), ("workdir", workflow.workdir)] + [
        (key, value) for step in workflow.steps.values()
        for key, value in [("input", step.input), ("output", step.output),
                           ("generate", step.generate), ("", step.transform),
                           ("storage_options", step.storage_options)]]
    for prefix, value in strings:
        for key, text in template_keys(value, prefix):
            try:
                if name in names_in(text, key.rsplit(".", 1)[-1]):
                    return True
            except TemplateError:
                continue
    return False


def _variables(params: dict, run_variables: dict, problems: list) -> dict:
    """Parameter values may use the run's variables (topics: "raw/{{ run_date }}/")."""
    variables = dict(run_variables)
    for name, value in params.items():
        try:
            variables[name] = render(value, run_variables, f"params.{name}")
        except TemplateError as exc:
            problems.append(Problem(None, f"params.{name}", f"{exc} (a parameter can use "
                                    f"{', '.join(run_variables)} only)"))
    return variables


def _workdir(workflow, params, variables, run_date, problems) -> str:
    if workflow.workdir is None:
        key = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode())
        return str(state_dir() / "work" / workflow.name / f"{run_date}-{key.hexdigest()[:8]}")
    try:
        return _local(render(workflow.workdir, variables, "workdir"), workflow.base_dir)
    except TemplateError as exc:
        problems.append(Problem(None, "workdir", str(exc)))
        return ""


def _build(workflow: Workflow, step: Step, variables: dict, workdir: str,
           built: dict, problems: list) -> ResolvedStep | None:
    def filled(value, key):
        try:
            return render(value, variables, key)
        except TemplateError as exc:
            problems.append(Problem(step.name, key, str(exc)))
            return None

    base = workflow.base_dir
    if step.from_step is not None:
        parent = built.get(step.from_step)
        if parent is None:  # the parent is broken: its problem is already reported
            return None
        url = parent.output
    else:
        url = filled(step.input, "input")
        if url is None:  # reported; its columns cannot be read
            return None
        url = _local(url, base)
    output = _local(filled(step.output, "output") or "", base) if step.output \
        else f"{workdir.rstrip('/')}/{step.name}"
    resolved = ResolvedStep(step.name, step.kind, url, output, step.parents,
                            in_workdir=not step.output)
    if step.kind == "generate":
        options = filled(step.generate, "generate")
        if options is None:
            return None
        if isinstance(options.get("model"), str):
            options["model"] = _model(options["model"], base)
        try:
            resolved.job = build_spec(options, {"input": url, "output": output})
        except JobError as exc:
            problems.append(Problem(step.name, "generate", str(exc)))
            return None
        resolved.storage_options = resolved.job.storage_options
        return resolved
    storage_options = filled(step.storage_options or {}, "storage_options")
    if storage_options is None:
        return None
    resolved.partition_rows = step.partition_rows
    resolved.storage_options = storage_options
    if step.kind == "python":
        return _python(workflow, step, resolved, filled, problems)
    options = filled(step.transform, "")
    if options is None:
        return None
    try:
        resolved.transform = Transform.from_options(options)
    except ExpressionError as exc:
        problems.append(Problem(step.name, "filter", str(exc)))
        return None
    return resolved


def _python(workflow: Workflow, step: Step, resolved: ResolvedStep, filled,
            problems: list) -> ResolvedStep | None:
    """The function found now (module importable, function callable), and the cluster
    its partitions run on when no generate step opened one."""
    try:
        resolved.python = PythonFunction.find(step.python, step.format, workflow.base_dir)
    except FunctionError as exc:
        problems.append(Problem(step.name, "python", str(exc)))
        return None
    settings = filled({k: workflow.defaults[k] for k in CLUSTER_KEYS
                       if k in workflow.defaults}, "defaults")
    if settings is None:
        return None
    try:
        resolved.cluster = build_spec({**settings, "model": _NO_MODEL},
                                      {"input": resolved.input, "output": resolved.output,
                                       "storage_options": resolved.storage_options})
    except JobError as exc:
        problems.append(Problem(step.name, "defaults", str(exc)))
        return None
    return resolved


def _check_columns(workflow: Workflow, steps: dict[str, ResolvedStep], problems: list):
    """Walk the DAG with schemas: input footers, then each step's derived output."""
    for step in steps.values():
        if step.parents:
            parent = steps[step.parents[0]]
            schema, origin = parent.schema, f"step {parent.name!r}"
            if schema is None:  # the parent is broken: already reported
                continue
        else:
            schema, origin = _input_schema(step, problems), f"input {step.input}"
            if schema is None:
                continue
        found = step_problems(step, schema.names, origin)
        problems.extend(found)
        if not found:
            step.schema = _output_schema(step, schema, problems)


def step_problems(step: ResolvedStep, columns: list[str], origin: str) -> list[Problem]:
    """The columns `step` reads that `columns` (from `origin`) lacks. A python step's
    function reads what it reads: its own checks are its business."""
    if step.job is not None:
        return _generate_problems(step, columns, origin)
    if step.transform is not None:
        return step.transform.problems(step.name, columns, origin)
    return []


def check_late(step: ResolvedStep, source: str) -> None:
    """A step whose input is a python step's output (or follows one), checked once that
    input exists: its columns, and its output schema for the steps after it. Raises
    ValidationError."""
    problems: list[Problem] = []
    schema = _input_schema(step, problems)
    if schema is not None:
        problems += step_problems(step, schema.names, f"step {step.parents[0]!r}")
        if not problems:
            step.schema = _output_schema(step, schema, problems)
    if problems:
        raise ValidationError(source, problems)


def _input_schema(step: ResolvedStep, problems: list) -> pa.Schema | None:
    key = "input"
    try:
        files = list_input_files(step.input, step.storage_options)
        fs, _ = filesystem(step.input, step.storage_options)
        schemas = []
        for f in files:
            with fs.open(f.path, "rb") as fh:
                schemas.append(pq.read_schema(fh))
        return pa.unify_schemas(schemas)
    except JobError as exc:
        problems.append(Problem(step.name, key, str(exc)))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        problems.append(Problem(step.name, key, f"its Parquet files disagree on columns: {exc}"))
    return None


def _generate_problems(step: ResolvedStep, columns: list[str], origin: str) -> list[Problem]:
    job, have = step.job, set(columns)
    source_key = "from" if step.parents else "input"
    clash = [c for c in OUTPUT_COLUMNS if c in have]
    if clash:
        return [Problem(step.name, source_key, f"{origin} already has the generation column(s) "
                        f"{', '.join(clash)}, which this step would add again; put a transform "
                        "step between them with `select:` or `rename:`")]
    if job.prompt_template is not None:
        try:
            needed = {c: "generate.prompt_template"
                      for c in sorted(PromptTemplate(job.prompt_template).columns)}
        except JobError as exc:
            return [Problem(step.name, "generate.prompt_template", str(exc))]
    elif job.messages_column:
        needed = {job.messages_column: "generate.messages_column"}
    elif job.chat and MESSAGES_COLUMN in have:
        needed = {}
    else:
        needed = {job.prompt_column: "generate.prompt_column"}
    if job.id_column:
        needed[job.id_column] = "generate.id_column"
    return [Problem(step.name, key, f"column {column!r} is not provided by {origin}; its "
                    f"columns are {', '.join(columns)}")
            for column, key in needed.items() if column not in have]


def _output_schema(step: ResolvedStep, schema: pa.Schema, problems: list) -> pa.Schema | None:
    if step.job is not None:
        return output_table(schema.empty_table(), [], [], step.job.output_token_ids).schema
    if step.python is not None:
        return None  # known from what the function returns, once it ran
    try:
        return step.transform.output_schema(schema)
    except ExpressionError as exc:
        problems.append(Problem(step.name, "filter", str(exc)))
        return None


def _model(name: str, base_dir: str) -> str:
    """A local path (a relative one from the workflow file's directory), or a hub id
    (org/name) when no such path exists there."""
    path = _local(name, base_dir)
    return name if looks_like_hub_id(name) and not os.path.exists(path) else path


def _local(url: str, base_dir: str) -> str:
    """A relative local path is read from the workflow file's directory."""
    if not url or "://" in url or os.path.isabs(os.path.expanduser(url)):
        return os.path.expanduser(url) if url and "://" not in url else url
    return os.path.join(base_dir, url)
