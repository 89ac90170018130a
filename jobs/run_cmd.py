"""`fusegen run`: flags and/or a YAML job file -> JobSpec -> run_job."""
from __future__ import annotations

import dataclasses
import logging
import sys

import click

from fusegen.jobs.errors import JobError
from fusegen.jobs.spec import JobSpec, build_spec, load_job_file

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(JobSpec)
             if f.default is not dataclasses.MISSING}


def _option(flag: str, help: str, **kwargs):
    """A flag whose default is None (so a job file's value survives unless the flag is
    given); --help still shows the JobSpec default."""
    name = flag.split("/")[0].lstrip("-").replace("-", "_")
    if "[default:" not in help:
        default = _DEFAULTS.get(name)
        help += f"  [default: {'none' if default in (None, []) else default}]"
    return click.option(flag, name, default=None, help=help, **kwargs)


_OPTIONS = [
    _option("--model", "Model directory (Hugging Face format: config.json, *.safetensors, "
            "tokenizer.json). Required, here or in the job file."),
    _option("--input", "Input Parquet file, directory or glob at any fsspec URL (local, "
            "memory://, s3://...). Required."),
    _option("--output", "Output directory URL: parts, then _manifest.json. Required."),
    _option("--prompt-column", "Column holding the prompt text."),
    _option("--id-column", "Column naming rows in error messages (must exist when given)."),
    _option("--prompt-template", "Jinja template over the row's columns, e.g. "
            "'Translate: {{ text }}'; replaces --prompt-column."),
    _option("--chat/--no-chat", "Apply the tokenizer's chat template to a `messages` column "
            "(role/content structs), or to the prompt as one user turn."),
    _option("--max-tokens", "Generated tokens per row at most (row column `max_tokens` "
            "overrides).", type=int),
    _option("--temperature", "Sampling temperature, 0 for greedy (row column overrides).",
            type=float),
    _option("--top-p", "Nucleus sampling mass (row column overrides).", type=float),
    _option("--top-k", "Keep the k most likely tokens, -1 for all (row column overrides).",
            type=int),
    _option("--seed", "Base seed: row i samples with a seed derived from it and i, so "
            "output does not depend on batching, partitioning or resume (row column "
            "`seed` overrides).", type=int),
    _option("--stop", "Stop string; repeat for several (row column `stop` overrides).",
            multiple=True),
    _option("--output-token-ids/--no-output-token-ids", "Add a generated_token_ids column."),
    _option("--dtype", "Weights dtype: auto, float32, bfloat16, float16."),
    _option("--device", "Engine device: auto, cpu, cuda, cuda:N."),
    _option("--max-num-seqs", "Engine: running requests per step at most.  "
            "[default: engine's]", type=int),
    _option("--max-num-batched-tokens", "Engine: tokens per step at most.  "
            "[default: engine's]", type=int),
    _option("--block-size", "Engine: tokens per KV cache block.", type=int),
    _option("--kv-cache-memory", "Engine: bytes (or a size like 16GiB) for the KV cache; "
            "with --device-memory, the KV share kept before layers are placed.  [default: "
            "from free memory; a quarter of the room under --device-memory]"),
    _option("--device-memory", "Memory pool: device budget (bytes, a size like 24GiB, or a "
            "fraction of free memory); layers that do not fit stream from host or disk.  "
            "[default: no limit]"),
    _option("--host-memory", "Memory pool: pinned host budget for streamed layers and "
            "swapped KV blocks (same forms).  [default: half of free host memory when "
            "--device-memory is set]"),
    _option("--prefetch-depth", "Memory pool: streamed layers copied ahead of compute.",
            type=int),
    _option("--max-model-len", "Engine: context length limit; longer prompts become error "
            "rows.  [default: the model's]", type=int),
    _option("--allow-pickle/--no-allow-pickle", "Allow pickle checkpoints (*.bin, *.pt): "
            "they can run arbitrary code."),
    _option("--scheduler", "Address of an existing Dask scheduler (tcp://host:8786) "
            "instead of the embedded local cluster."),
    _option("--workers", "Embedded cluster: worker processes (1 = in-process, no sockets; "
            "more listen on 127.0.0.1 only and each loads the model).", type=int),
    _option("--partitions-per-worker", "Partitions in flight per worker, all feeding its "
            "one engine (memory: this x --partition-rows rows).", type=int),
    _option("--partition-rows", "Rows per partition (and per output part) at most.", type=int),
    _option("--overwrite/--no-overwrite", "Discard an existing output (parts and manifest) "
            "and start afresh; without it a rerun resumes."),
    _option("--storage-option", "fsspec storage option KEY=VALUE for input and output, "
            "repeatable; dots nest (client_kwargs.endpoint_url=http://...). Secrets are "
            "never logged.", multiple=True),
    _option("--progress", "auto: a live bar on a terminal, log lines otherwise.",
            type=click.Choice(["auto", "bar", "log", "none"])),
]


def _with_options(fn):
    for opt in reversed(_OPTIONS):
        fn = opt(fn)
    return fn


@click.command()
@click.argument("job_file", required=False, type=click.Path(dir_okay=False))
@_with_options
def run(job_file, storage_option, stop, **flags):
    """Generate text for every row of a Parquet prompt dataset; write Parquet parts.

    JOB_FILE is an optional YAML file with the same keys as the flags (max_tokens: 32,
    storage_options: {...}); flags given on the command line override it. Rerunning the
    same job resumes: committed parts are kept.
    """
    try:
        file_values = load_job_file(job_file) if job_file else {}
        if stop:
            flags["stop"] = list(stop)
        if storage_option:
            options = dict(file_values.get("storage_options") or {})
            for item in storage_option:
                _set_option(options, item)
            flags["storage_options"] = options
        spec = build_spec(file_values, flags)
        setup_logging()
        from fusegen.jobs.runner import run_job

        result = run_job(spec)
    except JobError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(result.summary())


def _set_option(options: dict, item: str) -> None:
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
