"""The job spec: one validated dataclass that the CLI flags and the job file both build.

Its keys are the job's own fields, the engine's options (`EngineOptions`, held as
`JobSpec.engine`) and the rows' sampling defaults (`SamplingParams`, held as
`JobSpec.sampling`): each option is declared once, in its own class, with its help."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.options import FIELDS as ENGINE_FIELDS
from fusegen.engine.options import NAMES as ENGINE_OPTIONS
from fusegen.engine.options import OUTPUT_NAMES, EngineOptions
from fusegen.engine.sampling_params import FIELDS as SAMPLING_PARAMS_FIELDS
from fusegen.engine.sampling_params import NAMES as SAMPLING_FIELDS
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.weights.gguf_names import is_gguf
from fusegen.jobs.errors import JobError
from fusegen.jobs.params import RESPONSE_FORMAT, ParamError, check_declared, coerce
from fusegen.jobs.redact import Redactor, public_options, redact_url

PROGRESS_MODES = ("auto", "bar", "log", "none")
OUTPUT_FORMATS = ("parquet", "jsonl")
# Columns a generation part adds to the input's (`jobs/parts.py`); `logprobs`,
# `prompt_logprobs` and `structured_valid` only when the job can produce them. A per-row
# `logprobs` / `prompt_logprobs` parameter column is replaced by the list column.
OUTPUT_COLUMNS = ("generated_text", "finish_reason", "num_prompt_tokens",
                  "num_generated_tokens", "error", "generated_token_ids", "completion_index",
                  "error_code", "logprobs", "prompt_logprobs", "structured_valid")
ROW_ID_COLUMN = "row_id"  # added when --id-column is not given (`jobs/rows.py`)
MESSAGES_COLUMN = "messages"

# Where a job's engine defaults differ from the engine's: jobs run batch-invariant, so a
# resumed job equals an uninterrupted one byte for byte (what that costs depends on the
# CPU and the weights' form: docs/performance.md).
ENGINE_DEFAULTS = {"deterministic": True}
# The engine options a job takes: all but the engine-wide seed, which goes unused (each
# row samples with its own seed, derived from the job's `seed`: `jobs/rows.py`).
JOB_ENGINE_OPTIONS = tuple(n for n in ENGINE_OPTIONS if n != "seed")


def _output(default=dataclasses.MISSING):
    """A field of the job's own that can change what it generates: part of its identity
    (`OUTPUT_FIELDS`), as EngineOptions' `affects_output` and every sampling field."""
    return field(default=default, metadata={"affects_output": True})


