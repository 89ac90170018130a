"""Running one resolved step: a generation job through jobs.run_job, or a transform or
python step that goes partition by partition into committed parts, resumable the same way.

A transform runs in the driver (it is light: no model); a python step's partitions run on
the Dask workers (`python_step.py`). Each partition (`partition_rows` rows at most) is
committed as one part through jobs' output protocol (`Output`), like a generation job: its
`_manifest.json` and each part's footer carry a fingerprint of the step (the transform,
or the function's reference and source hash) and its inputs, so a rerun keeps the parts
already committed.
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from fusegen.jobs import (JobError, Output, Partition, PartStats, filesystem, input_records,
                          list_input_files, output_fingerprint, plan_partitions, redact_url)
from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.part_io import part_stats, read_rows
from fusegen.workflows.resolve import ResolvedStep

log = logging.getLogger("fusegen.workflows")


@dataclass(slots=True)
class StepCounts:
    """What a step produced; the run store keeps these per step."""
    num_input_rows: int = 0
    num_rows: int = 0
    num_errors: int = 0
    errors_by_code: dict | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_parts: int = 0
    num_parts_kept: int = 0  # committed by an earlier attempt, not recomputed

    @property
    def num_parts_computed(self) -> int:
        return self.num_parts - self.num_parts_kept

    def as_dict(self) -> dict:
        d = asdict(self)
        d["errors_by_code"] = d["errors_by_code"] or {}
        return d


class Clients:
    """One Dask client at a time, kept open across generate steps with the same execution
    settings: a worker's loaded engine then serves every step that uses the same model."""

    def __init__(self):
        self._key = None
        self._stack: ExitStack | None = None
        self._client = None

    def get(self, job):
        """A client for the JobSpec's scheduler, workers and partitions_per_worker (a
        generate step's job, or a python step's cluster): the open one when they match."""
        from fusegen.jobs import open_client

        key = (job.scheduler, job.workers, job.partitions_per_worker)
        if key != self._key:
            self.close()
            self._stack = ExitStack()
            self._client = self._stack.enter_context(open_client(job))
            self._key = key
        return self._client

    def current(self, settings):
        """The open client whatever its settings (a python step loads no engine), else
        one for `settings`."""
        return self._client if self._client is not None else self.get(settings)

    def close(self):
        if self._stack is not None:
            stack, self._stack, self._client, self._key = self._stack, None, None, None
            stack.close()


RERUN_HINT = "rerun with --overwrite to recompute it, or give the step another `output:`"


def run_step(step: ResolvedStep, clients: Clients, overwrite: bool,
             input_changed: bool = False, replace_stale: bool = False,
             stale_hint: str = RERUN_HINT) -> StepCounts:
    """`input_changed`: the step it reads recomputed parts in this run, so parts this step
    committed earlier may come from another version of its input. `replace_stale`: an
    explicit `output:` made from another version of the input or step is recomputed, as
    the workflow's own outputs always are; without it the step fails, saying `stale_hint`
    (the command that recomputes it)."""
    old = None if overwrite else _manifest(step)
    why = None
    if old is not None:  # an output from an earlier run: is it still this step's?
        why = _why_stale(step, old, input_changed)
        if why and (step.in_workdir or replace_stale):
            # The workflow's own intermediate output, or --overwrite: recompute it.
            log.info("step %s: %s; recomputing it", step.name, why)
            overwrite = True
        elif why and input_changed:
            # An explicit `output:` is never discarded without --overwrite.
            raise WorkflowError(
                f"output {redact_url(step.output)} holds parts made from an earlier version "
                f"of its input (step {step.parents[0]!r} was recomputed in this run); "
                f"{stale_hint}")
    try:
        if step.job is not None:
            return _generate(step, clients, overwrite)
        return run_transform(step, overwrite, clients=clients)
    except JobError as exc:
        if why and stale_hint != RERUN_HINT:  # the job's own hint is `fusegen run`'s
            raise WorkflowError(f"{exc}; {stale_hint}") from None
        raise


def _why_stale(step: ResolvedStep, old: dict, input_changed: bool) -> str | None:
    """Why an output's earlier parts cannot be kept, or None when they can."""
    if input_changed:
        return f"step {step.parents[0]!r} recomputed parts in this run"
    if not old:
        return "its output's _manifest.json is damaged"
    if old.get("fingerprint") != _step_fingerprint(step):
        return "its definition or input changed since its output was made"
    return None


