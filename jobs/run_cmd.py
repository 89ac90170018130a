"""`fusegen run`: flags and/or a YAML job file -> JobSpec -> run_job."""
from __future__ import annotations

import logging
import shlex
import sys

import click
from click.core import ParameterSource

from fusegen.jobs.errors import EXIT_FAILED, EXIT_ROW_ERRORS, ErrorRateExceeded, JobError
from fusegen.jobs.flags import engine_flags, option, sampling_flags, with_flags
from fusegen.jobs.interrupt import JobInterrupted, signal_of, stop_on_signals
from fusegen.jobs.redact import redact_url
from fusegen.jobs.spec import (FIELD_NAMES, JOB_ENGINE_OPTIONS, build_spec, job_default,
                               load_job_file)

_DEFAULTS = {name: job_default(name) for name in FIELD_NAMES}


def _job_option(flag: str, help: str, **kwargs):
    """A job flag, with the job's default in its --help."""
    name = flag.split("/")[0].lstrip("-").replace("-", "_")
    default = _DEFAULTS.get(name)
    return option(flag, help, "none" if default in (None, [], {}, "") else default, **kwargs)


_OPTIONS = [
    _job_option("--model", "Model directory (Hugging Face format: config.json, *.safetensors, "
            "tokenizer.json), a GGUF file (model.gguf; a split set by its first file), or a "
            "hub id (org/name: from the Hugging Face cache, downloaded "
            "when missing; --revision pins it). Required, here or in the job file."),
    _job_option("--input", "Input Parquet file, directory or glob at any fsspec URL (local, "
            "memory://, s3://...). Required."),
    _job_option("--output", "Output directory URL: parts, then _manifest.json (an OpenAI "
            "batch file's results in output.jsonl and errors.jsonl in it). Required."),
    _job_option("--prompt-column", "Column holding the prompt text."),
    _job_option("--id-column", "Column naming rows in error messages (must exist when given)."),
    _job_option("--prompt-template", "Jinja template over the row's columns, e.g. "
            "'Translate: {{ text }}'; replaces --prompt-column."),
    _job_option("--messages-column", "Column of chat message lists ({role, content} structs, "
            "or that list as JSON text), each row rendered by the model's chat template; "
            "replaces --prompt-column and --prompt-template."),
    _job_option("--chat/--no-chat", "Apply the tokenizer's chat template to a `messages` column "
            "(role/content structs), or to the prompt as one user turn."),
    *sampling_flags(_job_option),  # one per SamplingParams field
    _job_option("--response-format", "OpenAI's response_format as JSON, e.g. "
            "'{\"type\": \"json_object\"}' (type json_schema: its schema; row column "
            "overrides)."),
    _job_option("--chat-template", "Chat template (Jinja text, or a file holding it) used "
            "instead of the model's, for --chat and --messages-column."),
    _job_option("--system-prompt", "A system turn put before each conversation (unless it "
            "starts with its own); implies --chat."),
    _job_option("--param-columns", "The per-row parameter columns, exactly (comma-separated "
            "or repeated). Without it every column named like a parameter is one, unless the "
            "prompt is made of it; columns that look meant as parameters are warned about.",
            multiple=True),
    _job_option("--output-token-ids/--no-output-token-ids", "Add a generated_token_ids column."),
    _job_option("--output-format", "Format of the output parts.",
            type=click.Choice(["parquet", "jsonl"])),
    _job_option("--report/--no-report", "Also write _report.html beside the manifest: a "
            "self-contained HTML job summary (counts, errors, throughput over time)."),
    _job_option("--scheduler", "Address of an existing Dask scheduler (tcp://host:8786) "
            "instead of the embedded local cluster."),
    _job_option("--workers", "Embedded cluster: worker processes (1 = in-process, no sockets; "
            "more listen on 127.0.0.1 only and each loads the model).", type=int),
    _job_option("--partitions-per-worker", "Partitions in flight per worker, all feeding its "
            "one engine (memory: this x --partition-rows rows).", type=int),
    _job_option("--partition-rows", "Rows per partition (and per output part) at most.", type=int),
    _job_option("--overwrite/--no-overwrite", "Discard an existing output (parts and manifest) "
            "and start afresh; without it a rerun resumes."),
    _job_option("--storage-option", "fsspec storage option KEY=VALUE for input and output, "
            "repeatable; dots nest (client_kwargs.endpoint_url=http://...). Secrets are "
            "never logged.", multiple=True),
    _job_option("--max-error-rate", "Stop the job (exit status 1, resumable: committed "
            "parts stay) once error rows pass this fraction of the rows committed, from "
            "the first committed part on; 1 never stops, 0 stops at the first error.",
            type=float),
    _job_option("--progress", "auto: a live bar on a terminal, log lines otherwise.",
            type=click.Choice(["auto", "bar", "log", "none"])),
    # The engine's settings, from their one list (the job's --seed is the rows' own).
    *engine_flags(JOB_ENGINE_OPTIONS, defaults=_DEFAULTS),
    click.option("--dequantize", is_flag=True, default=False,
                 help="Expand every weight to the run's dtype as it loads: --quantization "
                 "dequantize (a job's default for GGUF files; a fusegen int8/int4 checkpoint "
                 "otherwise runs compressed)."),
]


