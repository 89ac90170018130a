"""The benchmark's random model, saved once as a normal checkpoint and reused.

A checkpoint lives under <cache>/bench/<preset>-<hash of its shape>/. A changed shape
(another preset version, `--layers`) hashes elsewhere, so it is built anew; the old one is
kept, so that switching back does not rebuild (delete the directory to reclaim the space).
A directory counts as built only once its marker file exists (written last)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from fusegen.jobs.bench.presets import ModelShape

_MARKER = "bench_shape.json"
# Bump when engine.models.synthetic's output changes in a way the shape does not show.
_BUILDER_VERSION = 1
_SEED = 0


def default_cache_dir() -> Path:
    root = os.environ.get("FUSEGEN_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "fusegen"


def shape_key(shape: ModelShape) -> str:
    text = json.dumps({**shape.to_dict(), "builder": _BUILDER_VERSION, "seed": _SEED},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def checkpoint_dir(name: str, shape: ModelShape, cache_dir: Path) -> Path:
    return Path(cache_dir) / "bench" / f"{name}-{shape_key(shape)}"


def is_built(path: Path) -> bool:
    return (path / _MARKER).is_file()


def ensure_checkpoint(name: str, shape: ModelShape, cache_dir: Path,
                      progress: Callable[[str], None] = lambda _: None) -> Path:
    """The checkpoint directory for `shape`, built first when missing."""
    path = checkpoint_dir(name, shape, cache_dir)
    if is_built(path):
        progress(f"model: cached checkpoint {path}")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"model: building a random {shape.num_layers}-layer checkpoint in {path}")
    tmp = path.parent / f".{path.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _build(tmp, shape)
    (tmp / _MARKER).write_text(json.dumps(shape.to_dict(), indent=2) + "\n")
    shutil.rmtree(path, ignore_errors=True)  # an earlier, interrupted build
    os.replace(tmp, path)
    return path


def _build(path: Path, shape: ModelShape) -> None:
    from fusegen.engine.models.synthetic import build_checkpoint

    build_checkpoint(
        path, shape.arch, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_layers=shape.num_layers,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings, dtype=shape.dtype, seed=_SEED)
