"""The workflow file: YAML -> one validated `Workflow`, every problem named by step and key.

    name: headlines
    params: {topics: data/topics.parquet, min_tokens: 4}
    schedule: {cron: "0 2 * * *", timezone: Europe/Paris, missed: catch_up}
    defaults: {model: ./model, temperature: 0}     # job options for every generate step
    steps:
      draft:                                     # a generation job
        input: "{{ topics }}"
        generate: {prompt_template: "A headline about {{ topic }}:", max_tokens: 16}
      keep:                                      # a transform
        from: draft
        drop_errors: true
        filter: "num_generated_tokens >= {{ min_tokens }}"
        select: [topic, generated_text]
        rename: {generated_text: headline}
      tidy:                                      # a python step (python_step.py)
        from: keep
        python: cleaners:tidy                    # module:function, run on each partition
        format: pandas                           # default arrow

This module checks what can be checked without data: keys, types, references, cycles,
variables, the schedule. `resolve.py` fills in the variables for one run and checks the
columns each step reads against the schemas of its inputs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from fusegen.jobs import FIELD_NAMES, JobError, load_job_file
from fusegen.workflows.dag import CycleError, run_order
from fusegen.workflows.errors import Problem, ValidationError
from fusegen.workflows.expr import Expression, ExpressionError
from fusegen.workflows.pyfunc import FORMATS, ref_problem
from fusegen.workflows.render import (ROW_TEMPLATE_KEYS, RUN_VARIABLES, TemplateError,
                                      names_in, template_keys)

TOP_KEYS = ("name", "params", "schedule", "workdir", "defaults", "steps")
SCHEDULE_KEYS = ("cron", "timezone", "missed", "overlap", "grace_seconds")
MISSED_POLICIES = ("skip", "catch_up")
OVERLAP_POLICIES = ("forbid",)
TRANSFORM_KEYS = ("drop_errors", "filter", "select", "rename")
PYTHON_KEYS = ("python", "format")
STEP_KEYS = ("input", "from", "output", "generate", *TRANSFORM_KEYS, *PYTHON_KEYS,
             "partition_rows", "storage_options")
JOB_KEYS = tuple(k for k in FIELD_NAMES if k not in ("input", "output")) + ("job_file",)
TRANSFORM_PARTITION_ROWS = 10_000
# fullmatch, never match: `$` also matches before a trailing newline ("nightly\n")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(slots=True)
class Schedule:
    cron: str  # five fields: minute hour day-of-month month day-of-week
    timezone: str = "UTC"  # the cron is read on this zone's wall clock (DST included)
    missed: str = "skip"  # fires missed while down or busy: skip them, or catch_up (run each)
    overlap: str = "forbid"  # never two runs of one workflow at once (the only policy)
    grace_seconds: float = 60.0  # a fire this late still counts as on time

    @property
    def tz(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)


@dataclass(slots=True)
class Step:
    name: str
    input: str | None = None  # a dataset URL (variables allowed) ...
    from_step: str | None = None  # ... or another step's output
    output: str | None = None  # default: <workdir>/<step name>
    generate: dict | None = None  # job options (defaults merged), variables not yet filled
    transform: dict = field(default_factory=dict)  # drop_errors / filter / select / rename
    python: str | None = None  # module:function, applied to each partition
    format: str = "arrow"  # python steps: the function gets a pyarrow Table or a DataFrame
    partition_rows: int = TRANSFORM_PARTITION_ROWS  # transform and python steps
    storage_options: dict | None = None  # transform and python steps (generate: under generate:)

    @property
    def kind(self) -> str:
        if self.generate is not None:
            return "generate"
        return "python" if self.python is not None else "transform"

    @property
    def parents(self) -> list[str]:
        return [self.from_step] if self.from_step else []


@dataclass(slots=True)
class Workflow:
    name: str
    source: str  # the file, for messages and history
    base_dir: str  # relative local paths in the file are read from here
    steps: dict[str, Step]  # file order
    order: list[str]  # run order: each step after the step it reads
    params: dict = field(default_factory=dict)  # name -> default
    defaults: dict = field(default_factory=dict)  # job options for every generate step
    workdir: str | None = None  # outputs of steps without `output:`
    schedule: Schedule | None = None
    path: str | None = None  # the file, absolute (None when parsed from a mapping)


def load_workflow(path: str) -> Workflow:
    workflow, problems = load_checked(path)
    if problems:
        raise ValidationError(path, problems)
    return workflow


def load_checked(path: str) -> tuple[Workflow | None, list[Problem]]:
    """The file's Workflow as far as it could be read, and every problem found in it
    (the Workflow is None when the file is not a readable YAML mapping)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        return None, [Problem(None, None, f"cannot read it: {exc.strerror}")]
    except yaml.YAMLError as exc:
        return None, [Problem(None, None, f"not valid YAML: {exc}")]
    checker = _Checker(path)
    workflow = checker.workflow(data)
    if workflow is not None:
        workflow.path = os.path.abspath(path)
    return workflow, checker.problems