def _step_fingerprint(step: ResolvedStep) -> str:
    """The fingerprint the step will give its output."""
    inputs = input_records(list_input_files(step.input, step.storage_options))
    if step.job is not None:
        return step.job.fingerprint(inputs)
    return output_fingerprint(_part_config(step), inputs)


def _manifest(step: ResolvedStep) -> dict | None:
    return Output(step.output, step.storage_options).read_manifest()


def _generate(step: ResolvedStep, clients: Clients, overwrite: bool) -> StepCounts:
    import dataclasses

    from fusegen.jobs import run_job

    job = dataclasses.replace(step.job, overwrite=step.job.overwrite or overwrite)
    r = run_job(job, client=clients.get(job))
    return StepCounts(num_input_rows=r.num_rows, num_rows=r.num_rows, num_errors=r.num_errors,
                      errors_by_code=dict(r.errors_by_code),
                      num_prompt_tokens=r.num_prompt_tokens,
                      num_generated_tokens=r.num_generated_tokens, num_parts=r.num_parts,
                      num_parts_kept=r.num_parts_skipped)


# -- transforms and python steps ------------------------------------------------------------

def run_transform(step: ResolvedStep, overwrite: bool, after_part=None,
                  clients: Clients | None = None) -> StepCounts:
    """Stream the step's input through its transform (in this process) or its function (on
    the workers of `clients`' Dask client) into committed parts. `after_part` (tests) is
    called with each newly committed transform part's name."""
    files = list_input_files(step.input, step.storage_options)
    in_fs, _ = filesystem(step.input, step.storage_options)
    plan = plan_partitions(files, step.partition_rows)
    inputs = input_records(files)
    config = _part_config(step)
    fingerprint = output_fingerprint(config, inputs)
    output = Output(step.output, step.storage_options)
    _, done = output.prepare(fingerprint, config, plan, overwrite, inputs)  # takes the lease
    manifest = {"format": 1, "kind": step.kind, "fingerprint": fingerprint,
                "config": config, "inputs": inputs, "num_partitions": len(plan)}
    parts: dict[int, PartStats] = {}
    try:
        done = {i: stats for i, stats in done.items() if _readable(step, output, stats.name)}
        parts.update(done)
        output.start(manifest)
        todo = [part for part in plan if part.index not in done]
        if step.python is not None:
            _python_parts(step, todo, fingerprint, output, clients, parts)
        else:
            for part in todo:
                parts[part.index] = _transform_part(step, in_fs, output, part, fingerprint)
                if after_part is not None:
                    after_part(part.name)
        manifest["parts"] = [parts[p.index].as_dict() for p in plan]
        output.finish(manifest)
    except KeyboardInterrupt:
        manifest["parts"] = [parts[p.index].as_dict() for p in plan if p.index in parts]
        output.interrupt(manifest)
        raise
    finally:
        output.release()
    return StepCounts(num_input_rows=sum(f.num_rows for f in files),
                      num_rows=sum(p.num_rows for p in parts.values()),
                      num_errors=sum(p.num_errors for p in parts.values()),
                      num_parts=len(plan), num_parts_kept=len(done))


def _readable(step: ResolvedStep, output: Output, name: str) -> bool:
    """Whether a kept part reads to its end. Its footer was read already; damage inside
    its pages would otherwise fail the step that reads it, on every rerun."""
    try:
        with output.fs.open(f"{output.path}/{name}", "rb") as f:
            for _ in pq.ParquetFile(f).iter_batches():
                pass
        return True
    except (OSError, pa.ArrowException) as exc:
        log.warning("step %s: %s is damaged (%s); recomputing it", step.name, name,
                    str(exc).splitlines()[0])
        return False


def _python_parts(step, todo, fingerprint, output: Output, clients: Clients | None,
                  parts: dict[int, PartStats]) -> None:
    """A python step's partitions on the Dask workers, then its parts' columns agreed."""
    from fusegen.workflows.python_step import check_schemas, run_parts

    if todo:
        own = clients is None
        clients = clients or Clients()
        try:
            run_parts(step, todo, fingerprint, output.owner, clients.current(step.cluster),
                      parts)
        finally:
            if own:
                clients.close()
    check_schemas(step, output, sorted(p.name for p in parts.values()))


def _part_config(step: ResolvedStep) -> dict:
    what = step.python if step.python is not None else step.transform
    return {**what.config(), "partition_rows": step.partition_rows}


def _transform_part(step, in_fs, output: Output, part: Partition, fingerprint) -> PartStats:
    start = time.perf_counter()
    table = step.transform.apply(read_rows(in_fs, part))
    stats = part_stats(table, part, fingerprint, start)
    output.commit(table, stats)
    return stats
