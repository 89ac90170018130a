"""Where each row of a JSONL or CSV file starts: the one record reader that both the
planning scan and every partition's read walk the file with (`jobs/formats.py`).

It starts afresh at any row's start, so a partition that seeks to an offset the scan
recorded reads the very rows the scan counted there: every input row comes out exactly
once, whatever the file holds. A JSONL row is a non-blank line. A CSV row is a record as
Python's csv module reads it: a quoted field may span lines, a quote doubled inside one is
a quote, and a quote inside an unquoted field (`5" screen`) is a literal character, as
pyarrow also reads it; records end at \\n, \\r\\n or a lone \\r.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass

_BOM = b"\xef\xbb\xbf"
# Python's csv module refuses fields over 128 KiB by default, and would then read the
# rest of a long quoted field as rows of its own; a prompt may be far longer.
csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))


@dataclass(slots=True)
class Record:
    """One row's bytes as the file holds them (less a BOM at the file's start), where it
    starts and, for CSV, its fields or why it is no row."""
    offset: int  # byte offset of its first line
    line: int  # 1-based number of its first line
    raw: bytes
    fields: list[str] | None = None  # CSV: the record's fields, decoded
    problem: str | None = None  # CSV: why the record is no row (then fields is None)


def records(f, is_csv: bool, digest=None, offset: int = 0, line: int = 0):
    """Every row's Record in a binary file positioned at `offset`, a row's start (or 0);
    `line`: the number of the line before it. `digest` sees every byte read."""
    lines = _Lines(f, digest, offset, line, split_cr=is_csv)
    if is_csv:
        yield from _csv_records(lines)
        return
    while (raw := lines.next_raw()) is not None:
        if raw.strip():
            yield Record(lines.start, lines.line, raw)


class _Lines:
    """A binary file's lines, as bytes or (iterated, for csv.reader) as text, keeping each
    line's position and the bytes handed out since `pulled` was last cleared."""

    def __init__(self, f, digest, offset: int, line: int, split_cr: bool):
        self._chunks = iter(f)  # a file iterates by \n
        self._split: list[bytes] = []  # the rest of a chunk, reversed
        self._split_cr = split_cr
        self._digest = digest
        self.offset, self.line = offset, line  # past the last line handed out
        self.start = offset  # of the last line handed out
        self.pulled: list[bytes] = []
        self.ended = False  # whether the file ended when a line was asked for

    def next_raw(self) -> bytes | None:
        if not self._split:
            chunk = next(self._chunks, None)
            if chunk is None:
                self.ended = True
                return None
            if self._digest is not None:
                self._digest.update(chunk)
            self._split = chunk.splitlines(keepends=True)[::-1] \
                if self._split_cr and b"\r" in chunk else [chunk]
        raw = self._split.pop()
        self.start, self.line = self.offset, self.line + 1
        self.offset += len(raw)
        if self.start == 0 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        self.pulled.append(raw)
        return raw

    def __iter__(self):
        return self

    def __next__(self) -> str:
        raw = self.next_raw()
        if raw is None:
            raise StopIteration
        # Bytes that are not UTF-8 survive the round trip; the row is judged later.
        return raw.decode("utf-8", "surrogateescape")


def _csv_records(lines: _Lines):
    """csv.reader asks for exactly one record's lines per row (more only while a quoted
    field is open), so the lines pulled for a row are that record's bytes."""
    reader = csv.reader(lines, strict=False)
    while True:
        lines.pulled.clear()
        offset, line = lines.offset, lines.line + 1
        try:
            fields, problem = next(reader), None
        except StopIteration:
            return
        except csv.Error as exc:
            if not lines.pulled:
                return
            fields, problem = None, f"is not CSV ({exc})"
        if lines.ended and problem is None:  # non-strict csv hands back what it has
            fields, problem = None, ("opens a quoted field that never closes: the rest "
                                     "of the file is in it")
        raw = b"".join(lines.pulled)
        if raw.strip():
            yield Record(offset, line, raw, fields, problem)