@dataclass(slots=True, init=False)
class JobSpec:
    """Every job option: the job's own fields below, the engine's settings (`engine`, an
    `EngineOptions`: dtype, device, batch limits, memory pool) and the rows' sampling
    defaults (`sampling`, a `SamplingParams` with a job's defaults). Each is listed once,
    with its help, in its own class. Built from the flat keys that the job file and the
    flags give: `JobSpec(model=..., input=..., output=..., max_tokens=8, dtype="float32")`
    (`FIELD_NAMES`); `engine=` / `sampling=` start from those objects instead."""
    model: str = _output()  # local checkpoint path, or a hub id (org/name)
    input: str  # Parquet file, directory or glob at any fsspec URL
    output: str  # directory URL for the output parts and _manifest.json
    # prompts
    prompt_column: str = _output("prompt")
    id_column: str | None = _output(None)  # names rows in error messages; must exist when set
    prompt_template: str | None = _output(None)  # Jinja over the row's columns
    chat: bool = _output(False)  # chat template over `messages`, or the prompt as one user turn
    # A column of message lists (list<struct<role, content>>, or JSON text) rendered by
    # the chat template; replaces prompt_column and prompt_template.
    messages_column: str | None = _output(None)
    # OpenAI's response_format (an object or its JSON text): its schema becomes the rows'
    # json_schema; the other sampling defaults are `sampling`'s.
    response_format: dict | str | None = _output(None)
    chat_template: str | None = _output(None)  # Jinja text or a file holding it
    system_prompt: str | None = _output(None)  # a system turn first; implies chat
    # The per-row parameter columns, exactly; None: every column named like a parameter
    # that the prompt is not made of (`jobs/params.py`).
    param_columns: list[str] | None = _output(None)
    output_token_ids: bool = _output(False)  # add a generated_token_ids list column
    output_format: str = _output("parquet")  # parquet or jsonl parts
    report: bool = False  # write _report.html, an HTML job summary, beside the manifest
    # execution
    scheduler: str | None = None  # address of an existing Dask scheduler
    workers: int = 1  # local cluster only: >1 starts that many worker processes
    partitions_per_worker: int = 4  # partitions in flight per worker, all feeding one engine
    partition_rows: int = _output(1000)  # rows per partition and per output part
    overwrite: bool = False
    storage_options: dict = field(default_factory=dict, repr=False)  # fsspec; may hold secrets
    progress: str = "auto"  # auto: a bar on a terminal, log lines otherwise
    # Error rows over committed rows (earlier runs' parts included) past which the job
    # stops, failed and resumable; judged each time a part commits, so from the first.
    max_error_rate: float = 0.5
    engine: EngineOptions = field(default=None)  # the job's engine settings
    sampling: SamplingParams = field(default=None)  # the rows' defaults; a column overrides

    def __init__(self, *, engine: EngineOptions | None = None,
                 sampling: SamplingParams | None = None, **values):
        unknown = [k for k in values if k not in FIELD_NAMES]
        if unknown:
            raise TypeError(f"JobSpec got an unexpected keyword argument {unknown[0]!r}")
        for name in _OWN_FIELDS:
            setattr(self, name, values[name] if name in values else job_default(name))
        engine_values = {**(_fields_of(engine) if engine else ENGINE_DEFAULTS),
                         **{k: v for k, v in values.items() if k in JOB_ENGINE_OPTIONS}}
        sampling_values = {**(_fields_of(sampling) if sampling else _sampling_defaults()),
                           **{k: v for k, v in values.items() if k in SAMPLING_FIELDS}}
        self._check(engine_values, sampling_values)

    def _check(self, engine_values: dict, sampling_values: dict) -> None:
        for name in ("model", "input", "output"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise JobError(f"{name} is required: pass --{name} or set `{name}:` in the job file")
        # One spelling per model, so resume sees the same job; a hub id stays a name.
        if "://" not in self.model and not _hub_name(self.model):
            self.model = os.path.abspath(os.path.expanduser(self.model))
        _check_int(self, "partition_rows", 1)
        _check_int(self, "workers", 1)
        _check_int(self, "partitions_per_worker", 1)
        self._check_error_rate()
        try:
            self.engine = EngineOptions(**engine_values)
        except EngineConfigError as exc:
            raise JobError(str(exc)) from None
        if self.progress not in PROGRESS_MODES:
            raise JobError(f"progress must be one of {', '.join(PROGRESS_MODES)}, "
                           f"got {self.progress!r}")
        if not isinstance(self.storage_options, dict):
            raise JobError("storage_options must be a mapping of fsspec options")
        if self.prompt_column in OUTPUT_COLUMNS or self.prompt_column == "":
            raise JobError(f"prompt_column {self.prompt_column!r} is an output column name; "
                           "rename the input column")
        self._check_messages_column()
        self._read_options(sampling_values)
        self.sampling = SamplingParams(**sampling_values)
        if self.output_format not in OUTPUT_FORMATS:
            raise JobError(f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, "
                           f"got {self.output_format!r}")
        if self.system_prompt is not None and not self.messages_column:
            self.chat = True
        problem = self.sampling_params().validate()
        if problem:
            raise JobError(f"job sampling default: {problem}")

    def _check_error_rate(self) -> None:
        rate = self.max_error_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) \
                or not 0.0 <= rate <= 1.0:  # NaN fails both comparisons
            raise JobError(f"max_error_rate must be a fraction of rows in [0, 1] (0: stop at "
                           f"the first error, 1: never stop), got {rate!r}")
        self.max_error_rate = float(rate)

    def _check_messages_column(self) -> None:
        column = self.messages_column
        if column is None:
            return
        if not isinstance(column, str) or not column or column in OUTPUT_COLUMNS:
            raise JobError(f"messages_column must name an input column (not an output "
                           f"column); got {column!r}")
        given = [name for name, value in (("prompt_column", self.prompt_column != "prompt"),
                                          ("prompt_template", self.prompt_template)) if value]
        if given:
            raise JobError(f"messages_column and {given[0]} are both set; a row's prompt "
                           "comes from one of them: drop one")

    def _read_options(self, sampling: dict) -> None:
        """JSON text (flags) and files (json_schema, chat_template) as their values;
        `sampling`: the sampling defaults' values, read in place."""
        schema = sampling["json_schema"]
        if isinstance(schema, str) and not schema.lstrip().startswith("{"):
            sampling["json_schema"] = _read_file("json_schema", schema)
        for name in ("stop_token_ids", "logit_bias", "bad_words", "choice", "json_schema"):
            value = sampling[name]
            if value is not None and value != []:
                value = list(value) if isinstance(value, tuple) else value
                sampling[name] = _coerced(name, value)
        if isinstance(self.response_format, str):
            try:
                self.response_format = json.loads(self.response_format)
            except ValueError as exc:
                raise JobError(f"response_format is not JSON ({exc})") from None
        if self.param_columns is not None:
            self.param_columns = [c for c in ([self.param_columns] if isinstance(
                self.param_columns, str) else self.param_columns) for c in c.split(",") if c]
            try:
                check_declared(self.param_columns)
            except ParamError as exc:
                raise JobError(str(exc)) from None
        template = self.chat_template
        if isinstance(template, str) and "{" not in template:
            self.chat_template = _read_file("chat_template", template, as_json=False)

    def sampling_params(self) -> SamplingParams:
        """The rows' sampling defaults (a copy): `sampling`, with response_format's
        schema as its json_schema."""
        if self.response_format is None:
            return dataclasses.replace(self.sampling)
        if self.sampling.json_schema is not None:
            raise JobError("json_schema and response_format are both set; the schema "
                           "comes from one of them: drop one")
        return dataclasses.replace(self.sampling, json_schema=_coerced(
            RESPONSE_FORMAT, self.response_format))

    def engine_kwargs(self) -> dict:
        """The engine's options, for `LLM(model, **...)` (the seed is the rows' own). A
        job's unset quantization is "dequantize" for a GGUF file, the form its outputs
        were made in before the engine's None kept the file's blocks: the same fingerprint
        (unset, it is left out) makes the same tokens."""
        kwargs = {name: getattr(self.engine, name) for name in JOB_ENGINE_OPTIONS}
        if kwargs["quantization"] is None and is_gguf(self.model):
            kwargs["quantization"] = "dequantize"
        return kwargs

    def values(self) -> dict:
        """Every option by its flat key (`FIELD_NAMES`), as the job file names them."""
        return {**{name: getattr(self, name) for name in _OWN_FIELDS},
                **{name: getattr(self.engine, name) for name in JOB_ENGINE_OPTIONS},
                **{name: getattr(self.sampling, name) for name in SAMPLING_FIELDS}}

    def output_config(self) -> dict:
        """The fields an output depends on: a rerun with a different value is a new job.
        Those outputs were first written with (`FIRST_OUTPUT_FIELDS`) are always there;
        any other appears only when set away from its default, so adding an option never
        moves an existing output's fingerprint: it still resumes."""
        values = self.values()
        return {name: values[name] for name in OUTPUT_FIELDS
                if name in FIRST_OUTPUT_FIELDS or values[name] != job_default(name)}

    def fingerprint(self, inputs: list, identity=None) -> str:
        """Hash of the output config, the planned inputs (paths, row counts, content) and
        the job's `identity()` (the dtype resolved, the model's files)."""
        from fusegen.jobs.output import output_fingerprint

        identity = identity or self.identity()
        return output_fingerprint({**self.output_config(), **identity.fingerprint_fields()},
                                  inputs)

    def identity(self):
        """The dtype this job computes in and its model's files (`jobs/identity.py`),
        resolved here, on the driver, once: its workers get the dtype resolved, so that
        none elsewhere resolves "auto" otherwise. On an external cluster with device auto
        the dtype follows this machine's device and CPU."""
        from fusegen.engine.memory.device import cpu_supports_bf16, default_device, resolve_dtype
        from fusegen.engine.errors import EngineConfigError, ModelLoadError
        from fusegen.jobs.identity import JobIdentity, model_identity

        device = default_device() if self.engine.device == "auto" else self.engine.device
        try:
            dtype, auto = (_dtype_name(resolve_dtype(d, device))
                           for d in (self.engine.dtype, "auto"))
            model = model_identity(self.model, self.engine.revision,
                                   external=bool(self.scheduler),
                                   record_path=redact_url(self.model))
        except (EngineConfigError, ModelLoadError) as exc:
            raise JobError(str(exc)) from None
        except OSError as exc:
            raise JobError(f"model {redact_url(self.model)}: cannot read its files "
                           f"({exc.strerror or exc}); check the path and its permissions"
                           ) from None
        earlier = auto if device.startswith("cuda") or not cpu_supports_bf16() else None
        return JobIdentity(dtype=dtype, option=self.engine.dtype, model=model,
                           earlier_auto=earlier)

    def on_workers(self, identity) -> "JobSpec":
        """The spec the workers run: the dtype as resolved, not "auto"."""
        return dataclasses.replace(self, engine=dataclasses.replace(
            self.engine, dtype=identity.dtype))

    def public_dict(self) -> dict:
        """The spec with credentials masked: for the manifest and logs."""
        d = self.values()
        for name in ("input", "output", "scheduler", "model"):
            if d[name]:
                d[name] = redact_url(d[name])
        d["storage_options"] = public_options(self.storage_options)
        return d

    def redactor(self) -> Redactor:
        return Redactor(self.storage_options, urls=(self.input, self.output, self.scheduler))

    def __repr__(self):
        return f"JobSpec({self.public_dict()!r})"


