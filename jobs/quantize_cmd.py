"""`fusegen quantize`: a checkpoint (or GGUF file) written as fusegen's group-quantized
int8 / int4 checkpoint (docs/quantization.md). The calibration prompts of method awq
are read here (Parquet, JSON lines or plain text); the engine does the rest
(engine/weights/quantize.py)."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import click

_FORMATS = (".parquet", ".jsonl", ".txt")


def calibration_options(method: str):
    """--calibration, --calibration-column and --calibration-rows, declared once for each
    command whose --method `method` reads calibration prompts (see calibration_prompts)."""
    options = [
        click.option("--calibration", type=click.Path(path_type=Path),
                     help=f"Calibration prompts for --method {method}: a .parquet or .jsonl "
                     "file (the --calibration-column) or a .txt file (one prompt a line)."),
        click.option("--calibration-column", default="prompt", show_default=True,
                     help="The column (or JSON key) holding the calibration prompts."),
        click.option("--calibration-rows", type=click.IntRange(min=1), default=64,
                     show_default=True, help="Calibration prompts read at most (the first "
                     "ones; each cut to 512 tokens).")]

    def apply(command):
        for option in reversed(options):  # as if stacked in this order above the command
            command = option(command)
        return command
    return apply


def output_options(command):
    """--output (written under a temporary name, then renamed) and --overwrite."""
    command = click.option("--overwrite/--no-overwrite", default=False,
                           help="Replace an existing --output checkpoint directory (one holding "
                           "a config.json) or an empty folder; any other folder is refused.")(command)
    return click.option("--output", required=True, type=click.Path(path_type=Path),
                        help="Directory to write (made under a temporary name, renamed when "
                        "complete).")(command)


@contextmanager
def stopped_by_signals(output: Path):
    """The body of a checkpoint-writing command: SIGTERM, as Ctrl-C, unwinds the writer
    (it removes its staging directory); either ends the command with exit 128 + the
    signal's number (130, 143), saying whether `output` was left as it was."""
    from fusegen.jobs.interrupt import signal_of, stop_on_signals

    try:
        with stop_on_signals():
            yield
    except KeyboardInterrupt as exc:
        signum = signal_of(exc)
        click.echo(f"interrupted by {signal.Signals(signum).name}; {output} "
                   f"{'left as it was' if output.exists() else 'not written'}", err=True)
        _exit(128 + signum)


def _exit(status: int) -> None:
    """sys.exit, or os._exit where an engine's thread is still loading the calibration
    model it was told to drop (interrupted while the engine was built, its thread is a
    daemon that ends once the build does): the interpreter's exit would stop that thread
    inside torch's native code, which aborts the process ("terminate called without an
    active exception", status 134). Everything to keep is done by then: the writer's
    staging removed as the interrupt unwound, the message written (flushed here)."""
    if any(t.name == "fusegen-engine" and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def calibration_prompts(method: str, calibrated: str, calibration: Path | None,
                        column: str, max_rows: int) -> list[str] | None:
    """The prompts of `calibration` (read_prompts) where --method is `calibrated`, which
    needs them; None for another method, which refuses a --calibration file."""
    if method == calibrated and calibration is None:
        raise _bad(f"--method {calibrated} needs calibration prompts: pass --calibration "
                   "FILE (.parquet, .jsonl or .txt)")
    if method != calibrated and calibration is not None:
        raise _bad(f"--calibration is used only by --method {calibrated}")
    return None if calibration is None else read_prompts(calibration, column, max_rows)


@click.command()
@click.option("--model", "model", required=True,
              help="Source: a checkpoint directory (config.json, *.safetensors, tokenizer) "
              "of any architecture fusegen runs, or a .gguf file (dequantized first).")
@click.option("--bits", type=click.Choice(["8", "4"]), required=True,
              help="Code width: int8 or int4.")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="128",
              show_default=True, help="Input channels sharing one scale (and zero point).")
@click.option("--symmetric/--asymmetric", default=False, show_default=True,
              help="Symmetric groups store no zero points.")
@click.option("--method", type=click.Choice(["rtn", "awq"]), default="rtn", show_default=True,
              help="rtn: round to nearest; awq: activation-aware scales searched on "
              "--calibration prompts, folded into the norms before quantizing.")
