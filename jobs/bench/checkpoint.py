"""The benchmark's random model, saved once as a normal checkpoint and reused; and a
real GGUF model's export to a Hugging Face checkpoint for the baselines, likewise.

A checkpoint lives under <cache>/bench/<preset>-<hash of its shape>/. A changed shape
(another preset version, `--layers`) hashes elsewhere, so it is built anew; the old one is
kept, so that switching back does not rebuild (delete the directory to reclaim the space).
An export lives under <cache>/bench/gguf-export/<file stem>-<dtype>-<hash of the file's
path, size and mtime>/: a changed file exports anew. A directory counts as built only
once its marker file exists (written last, in a temporary directory renamed into place).
A pruned variant (`--sparsity`) lives under <cache>/bench/sparse/<source name>-<hash of the
source's path, files' sizes and mtimes>-<method><sparsity>-<values>/, written by
`fusegen sparsify`'s writer: a changed source prunes anew."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from fusegen.jobs.bench.presets import PresetModel

_MARKER = "bench_shape.json"
_EXPORT_MARKER = "bench_export.json"
_SPARSE_MARKER = "bench_sparse.json"
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
# Bump when engine.weights.gguf_export's output changes.
_EXPORT_VERSION = 1
# Bump when engine.weights.sparsify's output changes.
_SPARSE_VERSION = 1
# Bump when engine.models.synthetic's output changes in a way the shape does not show.
_BUILDER_VERSION = 1
_SEED = 0


def default_cache_dir() -> Path:
    root = os.environ.get("FUSEGEN_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "fusegen"


def shape_key(shape: PresetModel) -> str:
    # A dense shape hashes without the MoE fields, as before they existed: cached
    # checkpoints stay valid.
    fields = {k: v for k, v in shape.to_dict().items() if v or k not in _MOE_FIELDS}
    text = json.dumps({**fields, "builder": _BUILDER_VERSION, "seed": _SEED}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def checkpoint_dir(name: str, shape: PresetModel, cache_dir: Path) -> Path:
    return Path(cache_dir) / "bench" / f"{name}-{shape_key(shape)}"


def is_built(path: Path) -> bool:
    return (path / _MARKER).is_file()


def ensure_checkpoint(name: str, shape: PresetModel, cache_dir: Path,
                      progress: Callable[[str], None] = lambda _: None) -> Path:
    """The checkpoint directory for `shape`, built first when missing."""
    path = checkpoint_dir(name, shape, cache_dir)
    if is_built(path):
        progress(f"model: cached checkpoint {path}")
        return path
    progress(f"model: building a random {shape.num_layers}-layer checkpoint in {path}")
    return _build_once(path, lambda tmp: _build(tmp, shape), _MARKER, shape.to_dict())


def export_dir(gguf: Path, dtype: str, cache_dir: Path) -> Path:
    """Where `gguf`'s export in `dtype` is cached (for a split set: keyed by its first file)."""
    stat = Path(gguf).stat()
    key = {"path": str(Path(gguf).resolve()), "size": stat.st_size,
           "mtime_ns": stat.st_mtime_ns, "dtype": dtype, "exporter": _EXPORT_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_dir) / "bench" / "gguf-export" / f"{Path(gguf).stem}-{dtype}-{digest}"


def ensure_export(gguf: Path, dtype: str, cache_dir: Path,
                  progress: Callable[[str], None] = lambda _: None) -> Path:
    """A Hugging Face checkpoint of the GGUF file `gguf` with its weights in `dtype`
    (what fusegen runs from the file: engine.weights.gguf_export), exported first when
    missing."""
    import torch

    from fusegen.engine.weights.gguf_export import export_gguf

    path = export_dir(gguf, dtype, cache_dir)
    if (path / _EXPORT_MARKER).is_file():
        progress(f"model: cached Hugging Face export {path}")
        return path
    progress(f"model: exporting {Path(gguf).name} as a Hugging Face checkpoint ({dtype}) for "
             f"the baselines, in {path}")
    return _build_once(path, lambda tmp: export_gguf(gguf, tmp, getattr(torch, dtype)),
                       _EXPORT_MARKER, {"gguf": str(gguf), "dtype": dtype})


def sparse_dir(source: Path, sparsity: float, values: str, method: str,
               cache_dir: Path) -> Path:
    """Where `source` (a checkpoint directory or a GGUF file) pruned to `sparsity` with
    `values` (sparsify's name: bf16, int8) is cached."""
    source = Path(source).resolve()
    files = sorted(p for p in ([source] if source.is_file() else source.iterdir())
                   if p.is_file() and p.suffix in (".safetensors", ".json", ".gguf"))
    key = {"path": str(source), "sparsifier": _SPARSE_VERSION,
           "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return (Path(cache_dir) / "bench" / "sparse"
            / f"{source.stem}-{digest}-{method}{sparsity:g}-{values}")


def ensure_sparse_checkpoint(source: Path, sparsity: float, values: str, method: str,
                             cache_dir: Path,
                             progress: Callable[[str], None] = lambda _: None) -> Path:
    """`source` pruned per row by `method` to `sparsity`, its kept values stored as
    `values` (bf16, int8), in fusegen's sparse format: written first when missing.
    QuantizeError (a ValueError naming the option) where sparsify refuses the source."""
    from fusegen.engine.weights.sparsify import SparsifySpec, sparsify_checkpoint

    spec = SparsifySpec(sparsity, method, values)
    path = sparse_dir(source, sparsity, values, method, cache_dir)
    if (path / _SPARSE_MARKER).is_file():
        progress(f"sparse: cached {sparsity:g} {values} checkpoint {path}")
        return path
    progress(f"sparse: pruning {Path(source).name} to {sparsity:g} by {method}, {values} "
             f"values, into {path}")
    return _build_once(path, lambda tmp: sparsify_checkpoint(source, tmp, spec),
                       _SPARSE_MARKER, {"source": str(source), "sparsity": sparsity,
                                        "values": values, "method": method})


def _build_once(path: Path, build: Callable[[Path], object], marker: str, about: dict) -> Path:
    """`build` into a temporary sibling of `path`, the marker last, then renamed into
    place: an interrupted build never looks finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    (tmp / marker).write_text(json.dumps(about, indent=2) + "\n")
    shutil.rmtree(path, ignore_errors=True)  # an earlier, interrupted build
    os.replace(tmp, path)
    return path


def _build(path: Path, shape: PresetModel) -> None:
    from fusegen.engine.models.synthetic import build_checkpoint

    build_checkpoint(
        path, shape.arch, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_layers=shape.num_layers,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings, dtype=shape.dtype, seed=_SEED)
