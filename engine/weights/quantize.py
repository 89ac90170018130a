"""A checkpoint written as fusegen's group-quantized int8 / int4 checkpoint
(docs/quantization.md has the format; `fusegen quantize` is the command).

The decoder layers' linears (attention q/k/v/o, gate/up/down, every MoE expert's) become
`NAME.qweight` / `NAME.scales` (/ `NAME.zeros`); every other tensor is copied as the
source holds it. The source is streamed a tensor at a time into safetensors files
written here (the header first, from the planned shapes, then each tensor's bytes), so
the model is never in memory twice; the directory is written under a temporary name
and renamed when complete.

AWQ (`method="awq"`) first searches per-channel scales on calibration prompts and folds
them into the weights (engine/weights/awq.py).

The writer is shared with `fusegen sparsify` (engine/weights/sparsify.py): a *form*
decides what each decoder linear becomes (`planned`: the output tensors' names, shapes
and dtypes, before any is written; `produce`: those tensors), and the config entries
written beside the weights.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.weights.awq import calibrate, fold, search_scales
from fusegen.engine.weights.gguf_names import is_gguf
from fusegen.engine.weights.quantize_spec import (QUANTIZED_PARAMS, QuantizeError, QuantizeSpec,
                                                  Report, Source)

MAX_SHARD_BYTES = 2 << 30  # a larger checkpoint is written in shards of at most this
# Files copied beside the weights: the tokenizer's and the generation defaults.
_COPIED_PREFIXES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges",
                    "chat_template", "generation_config")


def open_source(path, command: str = "quantize") -> Source:
    """A checkpoint directory (safetensors) or a GGUF file; QuantizeError (--model)
    when it is neither, does not match its config, or is already quantized or sparse
    (`command`, the verb the message suggests: quantize / sparsify)."""
    path = Path(path)
    try:
        if is_gguf(path):
            return _gguf_source(path)
        if not path.is_dir():
            raise QuantizeError(f"{path}: no such checkpoint directory or .gguf file", "model")
        return _dir_source(path, command)
    except ModelLoadError as exc:
        raise QuantizeError(str(exc), "model") from None


def _dir_source(path: Path, command: str) -> Source:
    from fusegen.engine.weights.loader import load_state_dict

    cfg = ModelConfig.from_dir(path)  # a missing or unreadable config.json named
    raw = json.loads((path / "config.json").read_text())
    for key, what in (("quantization_config", "quantized"), ("sparsity_config", "sparse")):
        if raw.get(key) is not None:
            raise QuantizeError(f"{path}: already {what} (config.json's {key} is "
                                f"{json.dumps(raw[key])}); {command} the 16-bit checkpoint "
                                "it was made from", "model")
    tensors = load_state_dict(path, cfg)  # checked against config.json; a tied head left out

    def write_metadata(out: Path, entries: dict) -> None:
        _write_json(out / "config.json", {**raw, **entries})
        for file in sorted(path.iterdir()):
            if file.is_file() and file.name.startswith(_COPIED_PREFIXES):
                shutil.copy2(file, out / file.name)

    return Source(path, cfg, tensors, write_metadata)


def _gguf_source(path: Path) -> Source:
    if not path.is_file():
        raise QuantizeError(f"{path}: no such GGUF file", "model")
    from fusegen.engine.weights import gguf_export
    from fusegen.engine.weights.gguf import GGUFFile, gguf_model_config, load_gguf_state_dict
    from fusegen.engine.weights.gguf_names import hf_config

    reader = GGUFFile.open(path)
    cfg = gguf_model_config(path)
    tensors = load_gguf_state_dict(path, cfg, torch.float32)  # dequantized when read

    def write_metadata(out: Path, entries: dict) -> None:
        raw = hf_config(reader.metadata, reader.tensors, str(path))
        _write_json(out / "config.json", {
            **raw, "model_type": get_architecture(cfg.architecture).model_type,
            "dtype": "bfloat16", "torch_dtype": "bfloat16", **entries})
        _write_json(out / "generation_config.json",
                    {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                     if raw.get(k) is not None})
        gguf_export.write_tokenizer(reader.metadata, str(path), out,
                                     cfg.max_position_embeddings)

    return Source(path, cfg, tensors, write_metadata, out_dtype=torch.bfloat16)


def quantized_tensors(cfg: ModelConfig) -> dict[str, int]:
    """The checkpoint names of the linears quantized, with their input width: every
    layer's tensors that go into q/k/v, o, gate/up and down (MoE experts included)."""
    arch = get_architecture(cfg.architecture)
    names = {}
    for i in range(cfg.num_layers):
        prefix = arch.layer_prefix.format(i)
        for name, shape, param in arch.layer_tensors(cfg):
            if param in QUANTIZED_PARAMS:
                names[prefix + name] = shape[1]
    return names


def check_group_size(cfg: ModelConfig, group_size: int) -> None:
    for name, in_features in quantized_tensors(cfg).items():
        if in_features % group_size:
            raise QuantizeError(f"tensor {name!r} has {in_features} input features, not a "
                                f"multiple of the group size {group_size}; choose a group "
                                "size that divides it", "group-size")


