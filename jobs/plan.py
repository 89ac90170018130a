"""Partition planning: input files (with their row-group sizes) -> bounded row ranges.

Pure policy over plain data. A partition is rows [start, stop) of one file, at most
`partition_rows` long. Consecutive small row groups are packed together; a row group
longer than `partition_rows` is cut into slices, so memory stays bounded whatever the
writer chose. The plan depends only on the file list and `partition_rows`, so a rerun
plans the same partitions and resume can match them by index.

JSONL and CSV files (`jobs/formats.py`) are cut like one long row group, and their "row
groups" are runs of GROUP_ROWS rows whose byte offsets the scan recorded, so a partition
seeks to the run holding its first row instead of reading the file from its start.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextLayout:
    """Where the row groups of a JSONL / CSV file start, from one scan of the file."""
    format: str  # "jsonl", "csv" or "openai_batch" (`jobs/formats.py`)
    offsets: tuple[int, ...]  # byte offset of each row group's first row
    lines: tuple[int, ...]  # 1-based line number of each row group's first row
    schema: object = None  # pa.Schema of the whole file (None for openai_batch)
    # openai_batch: the file's problem lines the planning scan found (not UTF-8, a
    # custom_id other lines of the job hold), `jobs/batch_checks.py`'s LineChecks; None: none
    checks: object = None


@dataclass(frozen=True, slots=True)
class TextSlice:
    """How a partition of a text file reads its rows: seek to `offset` (line `line`), skip
    `skip` rows, read the partition's rows."""
    format: str
    offset: int
    line: int
    skip: int
    schema: object = None
    # The layout's checks of the lines from `line` to the row group after the partition's
    # last row (those of fewer than two row groups' rows beyond its own), so a worker
    # never reads the file for them.
    checks: object = None


@dataclass(frozen=True, slots=True)
class InputFile:
    path: str  # filesystem path (no protocol, no credentials)
    row_groups: tuple[int, ...]  # rows per row group
    columns: tuple[str, ...] = ()  # the file's column names
    # Content identity: a file rewritten in place (same path, same row count) differs in
    # one of these, so its output's fingerprint does too.
    size: int | None = None  # bytes
    version: str = ""  # e.g. "ETag=..." or "sha256=..." (`jobs/identity.py`)
    text: TextLayout | None = None  # None: Parquet

    @property
    def num_rows(self) -> int:
        return sum(self.row_groups)


@dataclass(frozen=True, slots=True)
class Partition:
    index: int
    path: str
    start: int  # first row, counted within the file
    stop: int  # one past the last row
    first_row: int  # global index of `start` over all files: row seeds derive from it
    num_digits: int = 5  # of the part's name: the same for every partition of a plan
    text: TextSlice | None = None  # None: a Parquet partition
    suffix: str = ".parquet"  # of the part's name: the output's format

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    @property
    def name(self) -> str:
        return f"part-{self.index:0{self.num_digits}d}{self.suffix}"


def name_digits(num_partitions: int) -> int:
    """Digits of the part names of a plan: 5 up to 100,000 partitions (the names outputs
    have always had, so they resume), more beyond, so that names sort in input order."""
    return max(5, len(str(num_partitions - 1)))


def plan_partitions(files: list[InputFile], partition_rows: int,
                    suffix: str = ".parquet") -> list[Partition]:
    """`suffix`: of the parts' names, `.parquet` or `.jsonl`."""
    assert partition_rows >= 1
    ranges = []  # (path, start, stop, first_row, text slice)
    first_row = 0
    for f in files:
        firsts = list(itertools.accumulate(f.row_groups[:-1], initial=0))
        # A text file's partitions may start at any row (its groups only mark offsets).
        groups = f.row_groups if f.text is None else (f.num_rows,)
        for start, stop in _file_ranges(groups, partition_rows):
            ranges.append((f.path, start, stop, first_row + start,
                           _text_slice(f, start, stop, firsts)))
        first_row += f.num_rows
    digits = name_digits(len(ranges))
    return [Partition(i, *r[:4], num_digits=digits, text=r[4], suffix=suffix)
            for i, r in enumerate(ranges)]


def _text_slice(f: InputFile, start: int, stop: int, firsts: list[int]) -> TextSlice | None:
    """The row group of a text file holding row `start`, and the rows to skip in it, for
    rows [start, stop). `firsts`: the first row of each row group."""
    if f.text is None:
        return None
    g = bisect.bisect_right(firsts, start) - 1
    layout = f.text
    checks = None
    if layout.checks is not None:  # lines up to the start of the group after row stop - 1
        after = bisect.bisect_right(firsts, stop - 1)
        end = layout.lines[after] if after < len(layout.lines) else 1 << 62
        checks = layout.checks.between(layout.lines[g], end)
    return TextSlice(layout.format, layout.offsets[g], layout.lines[g], start - firsts[g],
                     layout.schema, checks)


def _file_ranges(row_groups, partition_rows: int):
    start = pos = 0  # pending range [start, pos) of whole row groups
    for rows in row_groups:
        if pos - start + rows > partition_rows and pos > start:
            yield start, pos
            start = pos
        if rows > partition_rows:  # slice the big group; its remainder stays pending
            end = pos + rows
            while end - start > partition_rows:
                yield start, start + partition_rows
                start += partition_rows
        pos += rows
    if pos > start:
        yield start, pos