@click.command()
@click.argument("job_file", required=False, type=click.Path(dir_okay=False))
@with_flags(_OPTIONS)
def run(job_file, storage_option, **flags):
    """Generate text for every row of a Parquet prompt dataset; write Parquet parts.

    JOB_FILE is an optional YAML file with the same keys as the flags (max_tokens: 32,
    storage_options: {...}); flags given on the command line override it. Rerunning the
    same job resumes: committed parts are kept. Ctrl-C or SIGTERM stops it cleanly and
    prints the command that resumes it.

    \b
    Exit status:
      0  every row generated
      1  the job failed: a bad option or input (checked before the model loads), an
         error mid-run, or error rows past --max-error-rate (resumable)
      2  a usage error (an unknown flag, a bad flag value)
      3  the job finished, but some rows are errors (their `error` column says why)
      128+N  stopped by signal N (130: Ctrl-C, 143: SIGTERM); resumable
    """
    spec = None
    try:
        with stop_on_signals():
            file_values = load_job_file(job_file) if job_file else {}
            for name, value in flags.items():  # a repeatable flag not given: the file's value
                if isinstance(value, tuple):
                    flags[name] = list(value) or None
            if storage_option:
                options = dict(file_values.get("storage_options") or {})
                for item in storage_option:
                    _set_job_option(options, item)
                flags["storage_options"] = options
            _dequantize_flag(flags)
            spec = build_spec(file_values, flags)
            _check_output_is_a_directory(spec)
            setup_logging()
            from fusegen.jobs import driver

            # A failed run's manifest names the command that resumes it (masked there).
            command = resume_command(click.get_current_context(), job_file,
                                     bool(file_values.get("overwrite")))
            result = driver.run_job(spec, resume=command)
    except ErrorRateExceeded as exc:
        click.echo(f"Error: {exc}", err=True)
        _echo_resume(spec, job_file, file_values.get("overwrite"))
        sys.exit(EXIT_FAILED)
    except JobError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt as exc:
        _stopped(exc, spec, job_file, file_values.get("overwrite") if spec else None)
    click.echo(result.summary())
    if result.num_errors:
        click.echo(f"finished with {result.num_errors} error rows of {result.num_rows} "
                   f"(exit status {EXIT_ROW_ERRORS}); their `error` column says why", err=True)
        sys.exit(EXIT_ROW_ERRORS)


def _check_output_is_a_directory(spec) -> None:
    """A job writes a directory at --output (its parts and _manifest.json, which a rerun
    resumes from): an output named like a JSONL file that is not already a job's
    directory would silently be one. JobError saying where the results go instead."""
    if not spec.output.rstrip("/").endswith(".jsonl"):
        return
    from fusegen.jobs.storage import filesystem

    fs, path = filesystem(spec.output, spec.storage_options)
    if fs.isdir(path):  # an output written before: it resumes as it is
        return
    url = redact_url(spec.output.rstrip("/"))
    stem = url.removesuffix(".jsonl")
    raise JobError(f"--output {url} names a file, but a job's output is a directory: its "
                   "parts and _manifest.json, from which a rerun resumes, and for an OpenAI "
                   "batch file output.jsonl and errors.jsonl; pass a directory, --output "
                   f"{stem}, and read {stem}/output.jsonl")


def _dequantize_flag(flags: dict) -> None:
    """--dequantize is --quantization dequantize; with another --quantization, an error."""
    if not flags.pop("dequantize", False):
        return
    if flags.get("quantization") not in (None, "dequantize"):
        raise JobError(f"--dequantize and --quantization {flags['quantization']} both given; "
                       "pass one")
    flags["quantization"] = "dequantize"


def _stopped(exc: KeyboardInterrupt, spec, job_file, file_overwrite) -> None:
    """What is committed and the command that resumes; exit 128 + the signal."""
    if not isinstance(exc, JobInterrupted):  # before the job started
        exc = JobInterrupted(signal_of(exc), redact_url(spec.output) if spec else "the output")
    click.echo(exc.message, err=True)
    _echo_resume(spec, job_file, file_overwrite)
    sys.exit(exc.exit_code)


def _echo_resume(spec, job_file, file_overwrite) -> None:
    """The command that resumes this job, its secrets masked."""
    ctx = click.get_current_context()
    command = resume_command(ctx, job_file, bool(file_overwrite))
    # Without a spec its secrets are unknown: every storage option value is masked.
    masked = spec.redactor()(command) if spec else \
        resume_command(ctx, job_file, bool(file_overwrite), mask_options=True)
    note = "   (put back the masked secrets)" if masked != command else ""
    click.echo(f"resume with: {masked}{note}", err=True)


def resume_command(ctx: click.Context, job_file: str | None, file_overwrite: bool,
                   mask_options: bool = False) -> str:
    """This command as given, less --overwrite (which would discard what is committed):
    the flags from the command line in their order, values as click parsed them."""
    words = ["fusegen", ctx.info_name or "run"] + ([job_file] if job_file else [])
    by_name = {p.name: p for p in ctx.command.params}
    for name, value in ctx.params.items():
        param = by_name[name]
        if name == "overwrite" or not isinstance(param, click.Option) or \
                ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        flag = param.opts[0]
        if param.is_flag:
            words.append(flag if value else param.secondary_opts[0])
        else:
            for item in value if param.multiple else [value]:
                if mask_options and name == "storage_option":
                    item = item.partition("=")[0] + "=***"
                words += [flag, str(item)]
    if file_overwrite:
        words.append("--no-overwrite")
    return shlex.join(words)


def _set_job_option(options: dict, item: str) -> None:
    import yaml

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise JobError(f"--storage-option expects KEY=VALUE, got {item.split('=')[0]!r}=...")
    *parents, leaf = key.split(".")
    for p in parents:
        options = options.setdefault(p, {})
    options[leaf] = yaml.safe_load(value) if value else value


def setup_logging() -> None:
    logger = logging.getLogger("fusegen")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
