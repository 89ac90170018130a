"""A job's identity beyond its options: its inputs' content, its model's files and the
dtype it computes in.

An input file's content identity changes when the file is rewritten with other content,
and stays when it is rewritten with the same bytes (a workflow step's input regenerated
identically still resumes):

- Object stores name their content: S3's ETag, GCS's md5Hash; no byte is read.
- Local and memory:// files: a SHA-256 of their bytes, read once per process per
  (path, size, mtime).
- Any other store: a hash of the Parquet footer (row-group sizes and statistics) and the
  modification stamp the store lists.

A model's identity (`model_identity`) is what its files are without reading the weights:
each file's name, size and mtime_ns, and hashes of config.json and the safetensors index.
`JobIdentity` holds it with the dtype "auto" resolved to; both enter the fingerprint and
the manifest, so that a resume across a change is refused naming it.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass

from fusegen.jobs.errors import JobError

_STORE_HASHES = ("ETag", "etag", "md5Hash", "crc32c", "content_md5")
_STAMPS = ("mtime", "LastModified", "last_modified", "modified", "created")
_cache: dict[tuple, str] = {}  # (protocol, path, size, stamp) -> content hash
_cache_lock = threading.Lock()
_MAX_CACHED = 100_000


def output_fingerprint(config: dict, inputs: list) -> str:
    """Hash of an output's config and its planned inputs (`input_records`): a rerun with
    the same fingerprint resumes, another one is another output."""
    blob = json.dumps([config, inputs], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def content_version(fs, path: str, info: dict, footer_size: int) -> str:
    """`info`: the file's listing (fs.info); `footer_size`: its Parquet footer's bytes."""
    for key in _STORE_HASHES:
        if info.get(key):
            return f"{key}={str(info[key]).strip(chr(34))}"
    stamp = next((f"{k}={info[k]}" for k in _STAMPS if info.get(k) is not None), "")
    if not _reads_cheaply(fs):
        return f"footer={_footer_digest(fs, path, footer_size)} {stamp}".strip()
    key = (str(fs.protocol), path, info.get("size"), stamp)
    with _cache_lock:
        known = _cache.get(key)
    if known is None:
        with fs.open(path, "rb") as f:
            known = "sha256=" + hashlib.file_digest(f, "sha256").hexdigest()
        with _cache_lock:
            if len(_cache) >= _MAX_CACHED:
                _cache.clear()
            _cache[key] = known
    return known


def _reads_cheaply(fs) -> bool:
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, (LocalFileSystem, MemoryFileSystem))


def _footer_digest(fs, path: str, footer_size: int) -> str:
    """The footer's bytes (metadata, its length, the magic), hashed."""
    with fs.open(path, "rb") as f:
        f.seek(-(footer_size + 8), 2)
        return hashlib.sha256(f.read(footer_size + 8)).hexdigest()[:16]


# A model's identity: what changes when its files are rewritten, read without reading the
# weights (GBs): each file's name, size and mtime_ns, and a hash of the small files that
# decide how the rest is read (config.json, the safetensors index).
_MODEL_META = ("*.json", "*.jinja")  # configs, tokenizer files, the index, chat templates
_PICKLES = ("*.bin", "*.pt", "*.pth")  # read only where no *.safetensors is
_HASHED = ("config.json", "model.safetensors.index.json")


def model_identity(model: str, revision: str | None = None, external: bool = False,
                   record_path: str | None = None) -> dict:
    """The record of the files the engine reads for `model`: a checkpoint directory, a
    .gguf file (a split set: every part), or a hub id's cached snapshot (its commit too).

    A hub id resolves as the engine resolves it, downloading what is missing, since this
    machine's cache is the workers' (`external`: the workers are elsewhere, so only a
    snapshot already cached here is read; one that is not is named by id and revision).
    A path that does not exist has no files: loading it fails with the engine's message.
    `record_path`: the model as the record names it (credentials masked)."""
    from pathlib import Path

    from fusegen.engine.weights.hub import looks_like_hub_id, resolve_model

    record = {"path": record_path or model}
    local = Path(os.path.expanduser(model))
    if "://" in model or (not local.exists() and not looks_like_hub_id(model)):
        return {**record, "files": {}}
    if not local.exists():
        path = _cached_snapshot(model, revision) if external else resolve_model(model, revision)
        if path is None:
            return {**record, "revision": revision, "snapshot": None}
        local = Path(path)
        record["snapshot"] = local.name  # the snapshot's commit
    root = local.parent if local.is_file() else local
    return {**record, "files": {str(p.relative_to(root)): _file_record(p)
                                for p in _model_files(local)}}


def _model_files(path):
    if path.is_file():
        return _split_set(path)
    files = {p for pattern in _MODEL_META for p in path.glob(pattern)}
    weights = set(path.glob("*.safetensors")) | _indexed(path)
    files |= weights or {p for pattern in _PICKLES for p in path.glob(pattern)}
    return sorted(p for p in files if p.is_file())