def parse_workflow(data, source: str) -> Workflow:
    """The Workflow of a parsed YAML document; raises ValidationError listing every problem."""
    checker = _Checker(source)
    workflow = checker.workflow(data)
    if checker.problems:
        raise ValidationError(source, checker.problems)
    return workflow


class _Checker:
    def __init__(self, source: str):
        self.source = source
        self.base_dir = os.path.dirname(os.path.abspath(source)) if os.path.exists(source) \
            else os.getcwd()
        self.problems: list[Problem] = []

    def problem(self, step, key, message):
        self.problems.append(Problem(step, key, message))

    def workflow(self, data) -> Workflow | None:
        if not isinstance(data, dict):
            self.problem(None, None, "the file must be a mapping with a `steps:` key")
            return None
        data = self._keys(data, TOP_KEYS, None, "")
        name = data.get("name", os.path.splitext(os.path.basename(self.source))[0])
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            self.problem(None, "name", f"{name!r} must be letters, digits, '_', '-' or '.'")
        params = self._params(data.get("params", {}))
        defaults = self._job_options(data.get("defaults", {}), None, "defaults")
        schedule = self._schedule(data["schedule"]) if data.get("schedule") is not None else None
        steps = self._steps(data.get("steps"), defaults)
        order = self._order(steps)
        workdir = data.get("workdir")
        if workdir is not None and not isinstance(workdir, str):
            self.problem(None, "workdir", "must be a directory URL")
        workflow = Workflow(name=name, source=self.source, base_dir=self.base_dir, steps=steps,
                            order=order, params=params, defaults=defaults, workdir=workdir,
                            schedule=schedule)
        self._variables(workflow, data)
        if schedule is not None:
            self._dated_outputs(workflow)
        return workflow

    def _keys(self, data: dict, allowed, step, prefix: str) -> dict:
        """data with keys normalised (`max-tokens` -> `max_tokens`); unknown keys reported."""
        data = {str(k).replace("-", "_"): v for k, v in data.items()}
        for key in data:
            if key not in allowed:
                hint = _closest(key, allowed)
                self.problem(step, f"{prefix}{key}", "unknown key" + (
                    f"; did you mean {hint!r}?" if hint else f"; valid keys: {', '.join(allowed)}"))
        return data

    def _params(self, params) -> dict:
        if not isinstance(params, dict):
            self.problem(None, "params", "must be a mapping of name: default value")
            return {}
        for name, value in params.items():
            if not isinstance(name, str) or not _PARAM.fullmatch(name):
                self.problem(None, f"params.{name}", "a parameter name must be an identifier "
                             "(letters, digits, '_')")
            elif name in RUN_VARIABLES:
                self.problem(None, f"params.{name}", f"{name} is set by each run; pick "
                             "another name" + (f" (override it with --{name.replace('_', '-')})"
                                               if name != "run_id" else ""))
            if isinstance(value, dict):
                self.problem(None, f"params.{name}", "a default must be a value or a list")
            for key, text in template_keys(value, f"params.{name}"):
                try:
                    others = names_in(text, key) - set(RUN_VARIABLES)
                except TemplateError as exc:
                    self.problem(None, key, str(exc))
                    continue
                if others:
                    self.problem(None, key, f"a parameter can use {', '.join(RUN_VARIABLES)} "
                                 f"only, not {', '.join(sorted(others))}")
        return dict(params)

    def _job_options(self, options, step, prefix: str) -> dict:
        if not isinstance(options, dict):
            self.problem(step, prefix, "must be a mapping of job options (model, max_tokens, ...)")
            return {}
        for key in ("input", "output"):
            if key in options:
                options.pop(key)
                self.problem(step, f"{prefix}.{key}", f"a step's {key} is set on the step "
                             f"itself (`{key}:`" + (" or `from:`)" if key == "input" else ")"))
        options = self._keys(options, JOB_KEYS, step, f"{prefix}.")
        job_file = options.pop("job_file", None)
        if job_file is not None:
            try:
                loaded = load_job_file(os.path.join(self.base_dir, job_file))
            except JobError as exc:
                self.problem(step, f"{prefix}.job_file", str(exc))
                loaded = {}
            loaded.pop("input", None)
            loaded.pop("output", None)
            options = {**loaded, **options}
        return {k: v for k, v in options.items() if k in JOB_KEYS}

    def _schedule(self, data) -> Schedule | None:
        if not isinstance(data, dict) or "cron" not in data:
            self.problem(None, "schedule", "must be a mapping with at least `cron:`, e.g. "
                         "{cron: \"0 2 * * *\", timezone: UTC}")
            return None
        data = self._keys(data, SCHEDULE_KEYS, None, "schedule.")
        problem = cron_problem(data["cron"])
        if problem:
            self.problem(None, "schedule.cron", problem)
        tz = data.get("timezone", "UTC")
        try:
            ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError):
            self.problem(None, "schedule.timezone", f"{tz!r} is not a known time zone; use an "
                         "IANA name such as UTC or Europe/Paris")
        for key, allowed in (("missed", MISSED_POLICIES), ("overlap", OVERLAP_POLICIES)):
            if key in data and data[key] not in allowed:
                self.problem(None, f"schedule.{key}", f"{data[key]!r} is not one of "
                             f"{', '.join(allowed)}")
        grace = data.get("grace_seconds", 60.0)
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
            self.problem(None, "schedule.grace_seconds", f"must be a number >= 0, got {grace!r}")
        known = {k: v for k, v in data.items() if k in SCHEDULE_KEYS}
        return None if problem else Schedule(**known)

    def _steps(self, data, defaults: dict) -> dict[str, Step]:
        if not isinstance(data, dict) or not data:
            self.problem(None, "steps", "must be a non-empty mapping of step name: step")
            return {}
        steps = {}
        for name, body in data.items():
            name = str(name)
            if not _NAME.fullmatch(name):
                self.problem(name, None, "a step name must be letters, digits, '_', '-' or '.'")
            if not isinstance(body, dict):
                self.problem(name, None, "a step must be a mapping (input: / from:, then "
                             "generate: or a transform)")
                continue
            steps[name] = self._step(name, self._keys(body, STEP_KEYS, name, ""), defaults)
        for step in steps.values():
            if step.from_step is not None and step.from_step not in steps:
                hint = _closest(step.from_step, list(steps))
                self.problem(step.name, "from", f"no step is named {step.from_step!r}" + (
                    f"; did you mean {hint!r}?" if hint else f"; the steps are {', '.join(steps)}"))
        return steps

    def _step(self, name: str, body: dict, defaults: dict) -> Step:
        step = Step(name=name, output=body.get("output"))
        if ("input" in body) == ("from" in body):
            self.problem(name, "input", "give exactly one of `input:` (a dataset URL) or "
                         "`from:` (another step's name)")
        for key in ("input", "from", "output"):
            if key in body and not (isinstance(body[key], str) and body[key]):
                self.problem(name, key, "must be a non-empty string")
        step.input, step.from_step = body.get("input"), body.get("from")
        transform = {k: body[k] for k in TRANSFORM_KEYS if k in body}
        if "format" in body and "python" not in body:
            self.problem(name, "format", "only a python step (`python: module:function`) "
                         "takes a format")
        if "generate" in body:
            if "python" in body:
                self.problem(name, "python", "a step either generates or runs a function; "
                             "move this to its own step (`from: " + name + "`)")
            if transform:
                self.problem(name, next(iter(transform)), "a step either generates or "
                             "transforms; move this to its own step (`from: " + name + "`)")
            for key in ("partition_rows", "storage_options"):
                if key in body:
                    self.problem(name, key, "a generate step takes job options under "
                                 f"`generate:` (generate.{key})")
            options = self._job_options(body["generate"] or {}, name, "generate")
            step.generate = {**defaults, **options}
            if "model" not in step.generate:
                self.problem(name, "generate.model", "no model: set generate.model or "
                             "defaults.model")
        elif not transform and "python" not in body:
            self.problem(name, None, "nothing to do: add `generate:`, `python:` or a "
                         f"transform ({', '.join(TRANSFORM_KEYS)})")
        else:
            if "python" in body:
                self._python(step, body, transform)
            else:
                step.transform = self._transform(name, transform)
            step.partition_rows = body.get("partition_rows", TRANSFORM_PARTITION_ROWS)
            rows = step.partition_rows
            if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
                self.problem(name, "partition_rows", f"must be an integer >= 1, got {rows!r}")
            step.storage_options = body.get("storage_options", defaults.get("storage_options"))
            if step.storage_options is not None and not isinstance(step.storage_options, dict):
                self.problem(name, "storage_options", "must be a mapping of fsspec options")
        return step

    def _python(self, step: Step, body: dict, transform: dict) -> None:
        if transform:
            self.problem(step.name, next(iter(transform)), "a python step's function does "
                         "its own filtering and selecting; put this transform in its own "
                         f"step (`from: {step.name}`)")
        problem = ref_problem(body["python"])
        if problem:
            self.problem(step.name, "python", problem)
        step.python = body["python"] if not problem else ""
        step.format = body.get("format", "arrow")
        if step.format not in FORMATS:
            self.problem(step.name, "format", f"{step.format!r} is not one of "
                         f"{', '.join(FORMATS)}")

    def _transform(self, name: str, t: dict) -> dict:
        if "drop_errors" in t and not isinstance(t["drop_errors"], bool):
            self.problem(name, "drop_errors", "must be true or false")
        if "filter" in t:
            text = t["filter"]
            if not isinstance(text, str):
                self.problem(name, "filter", "must be an expression string, e.g. "
                             "\"error is null and score > 3\"")
            elif "{{" not in text:  # with variables it is parsed once they are filled in
                try:
                    Expression(text)
                except ExpressionError as exc:
                    self.problem(name, "filter", str(exc))
        if "select" in t and not (isinstance(t["select"], list) and t["select"]
                                  and all(isinstance(c, str) for c in t["select"])):
            self.problem(name, "select", "must be a non-empty list of column names")
        if "rename" in t and not (isinstance(t["rename"], dict) and t["rename"] and all(
                isinstance(k, str) and isinstance(v, str) for k, v in t["rename"].items())):
            self.problem(name, "rename", "must be a mapping of old column name: new name")
        return t

    def _order(self, steps: dict[str, Step]) -> list[str]:
        parents = {s.name: [p for p in s.parents if p in steps] for s in steps.values()}
        try:
            return run_order(parents)
        except CycleError as exc:
            self.problem(exc.cycle[0], "from", f"steps form a cycle: {exc} (each step reads "
                         "the one before it); a workflow must be acyclic")
            return list(steps)

    def _variables(self, workflow: Workflow, data: dict) -> None:
        """Every {{ name }} outside row templates must be a parameter or run_date."""
        known = set(workflow.params) | set(RUN_VARIABLES)
        raw_steps = data.get("steps") if isinstance(data.get("steps"), dict) else {}
        sources = [(None, "workdir", data.get("workdir")), (None, "defaults", data.get("defaults"))]
        sources += [(str(n), "", body) for n, body in raw_steps.items()]
        for step, prefix, value in sources:
            for key, text in template_keys(value, prefix):
                try:
                    names = names_in(text, key.rsplit(".", 1)[-1])
                except TemplateError as exc:
                    self.problem(step, key, str(exc))
                    continue
                if key.rsplit(".", 1)[-1] in ROW_TEMPLATE_KEYS:
                    continue  # the other names there are the rows' columns
                for unknown in sorted(names - known):
                    self.problem(step, key, f"unknown variable {unknown!r}; declare it under "
                                 f"`params:` (known: {', '.join(sorted(known))})")

    def _dated_outputs(self, workflow: Workflow) -> None:
        """Scheduled runs must not share outputs, or each run would meet the last one's."""
        for where, key, value in [(None, "workdir", workflow.workdir)] + [
                (s.name, "output", s.output) for s in workflow.steps.values()]:
            if isinstance(value, str) and not set(RUN_VARIABLES) & _safe_names(value, key):
                self.problem(where, key, f"{value!r} is the same for every run of a scheduled "
                             "workflow; put {{ run_date }} in it (e.g. out/{{ run_date }}/...), "
                             "or {{ run_time }} for one output per fire")


def cron_problem(expr) -> str | None:
    """Why `expr` is not a usable cron expression, or None."""
    if not isinstance(expr, str) or len(expr.split()) != 5:
        return (f"{expr!r} is not a cron expression; use five fields: minute hour "
                "day-of-month month day-of-week, e.g. \"0 2 * * *\" (02:00 daily)")
    try:
        croniter(expr)
    except (ValueError, KeyError) as exc:
        return f"{expr!r} is not a valid cron expression: {exc}"
    try:  # valid fields can still name no date at all (February 30th)
        croniter(expr, datetime(2000, 1, 1)).get_next(datetime)
    except CroniterBadDateError:
        return (f"{expr!r} never fires (no such date); check the day-of-month and month "
                "fields")
    return None


def _safe_names(text: str, key: str) -> set[str]:
    try:
        return names_in(text, key)
    except TemplateError:
        return set()


def _closest(word: str, choices) -> str | None:
    import difflib

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return match[0] if match else None
