"""Partition planning: input files (with their row-group sizes) -> bounded row ranges.

Pure policy over plain data. A partition is rows [start, stop) of one file, at most
`partition_rows` long. Consecutive small row groups are packed together; a row group
longer than `partition_rows` is cut into slices, so memory stays bounded whatever the
writer chose. The plan depends only on the file list and `partition_rows`, so a rerun
plans the same partitions and resume can match them by index.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InputFile:
    path: str  # filesystem path (no protocol, no credentials)
    row_groups: tuple[int, ...]  # rows per row group
    columns: tuple[str, ...] = ()  # the file's column names
    # Content identity: a file rewritten in place (same path, same row count) differs in
    # one of these, so its output's fingerprint does too.
    size: int | None = None  # bytes
    version: str = ""  # e.g. "ETag=..." or "sha256=..." (`jobs/identity.py`)

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

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    @property
    def name(self) -> str:
        return f"part-{self.index:0{self.num_digits}d}.parquet"


def name_digits(num_partitions: int) -> int:
    """Digits of the part names of a plan: 5 up to 100,000 partitions (the names outputs
    have always had, so they resume), more beyond, so that names sort in input order."""
    return max(5, len(str(num_partitions - 1)))


def plan_partitions(files: list[InputFile], partition_rows: int) -> list[Partition]:
    assert partition_rows >= 1
    ranges = []  # (path, start, stop, first_row)
    first_row = 0
    for f in files:
        for start, stop in _file_ranges(f.row_groups, partition_rows):
            ranges.append((f.path, start, stop, first_row + start))
        first_row += f.num_rows
    digits = name_digits(len(ranges))
    return [Partition(i, *r, num_digits=digits) for i, r in enumerate(ranges)]


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
