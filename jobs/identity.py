"""An input file's content identity: what changes when the file is rewritten with other
content, and stays when it is rewritten with the same bytes (a workflow step's input
regenerated identically still resumes).

- Object stores name their content: S3's ETag, GCS's md5Hash; no byte is read.
- Local and memory:// files: a SHA-256 of their bytes, read once per process per
  (path, size, mtime).
- Any other store: a hash of the Parquet footer (row-group sizes and statistics) and the
  modification stamp the store lists.
"""
from __future__ import annotations

import hashlib
import threading

_STORE_HASHES = ("ETag", "etag", "md5Hash", "crc32c", "content_md5")
_STAMPS = ("mtime", "LastModified", "last_modified", "modified", "created")
_cache: dict[tuple, str] = {}  # (protocol, path, size, stamp) -> content hash
_cache_lock = threading.Lock()
_MAX_CACHED = 100_000


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
