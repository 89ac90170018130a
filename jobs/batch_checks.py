"""What one read of a whole OpenAI batch file knows that a partition's own lines cannot
show: the custom_ids several lines share (anywhere in the file, across partitions), and
the lines that are not UTF-8 (a partition gets its lines decoded, bad bytes replaced).

Each worker process reads a file once, on the first of its partitions it runs, and keeps
what it found for the next ones (`file_checks`); a custom_id is kept as a 16-byte digest,
so a million lines take 24 MB while the file is read.
"""
from __future__ import annotations

import hashlib
import json
import threading
from array import array
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

from fusegen.jobs.storage import filesystem


@dataclass(slots=True)
class FileChecks:
    shared: dict[bytes, tuple[int, ...]]  # custom_id's digest -> the lines naming it (2+)
    bad_lines: array  # the lines that are not valid UTF-8, ascending
    bad_at: array  # for each: its first bad byte's offset in the line x 256 + the byte

    def not_utf8(self, line: int) -> str | None:
        """What is wrong with the line's bytes, or None."""
        i = bisect_left(self.bad_lines, line)
        if i == len(self.bad_lines) or self.bad_lines[i] != line:
            return None
        offset, byte = divmod(self.bad_at[i], 256)
        return (f"is not valid UTF-8 (byte 0x{byte:02x} at byte {offset} of the line); "
                "save the file as UTF-8")

    def others(self, line: int, custom_id: str | None) -> list[int]:
        """The other lines naming `custom_id`, in file order."""
        lines = () if custom_id is None else self.shared.get(digest(custom_id), ())
        return [n for n in lines if n != line]


def scan_file(f) -> FileChecks:
    """FileChecks of a batch file (binary), read line by line as the planner numbers its
    lines. A custom_id counts where the line is JSON, and not where the line's bad bytes
    are in it (replaced, it is no custom_id the file holds)."""
    digests, id_lines, bad_lines, bad_at = bytearray(), array("q"), array("q"), array("q")
    for line, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        try:
            text, intact = raw.decode("utf-8"), True
        except UnicodeDecodeError as exc:
            bad_lines.append(line)
            bad_at.append(exc.start * 256 + raw[exc.start])
            text, intact = raw.decode("utf-8", "replace"), False
        custom_id = _custom_id(text)
        if custom_id is not None and (intact or "\ufffd" not in custom_id):
            digests += digest(custom_id)
            id_lines.append(line)
    return FileChecks(_shared(digests, id_lines), bad_lines, bad_at)


def _custom_id(text: str) -> str | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def digest(custom_id: str) -> bytes:
    return hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _shared(digests: bytearray, lines: array) -> dict[bytes, tuple[int, ...]]:
    """digest -> its lines, for the digests that occur more than once."""
    keys = np.frombuffer(bytes(digests), dtype=np.uint64).reshape(-1, 2)
    order = np.lexsort((keys[:, 1], keys[:, 0]))
    repeats = np.flatnonzero(np.all(keys[order[1:]] == keys[order[:-1]], axis=1))
    shared: dict[bytes, set] = {}
    for i in repeats:  # sorted row i+1 repeats row i
        a, b = int(order[i]), int(order[i + 1])
        shared.setdefault(bytes(digests[16 * a:16 * a + 16]), {lines[a]}).add(lines[b])
    return {key: tuple(sorted(found)) for key, found in shared.items()}


_CHECKS: dict = {}  # (job fingerprint, path) -> FileChecks
_CHECKS_LOCK = threading.Lock()


def file_checks(spec, path: str, fingerprint: str) -> FileChecks:
    """The batch file's FileChecks, read on the first of its partitions this process runs
    (the fingerprint covers the file's content: a file rewritten is read again)."""
    key = (fingerprint, path)
    with _CHECKS_LOCK:
        if key not in _CHECKS:
            fs, _ = filesystem(spec.input, spec.storage_options)
            with fs.open(path, "rb") as f:
                checks = scan_file(f)
            while len(_CHECKS) >= 2:  # a job reads its files one after the other
                _CHECKS.pop(next(iter(_CHECKS)))
            _CHECKS[key] = checks
        return _CHECKS[key]