_OWN_FIELDS = tuple(f.name for f in dataclasses.fields(JobSpec)
                    if f.name not in ("engine", "sampling"))
# Every key of a job file, in the order `fusegen run --help` and the job file's "valid
# keys" list show: the job's own (the sampling defaults after the prompt's), then the
# engine's.
FIELD_NAMES = tuple(dict.fromkeys(
    [*_OWN_FIELDS[:_OWN_FIELDS.index("response_format")], *SAMPLING_FIELDS,
     *_OWN_FIELDS[_OWN_FIELDS.index("response_format"):], *JOB_ENGINE_OPTIONS]))
# The fields an output depends on: the job's own marked OUTPUT, the engine's that
# affect output, every sampling default.
OUTPUT_FIELDS = (*(f.name for f in dataclasses.fields(JobSpec)
                   if f.metadata.get("affects_output")), *OUTPUT_NAMES, *SAMPLING_FIELDS)
_ENGINE_FIELD = {f.name: f for f in ENGINE_FIELDS}
_SAMPLING_FIELD = {f.name: f for f in SAMPLING_PARAMS_FIELDS}
# The output fields when fingerprints were introduced: always in a fingerprint. Frozen:
# any field added since (or later) is in it only when set away from its default, so the
# outputs written before it keep theirs and still resume.
FIRST_OUTPUT_FIELDS = frozenset({
    "model", "prompt_column", "id_column", "prompt_template", "chat", "max_tokens",
    "temperature", "top_p", "top_k", "seed", "stop", "output_token_ids", "dtype",
    "block_size", "max_model_len", "deterministic", "partition_rows"})


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def job_default(name: str):
    """A job-file key's default (`FIELD_NAMES`): the job's where it has its own."""
    if name in SAMPLING_FIELDS:
        return copy.copy(_SAMPLING_FIELD[name].metadata["job_default"])
    if name in JOB_ENGINE_OPTIONS:
        return ENGINE_DEFAULTS.get(name, _ENGINE_FIELD[name].default)
    f = JobSpec.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return "" if f.default_factory is dataclasses.MISSING else f.default_factory()


