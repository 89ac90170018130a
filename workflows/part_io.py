"""One partition of a step's input read, and the part it becomes described: shared by
transform steps (in the driver) and python steps (on the workers)."""
from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.compute as pc

from fusegen.jobs import Partition, PartStats, read_partition, redact_url
from fusegen.workflows.errors import WorkflowError


def read_rows(in_fs, part: Partition) -> pa.Table:
    try:
        return read_partition(in_fs, part)
    except (OSError, pa.ArrowException) as exc:
        raise WorkflowError(
            f"cannot read rows {part.start}-{part.stop - 1} of {redact_url(part.path)}: "
            f"{str(exc).splitlines()[0]}; if it is a part of an earlier step's output, "
            "delete that part and rerun: the step recomputes it") from None


def part_stats(table: pa.Table, part: Partition, fingerprint: str, started: float) -> PartStats:
    """The committed part's footer record; `started`: time.perf_counter() before the read."""
    errors = 0
    if "error" in table.column_names:
        errors = pc.count(table.column("error")).as_py()  # non-null: error rows
    return PartStats(part.name, fingerprint, num_rows=table.num_rows, num_errors=errors,
                     seconds=round(time.perf_counter() - started, 3),
                     num_input_rows=part.num_rows)


def describe(step: str, part: Partition) -> str:
    """A partition as messages name it."""
    return (f"step {step!r}, {part.name} (rows {part.start}-{part.stop - 1} of "
            f"{redact_url(part.path)})")
