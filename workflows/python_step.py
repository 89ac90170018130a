"""A python step's partitions, run on the Dask workers (like Ray Data's `map_batches`).

    clean:
      from: draft
      python: cleaners:strip_markup   # cleaners.py beside the workflow file, or installed
      format: pandas                  # default arrow: the function gets a pyarrow Table

Only each partition's description travels: a task reads its rows, applies the function,
checks what it returned (a table, with every column the steps reading this one need) and
commits the part itself through jobs' `Output` under the lease the driver took, as a
generation job's tasks do. The driver keeps the rest of the protocol (`steps.py`:
prepare, start, finish), so a rerun keeps every committed part and a part is committed
once, whole, or not at all.
"""
from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from fusegen.jobs import Output, Partition, PartStats, filesystem
from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.part_io import describe, part_stats, read_rows
from fusegen.workflows.resolve import ResolvedStep, step_problems


def run_parts(step: ResolvedStep, todo: list[Partition], fingerprint: str, owner: str,
              client, parts: dict[int, PartStats]) -> None:
    """Run `todo` on the cluster, adding each committed part's stats to `parts`; the first
    failed partition cancels the rest and raises its error."""
    from distributed import KilledWorker, as_completed

    token = uuid.uuid4().hex[:8]
    futures = {client.submit(run_part, step, part, fingerprint, owner, pure=False,
                             key=f"fusegen-python-{step.name}-{part.name}-{token}"): part
               for part in todo}
    try:
        for future in as_completed(futures):
            try:
                parts[futures[future].index] = future.result()
            except KilledWorker:
                raise WorkflowError(
                    f"{describe(step.name, futures[future])}: {step.python.ref} killed its "
                    "worker each time it ran (out of memory?); lower the step's "
                    "partition_rows or give the workers more memory") from None
            future.release()
    except BaseException:
        client.cancel(list(futures))
        raise


def run_part(step: ResolvedStep, part: Partition, fingerprint: str, owner: str) -> PartStats:
    """One partition, on a worker: read, apply, check, commit; its PartStats."""
    started = time.perf_counter()
    fn = step.python.load(step.name)
    in_fs, _ = filesystem(step.input, step.storage_options)
    where = describe(step.name, part)
    table = step.python.apply(fn, read_rows(in_fs, part), where)
    _check_readers(step, table, where)
    stats = part_stats(table, part, fingerprint, started)
    Output(step.output, step.storage_options, owner).commit(table, stats)
    return stats


def _check_readers(step: ResolvedStep, table: pa.Table, where: str) -> None:
    """The columns the steps reading this one need, checked before the part commits."""
    origin = f"the table {step.python.ref} returned"
    problems = [p for reader in step.readers
                for p in step_problems(reader, table.column_names, origin)]
    if problems:
        raise WorkflowError(f"{where}: " + "; ".join(map(str, problems)))


def check_schemas(step: ResolvedStep, output: Output, names: list[str]) -> None:
    """Every part's columns unify (as the next step and any reader of the dataset need);
    else WorkflowError naming the first part that disagrees with those before it."""
    schemas = []
    for name in names:
        with output.fs.open(f"{output.path}/{name}", "rb") as f:
            schemas.append(pq.read_schema(f).remove_metadata())
        try:
            pa.unify_schemas(schemas)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise WorkflowError(
                f"step {step.name!r}: {step.python.ref} returned other columns or types for "
                f"{name} than for {names[0]} ({str(exc).splitlines()[0]}); return the same "
                "columns and types for every partition (editing the function reruns the "
                "step)") from None