def _split_set(path):
    """A GGUF file, or every part of the split set it is the first file of (named as
    engine/weights/gguf.py reads them; that module needs the gguf package, this not)."""
    import re

    match = re.fullmatch(r"(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf", path.name)
    if match is None:
        return [path]
    return [p for i in range(1, int(match["count"]) + 1)
            if (p := path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf"))
            .is_file()]


def _indexed(path) -> set:
    """The shards the safetensors index names (where the loader looks first)."""
    import json

    try:
        names = json.loads((path / _HASHED[1]).read_text())["weight_map"].values()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    return {path / name for name in set(names) if isinstance(name, str)
            and not os.path.isabs(name) and ".." not in name.split("/")}


def _file_record(path) -> dict:
    st = path.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if path.name in _HASHED:
        record["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return record


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The snapshot of `repo_id` at `revision` in this machine's hub cache, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from fusegen.engine.weights.hub import ALLOW_PATTERNS, hub_cache_dir

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(),
                                 allow_patterns=list(ALLOW_PATTERNS), local_files_only=True)
    except LocalEntryNotFoundError:
        return None


@dataclass(frozen=True, slots=True)
class JobIdentity:
    """What a generation job's output depends on besides its options and inputs, resolved
    once by the driver: the dtype it computes in and its model's files."""
    dtype: str  # resolved: float32, bfloat16 or float16
    option: str  # the dtype the job asks for: auto or one of those
    model: dict  # `model_identity`
    # What "auto" resolved to before fusegen recorded the dtype, where no timing chose it
    # (GPUs, CPUs without bf16 units); None where a timed matmul did.
    earlier_auto: str | None = None

    def fingerprint_fields(self) -> dict:
        """Replaces the dtype as asked with the dtype resolved: `auto` and the dtype it
        resolves to are one job."""
        return {"dtype": self.dtype, "model_files": self.model}

    def manifest_fields(self) -> dict:
        return {"dtype": self.dtype, "model": self.model}

    def earlier_fingerprint(self, old: dict, config: dict, inputs: list | None) -> str | None:
        """The fingerprint an output written before fusegen recorded dtypes and model files
        has when it holds this job (its parts are kept), else None. `config`: this job's
        output config (the dtype as asked)."""
        if "dtype" in old or "fingerprint" not in old or inputs is None:
            return None
        option = old.get("config", {}).get("dtype", self.option)
        fingerprint = output_fingerprint({**config, "dtype": option}, inputs)
        return fingerprint if fingerprint == old["fingerprint"] else None

    def check_dtype(self, old: dict, output: str, earlier: bool, changes: list[str]) -> None:
        """Refuse, naming both dtypes, to resume an output written in another dtype.
        `earlier`: an output written before the dtype was recorded that holds this job
        otherwise; `changes`: what else differs (config keys, inputs, the model)."""
        written = old.get("dtype")
        if written is None and earlier:
            asked = old.get("config", {}).get("dtype", "auto")
            written = asked if asked != "auto" else \
                self.option if self.option != "auto" else self.earlier_auto
            if written is None:
                raise JobError(
                    f"output {output} was written before fusegen recorded the dtype 'auto' "
                    "resolves to, and on a CPU with bf16 units that fusegen chose float32 or "
                    "bfloat16 by timing a matmul at each start, so its parts may be in "
                    "either; pass --dtype float32 or --dtype bfloat16 (the one it was "
                    "written in) to resume it, or --overwrite to start afresh")
        if written is None or written == self.dtype:
            return
        now = (f"this run asks for dtype {self.dtype}" if self.option != "auto" else
               f"this run resolves dtype auto to {self.dtype} (auto: bfloat16 on GPUs and "
               "on CPUs with bf16 units, float32 on other CPUs)")
        others = [c for c in changes if not c.startswith("dtype:")]
        also = f"; it also differs in: {'; '.join(others)}" if others else ""
        raise JobError(f"output {output} was written in {written}; {now}{also}; pass "
                       f"--dtype {written} to resume it, or --overwrite to start afresh")

    def changes(self, old: dict) -> list[str]:
        """How the model's files differ from those the old manifest records."""
        was, now = old.get("model"), self.model
        if not isinstance(was, dict) or was == now:
            return []
        path = now.get("path")
        if was.get("path") != path:
            return []  # another model: the config's `model` names it
        if was.get("snapshot") != now.get("snapshot"):
            return [f"model {path} resolves to another snapshot "
                    f"({was.get('snapshot')!r} -> {now.get('snapshot')!r})"]
        before, after = was.get("files") or {}, now.get("files") or {}
        diffs = [f"{name} is gone" for name in before if name not in after]
        diffs += [f"{name} is new" for name in after if name not in before]
        for name in (n for n in after if n in before and before[n] != after[n]):
            diffs.append(f"{name} " + ", ".join(
                f"{k} {before[name].get(k)!r} -> {v!r}" for k, v in after[name].items()
                if before[name].get(k) != v))
        return [f"model {path} was rewritten ({'; '.join(diffs)})"] if diffs else []