@calibration_options("awq")
@output_options
def quantize(model, bits, group_size, symmetric, method, calibration, calibration_column,
             calibration_rows, output, overwrite):
    """Write a group-quantized int8 / int4 copy of a checkpoint: every decoder-layer
    linear as codes and scales, everything else as the source holds it."""
    from fusegen.engine.weights.quantize import QuantizeError, QuantizeSpec, quantize_checkpoint

    try:
        spec = QuantizeSpec(int(bits), int(group_size), symmetric, method)
        prompts = calibration_prompts(method, "awq", calibration, calibration_column,
                                      calibration_rows)
        with stopped_by_signals(output):
            report = quantize_checkpoint(model, output, spec, prompts=prompts,
                                         overwrite=overwrite)
    except QuantizeError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'--{exc.option}'") from None
    for (layer, group), (alpha, error, rtn) in sorted(report.searches.items()):
        click.echo(f"awq layer {layer} {group}: alpha {alpha:.2f}, output error "
                   f"{error:.4g} (round-to-nearest {rtn:.4g})")
    for layer, group in report.round_to_nearest:
        click.echo(f"awq layer {layer} {group}: no calibration rows routed to this expert, "
                   "round-to-nearest")
    click.echo(f"quantized {report.num_quantized} tensors to int{bits} (group {group_size}, "
               f"{'symmetric' if symmetric else 'asymmetric'}, {method}); copied "
               f"{report.num_copied}; weights {_size(report.bytes_before)} -> "
               f"{_size(report.bytes_after)} in {report.num_files} file(s); wrote {output}")


def read_prompts(path: Path, column: str, max_rows: int) -> list[str]:
    """The first `max_rows` non-empty prompts of a calibration file; a usage error
    naming --calibration (or --calibration-column) for a missing file, an unknown
    format, a missing column, a value that is not text, or no prompts at all."""
    if path.is_dir():
        raise _bad(f"{path} is a directory; --calibration takes a file (.parquet, .jsonl "
                   "or .txt)")
    if not path.is_file():
        raise _bad(f"{path}: no such calibration file")
    suffix = path.suffix.lower()
    if suffix not in _FORMATS:
        raise _bad(f"{path}: calibration files are .parquet, .jsonl or .txt, not "
                   f"{suffix or 'a file without a suffix'}")
    values = {".parquet": _parquet_values, ".jsonl": _jsonl_values,
              ".txt": _text_values}[suffix](path, column)
    try:
        prompts = _first_prompts(values, max_rows, path)
    except UnicodeDecodeError as exc:
        raise _bad(f"{path}: not UTF-8 text ({exc})") from None
    if not prompts:
        raise _bad(f"{path}: no calibration prompts (no non-empty "
                   f"{'lines' if suffix == '.txt' else repr(column) + ' values'})")
    return prompts


def _first_prompts(values, max_rows: int, path: Path) -> list[str]:
    prompts = []
    for where, value in values:
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise _bad(f"{path}: {where}: the prompt is {type(value).__name__}, not text")
        prompts.append(value)
        if len(prompts) == max_rows:
            break
    return prompts


def _parquet_values(path: Path, column: str):
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - any failure is the file's
        raise _bad(f"{path}: not a readable Parquet file ({exc})") from None
    names = file.schema_arrow.names
    if column not in names:
        raise _bad(f"{path}: no column {column!r} (columns: {', '.join(names)}); "
                   "name it with --calibration-column", "calibration-column")
    row = 0
    for batch in file.iter_batches(batch_size=256, columns=[column]):
        for value in batch.column(0).to_pylist():
            yield f"row {row}", value
            row += 1


def _jsonl_values(path: Path, column: str):
    from fusegen.jobs.formats import load_json

    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = load_json(line)
            except (ValueError, json.JSONDecodeError) as exc:
                raise _bad(f"{path}: line {line_no} is not JSON ({exc})") from None
            if not isinstance(record, dict) or column not in record:
                raise _bad(f"{path}: line {line_no} has no key {column!r}; name the "
                           "prompt's key with --calibration-column",
                           "calibration-column")
            yield f"line {line_no}", record[column]


def _text_values(path: Path, column: str):
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            yield f"line {line_no}", line.rstrip("\r\n")


def _bad(message: str, option: str = "calibration") -> click.BadParameter:
    return click.BadParameter(message, param_hint=f"'--{option}'")


def _size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    exponent = min(3, int(math.log(num_bytes, 1024)))
    return f"{num_bytes / 1024 ** exponent:.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"
