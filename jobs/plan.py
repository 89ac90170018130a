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

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    @property
    def name(self) -> str:
        return part_name(self.index)


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def plan_partitions(files: list[InputFile], partition_rows: int) -> list[Partition]:
    assert partition_rows >= 1
    ranges = []  # (path, start, stop, first_row)
    first_row = 0
    for f in files:
        for start, stop in _file_ranges(f.row_groups, partition_rows):
            ranges.append((f.path, start, stop, first_row + start))
        first_row += f.num_rows
    return [Partition(i, *r) for i, r in enumerate(ranges)]


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
