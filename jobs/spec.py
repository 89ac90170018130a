"""The job spec: one validated dataclass that the CLI flags and the job file both build."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.options import NAMES as ENGINE_OPTIONS
from fusegen.engine.options import OUTPUT_NAMES, EngineOptions
from fusegen.engine.sampling_params import SamplingParams
from fusegen.engine.weights.gguf_names import is_gguf
from fusegen.jobs.errors import JobError
from fusegen.jobs.params import (ENGINE_SAMPLING_FIELDS, RESPONSE_FORMAT, SAMPLING_FIELDS,
                                 ParamError, check_declared, coerce)
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


@dataclass(slots=True, kw_only=True)
class JobSpec(EngineOptions):
    """Every job option. The engine's settings (dtype, device, batch limits, memory pool)
    are inherited from `EngineOptions`, listed there once with their help; the fields
    below are the job's own."""
    model: str  # local checkpoint path, or a hub id (org/name) resolved on each worker
    input: str  # Parquet file, directory or glob at any fsspec URL
    output: str  # directory URL for the output parts and _manifest.json
    # prompts
    prompt_column: str = "prompt"
    id_column: str | None = None  # names rows in error messages; must exist when set
    prompt_template: str | None = None  # Jinja over the row's columns; replaces prompt_column
    chat: bool = False  # chat template over `messages`, or the prompt as one user turn
    # A column of message lists (list<struct<role, content>>, or JSON text) rendered by
    # the chat template; replaces prompt_column and prompt_template.
    messages_column: str | None = None
    # sampling defaults; a row column of the same name overrides them for that row
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Base seed: row i samples with a seed derived from (seed, i). Replaces the engine's
    # seed field (every row has its own seed, so the engine's generator goes unused).
    seed: int | None = 0
    stop: list[str] = field(default_factory=list)
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # completions per row: each is an output row (completion_index 0..n-1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict | None = None  # token id -> bias (or its JSON text)
    bad_words: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top-k per generated token -> a `logprobs` list column
    prompt_logprobs: int | None = None  # top-k per prompt token -> `prompt_logprobs`
    # structured output, at most one: a JSON Schema (an object, its JSON text or a file
    # holding it), OpenAI's response_format (turned into json_schema), a regex, a list of
    # choices, a Lark / GBNF grammar
    json_schema: dict | str | None = None
    response_format: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    chat_template: str | None = None  # Jinja text or a file holding it; the model's otherwise
    system_prompt: str | None = None  # a system turn before each conversation; implies chat
    # The per-row parameter columns, exactly; None: every column named like a parameter
    # that the prompt is not made of (`jobs/params.py`).
    param_columns: list[str] | None = None
    output_token_ids: bool = False  # add a generated_token_ids list column
    output_format: str = "parquet"  # parquet or jsonl parts
    report: bool = False  # write _report.html, an HTML job summary, beside the manifest
    # Jobs default to the batch-invariant engine, so a resumed job equals an uninterrupted
    # one byte for byte (it costs ~13% of throughput: docs/performance.md).
    deterministic: bool = True
    # execution
    scheduler: str | None = None  # address of an existing Dask scheduler
    workers: int = 1  # local cluster only: >1 starts that many worker processes
    partitions_per_worker: int = 4  # partitions in flight per worker, all feeding one engine
    partition_rows: int = 1000
    overwrite: bool = False
    storage_options: dict = field(default_factory=dict, repr=False)  # fsspec; may hold secrets
    progress: str = "auto"  # auto: a bar on a terminal, log lines otherwise

    def __post_init__(self):
        for name in ("model", "input", "output"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise JobError(f"{name} is required: pass --{name} or set `{name}:` in the job file")
        # One spelling per model, so resume sees the same job; a hub id stays a name.
        if "://" not in self.model and not _hub_name(self.model):
            self.model = os.path.abspath(os.path.expanduser(self.model))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        _check_int(self, "partition_rows", 1)
        _check_int(self, "workers", 1)
        _check_int(self, "partitions_per_worker", 1)
        try:
            EngineOptions.__post_init__(self)
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
        self._read_options()
        if self.output_format not in OUTPUT_FORMATS:
            raise JobError(f"output_format must be one of {', '.join(OUTPUT_FORMATS)}, "
                           f"got {self.output_format!r}")
        if self.system_prompt is not None and not self.messages_column:
            self.chat = True
        problem = self.sampling_params().validate()
        if problem:
            raise JobError(f"job sampling default: {problem}")

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

    def _check_seed(self) -> None:
        pass  # the rows' base seed: checked with the sampling defaults below

    def _read_options(self) -> None:
        """JSON text (flags) and files (json_schema, chat_template) as their values."""
        if isinstance(self.json_schema, str) and not self.json_schema.lstrip().startswith("{"):
            self.json_schema = _read_file("json_schema", self.json_schema)
        for name in ("stop_token_ids", "logit_bias", "bad_words", "choice", "json_schema"):
            value = getattr(self, name)
            if value is not None and value != []:
                value = list(value) if isinstance(value, tuple) else value
                setattr(self, name, _coerced(name, value))
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
        """The job's sampling defaults; a field this engine lacks must keep its default."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        values["stop"] = list(self.stop)
        if self.response_format is not None:
            if self.json_schema is not None:
                raise JobError("json_schema and response_format are both set; the schema "
                               "comes from one of them: drop one")
            values["json_schema"] = _coerced(RESPONSE_FORMAT, self.response_format)
        for name in SAMPLING_FIELDS:
            if name not in ENGINE_SAMPLING_FIELDS:
                if values.pop(name) != _default(name):
                    raise JobError(f"{name} is not a sampling parameter of this fusegen's "
                                   "engine; drop it")
        return SamplingParams(**values)

    def engine_kwargs(self) -> dict:
        """The engine's options, for `LLM(model, **...)` (the seed is the rows' own). A
        job's unset quantization is "dequantize" for a GGUF file, the form its outputs
        were made in before the engine's None kept the file's blocks: the same fingerprint
        (unset, it is left out) makes the same tokens."""
        kwargs = {name: getattr(self, name) for name in ENGINE_OPTIONS if name != "seed"}
        if kwargs["quantization"] is None and is_gguf(self.model):
            kwargs["quantization"] = "dequantize"
        return kwargs

    def output_config(self) -> dict:
        """The fields an output depends on: a rerun with a different value is a new job.
        Fields added since outputs were first written appear only when set, so those
        outputs keep their fingerprint and still resume."""
        return {name: getattr(self, name) for name in _OUTPUT_FIELDS
                if name not in _LATER_FIELDS or getattr(self, name) != _default(name)}

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
        from fusegen.engine.config import cpu_supports_bf16, default_device, resolve_dtype
        from fusegen.engine.errors import EngineConfigError, ModelLoadError
        from fusegen.jobs.identity import JobIdentity, model_identity

        device = default_device() if self.device == "auto" else self.device
        try:
            dtype, auto = (_dtype_name(resolve_dtype(d, device)) for d in (self.dtype, "auto"))
            model = model_identity(self.model, self.revision, external=bool(self.scheduler),
                                   record_path=redact_url(self.model))
        except (EngineConfigError, ModelLoadError) as exc:
            raise JobError(str(exc)) from None
        except OSError as exc:
            raise JobError(f"model {redact_url(self.model)}: cannot read its files "
                           f"({exc.strerror or exc}); check the path and its permissions"
                           ) from None
        earlier = auto if device.startswith("cuda") or not cpu_supports_bf16() else None
        return JobIdentity(dtype=dtype, option=self.dtype, model=model, earlier_auto=earlier)

    def on_workers(self, identity) -> "JobSpec":
        """The spec the workers run: the dtype as resolved, not "auto"."""
        return dataclasses.replace(self, dtype=identity.dtype)

    def public_dict(self) -> dict:
        """The spec with credentials masked: for the manifest and logs."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("input", "output", "scheduler", "model"):
            if d[name]:
                d[name] = redact_url(d[name])
        d["storage_options"] = public_options(self.storage_options)
        return d

    def redactor(self) -> Redactor:
        return Redactor(self.storage_options, urls=(self.input, self.output, self.scheduler))

    def __repr__(self):
        return f"JobSpec({self.public_dict()!r})"


_NEW_SAMPLING_FIELDS = tuple(n for n in SAMPLING_FIELDS if n not in (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"))
_OUTPUT_FIELDS = ("model", "prompt_column", "id_column", "prompt_template", "chat",
                  "messages_column",
                  "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                  "output_token_ids", *OUTPUT_NAMES, "partition_rows", *_NEW_SAMPLING_FIELDS,
                  RESPONSE_FORMAT, "chat_template", "system_prompt", "param_columns",
                  "output_format")
# Fields added since outputs were first written: in the fingerprint only when not at
# their default, so those outputs keep theirs.
_LATER_FIELDS = ("messages_column", "revision", *_NEW_SAMPLING_FIELDS, RESPONSE_FORMAT,
                 "chat_template", "system_prompt", "param_columns", "output_format",
                 "tokenizer", "tensor_parallel_size", "quantization")
# The job's own keys first, then the engine's: the order `fusegen run --help` and the
# job file's "valid keys" list show.
FIELD_NAMES = tuple(dict.fromkeys(
    [f.name for f in dataclasses.fields(JobSpec) if f.name not in ENGINE_OPTIONS]
    + list(ENGINE_OPTIONS)))


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _default(name: str):
    f = JobSpec.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


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