def _sampling_defaults() -> dict:
    return {name: job_default(name) for name in SAMPLING_FIELDS}


def _fields_of(options) -> dict:
    """A dataclass's values by field name (lists as they are)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}


def _coerced(name: str, value):
    try:
        return coerce(name, value)
    except ParamError as exc:
        raise JobError(f"{name} {exc}") from None


def _read_file(name: str, path: str, as_json: bool = True):
    """An option given as the path of a file: its JSON value (or text)."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise JobError(f"{name}: cannot read {path!r} ({exc.strerror}); pass "
                       + ("the JSON text or the path of a JSON file" if as_json else
                          "a Jinja template or the path of a file holding one")) from None
    if not as_json:
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise JobError(f"{name}: {path} is not JSON ({exc})") from None


def _check_int(spec: JobSpec, name: str, minimum: int):
    value = getattr(spec, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise JobError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _hub_name(model: str) -> bool:
    """A hub id (org/name) that is no local path here: each worker resolves it."""
    from fusegen.engine.weights.hub import looks_like_hub_id

    return looks_like_hub_id(model) and not os.path.exists(os.path.expanduser(model))


def load_job_file(path: str) -> dict:
    """The mapping in a YAML job file, keys normalised (`max-tokens` -> `max_tokens`)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except OSError as exc:
        raise JobError(f"cannot read job file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise JobError(f"job file {path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise JobError(f"job file {path} must be a mapping of option: value")
    data = {str(k).replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(data) - set(FIELD_NAMES))
    if unknown:
        raise JobError(f"job file {path}: unknown key(s) {', '.join(unknown)}; "
                       f"valid keys: {', '.join(FIELD_NAMES)}")
    return data


def build_spec(file_values: dict | None = None, overrides: dict | None = None) -> JobSpec:
    """The spec from a job file's values with command-line overrides (None = not given)."""
    values = dict(file_values or {})
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    for name in ("model", "input", "output"):
        values.setdefault(name, "")
    try:
        return JobSpec(**values)
    except TypeError as exc:  # a key that is not a field
        raise JobError(str(exc)) from None