# -- writing ---------------------------------------------------------------------

_ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64",
             torch.uint64: "U64", torch.float64: "F64", torch.int16: "I16", torch.bool: "BOOL"}

Planned = list[tuple[str, tuple[int, ...], torch.dtype]]  # (name, shape, dtype) per tensor


class LinearForm(Protocol):
    """What each decoder linear (a `quantized_tensors` name) is written as."""

    def planned(self, name: str, source: Source) -> Planned:
        """The output tensors the linear `name` becomes, before any is written."""

    def produce(self, name: str, weight: torch.Tensor) -> list[torch.Tensor]:
        """Those tensors, in `planned`'s order, from the (transformed) weight."""

    def config_entries(self) -> dict:
        """The entries added to config.json (e.g. {"quantization_config": ...})."""


class GroupCodes:
    """Group-quantized codes (docs/quantization.md): NAME.qweight / .scales (/ .zeros)."""

    def __init__(self, spec: QuantizeSpec):
        self.spec = spec

    def planned(self, name: str, source: Source) -> Planned:
        spec, (out, inp) = self.spec, source.tensors[name].shape
        base = name.removesuffix(".weight")
        groups = (out, inp // spec.group_size)
        planned = [(base + ".qweight", (out, inp if spec.bits == 8 else inp // 2), torch.uint8),
                   (base + ".scales", groups, torch.float16)]
        return planned + ([] if spec.symmetric else [(base + ".zeros", groups, torch.uint8)])

    def produce(self, name: str, weight: torch.Tensor) -> list[torch.Tensor]:
        from fusegen.kernels.group_linear import quantize_group

        spec = self.spec
        try:
            qweight, scales, zeros = quantize_group(weight, spec.bits, spec.group_size,
                                                    spec.symmetric)
        except ValueError as exc:  # inf / NaN, or a scale past fp16
            raise QuantizeError(f"tensor {name!r}: {exc}", "model") from None
        return [qweight, scales] + ([] if zeros is None else [zeros])

    def config_entries(self) -> dict:
        return {"quantization_config": self.spec.config_entry()}


def _planned(name: str, source: Source, form: LinearForm | None, linears: dict) -> Planned:
    """The output tensors one source tensor becomes: (name, shape, dtype)."""
    tensor = source.tensors[name]
    if form is None or name not in linears:
        return [(name, tuple(tensor.shape), source.out_dtype or tensor.dtype)]
    return form.planned(name, source)


def _produce(name: str, source: Source, form: LinearForm | None, linears: dict,
             transform: Callable | None) -> list[torch.Tensor]:
    """One source tensor's output tensors, in `_planned`'s order."""
    tensor = source.read(name)
    if transform is not None:  # on a copy: the source's views stay as the file holds them
        tensor = transform(name, tensor.to(torch.float32, copy=True))
    if form is None or name not in linears:
        return [tensor.to(source.out_dtype or source.tensors[name].dtype)]
    return form.produce(name, tensor)


def _write_shard(path: Path, planned: list[tuple[str, tuple, torch.dtype]],
                 tensors: Iterator[torch.Tensor]) -> int:
    """A safetensors file: its header from the planned shapes, then each tensor's bytes
    as `tensors` yields it (checked against the plan). Returns the bytes written."""
    header, offset = {}, 0
    for name, shape, dtype in planned:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for (name, shape, dtype), tensor in zip(planned, tensors, strict=True):
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise RuntimeError(f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"planned {shape} {dtype}")
            f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
    return 8 + len(text) + offset


def _write_weights(out: Path, source: Source, form: LinearForm | None,
                   transform: Callable | None, max_shard_bytes: int, report: Report) -> None:
    from fusegen.engine.weights.gguf_export import shard_plan

    quantized = quantized_tensors(source.cfg) if form is not None else {}
    plans = {name: _planned(name, source, form, quantized) for name in source.tensors}
    sizes = {name: sum(math.prod(s) * d.itemsize for _, s, d in plan)
             for name, plan in plans.items()}
    shards = shard_plan(sizes, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
              for k in range(1, len(shards) + 1)])
    for names, file in zip(shards, files):
        planned = [entry for name in names for entry in plans[name]]
        produced = (t for name in names
                    for t in _produce(name, source, form, quantized, transform))
        report.bytes_after += _write_shard(out / file, planned, produced)
    if len(shards) > 1:
        weight_map = {entry[0]: file for names, file in zip(shards, files)
                      for name in names for entry in plans[name]}
        _write_json(out / "model.safetensors.index.json",
                    {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    report.num_files = len(files)
    report.num_quantized = len(quantized)
    report.num_copied = len(plans) - len(quantized)
    report.bytes_before = sum(source.nbytes(name) for name in source.tensors)


def quantize_checkpoint(model, output, spec: QuantizeSpec, *,
                        prompts: list[str] | None = None, overwrite: bool = False,
                        max_shard_bytes: int = MAX_SHARD_BYTES, dense: bool = False
                        ) -> Report:
    """Write `model` (a checkpoint directory or .gguf file) quantized by `spec` into the
    directory `output`; `prompts`: the calibration prompts of method awq. `dense`: the
    weights written unquantized, with the AWQ scales folded in (the folded model, to
    check that folding leaves its outputs as they were). QuantizeError, naming the
    option, for a bad input; nothing is written at `output` then, nor when interrupted."""
    output = Path(output)
    source = open_source(model)
    check_group_size(source.cfg, spec.group_size)
    if spec.method == "awq" and not prompts:
        raise QuantizeError("method awq needs calibration prompts (--calibration)",
                            "calibration")
    if spec.method == "rtn" and prompts:
        raise QuantizeError("calibration prompts are used only by method awq (--method awq)",
                            "calibration")
    check_output(output, source.path, overwrite)
    report = Report(output)
    transform = None
    if spec.method == "awq":
        scales = search_scales(source, calibrate(source, prompts), spec, report)
        transform = fold(source, scales)
    write_checkpoint(source, output, None if dense else GroupCodes(spec), report,
                     transform=transform, max_shard_bytes=max_shard_bytes)
    return report


def write_checkpoint(source: Source, output: Path, form: LinearForm | None, report: Report,
                     *, transform: Callable | None = None,
                     max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """`source` written at `output` (checked by `check_output` first) with its decoder
    linears in `form` (None: dense, as the source holds them) and `form`'s config
    entries: written under a temporary name, renamed when complete; nothing is left
    at `output` when it fails or is interrupted (an existing one stays as it was).
    A failed write (a full disk, a quota) is a QuantizeError naming --output."""
    remove_dead_staging(output)
    staging = output.with_name(f".{output.name}.partial-{_writer_tag()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        source.write_metadata(staging, {} if form is None else form.config_entries())
        _write_weights(staging, source, form, transform, max_shard_bytes, report)
        _replace(staging, output)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise QuantizeError(f"{output} was not written: {exc}", "output") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _writer_tag(pid: int | None = None) -> str:
    """HOST-PID of a writer: the host too, since an output's folder may be on a file
    system other machines write to, where a PID says nothing."""
    host = socket.gethostname().replace("/", "_") or "localhost"
    return f"{host}-{os.getpid() if pid is None else pid}"


def remove_dead_staging(output: Path) -> list[Path]:
    """Remove the staging folders (`.NAME.partial-HOST-PID`) beside `output` whose
    writer ran on this host and is no longer running: one killed by SIGKILL cannot
    remove its own. A live writer's staging, and any other host's (whose processes this
    one cannot see), are left alone. Returns what was removed."""
    removed = []
    parent = output.absolute().parent
    if not parent.is_dir():
        return removed
    prefix = f".{output.name}.partial-"
    host = _writer_tag(0).rpartition("-")[0]  # this host, as its writers name it
    for path in parent.glob(f"{prefix}*"):
        tag_host, _, pid = path.name[len(prefix):].rpartition("-")
        if tag_host == host and pid.isdigit() and path.is_dir() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def check_output(output: Path, source: Path, overwrite: bool) -> None:
    """QuantizeError (--output) for an output that would replace the source, or that
    exists and --overwrite was not given, or that is not a directory, or that --overwrite
    would replace though it is no checkpoint (files but no config.json: a typo must not
    remove a folder), or where no directory can be made (`check_writable`). Called
    before any calibration or writing, so a long run does not fail at its end."""
    resolved, src = output.resolve(), source.resolve()
    if resolved == src or resolved in src.parents:
        raise QuantizeError(f"{output}: the output would replace the source model "
                            f"{source}; choose another directory", "output")
    if output.exists() and not overwrite:
        raise QuantizeError(f"{output} already exists; pass --overwrite to replace it",
                            "output")
    if output.exists() and not output.is_dir():
        raise QuantizeError(f"{output} exists and is not a directory", "output")
    if output.is_dir() and any(output.iterdir()) and not (output / "config.json").is_file():
        raise QuantizeError(f"{output} holds files but no config.json: --overwrite replaces "
                            "a checkpoint directory, and this is none; choose another "
                            "--output, or empty it first", "output")
    check_writable(output)


def check_writable(output: Path) -> None:
    """QuantizeError (--output) where no directory can be made beside `output`: a
    file in its path, no permission, a read-only file system. Tried (an empty directory
    made and removed)."""
    existing = output.absolute().parent
    while not existing.exists():  # write_checkpoint makes the missing parents
        existing = existing.parent
    if not existing.is_dir():
        raise QuantizeError(f"{output} cannot be made: {existing} is not a directory",
                            "output")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{output.name}.probe-", dir=existing))
    except OSError as exc:
        raise QuantizeError(f"{output} cannot be made: no directory can be written in "
                            f"{existing} ({exc.strerror})", "output") from None


def _replace(staging: Path, output: Path) -> None:
    """`staging` renamed to `output`; an existing `output` moved aside first and
    removed only once the new one is in place."""
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.old-{os.getpid()}")
        output.rename(old)
    staging.rename(output)
    if old is not None:
        shutil.rmtree(old)


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
