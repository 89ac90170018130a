"""Running one resolved step: a generation job through jobs.run_job, or a transform that
streams partition by partition into committed parts, resumable the same way.

A transform runs in the driver (it is light: no model). It reads one partition at a time
(`partition_rows` rows at most), writes it as one part under a temporary name and commits
it by a rename; its `_manifest.json` and each part's footer carry a fingerprint of the
transform and its inputs, so a rerun keeps the parts already committed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass

import pyarrow.compute as pc
import pyarrow.parquet as pq

from fusegen.jobs.manifest import OVERWRITE, RESUME, clear_output, read_manifest, resume_mode, \
    write_manifest
from fusegen.jobs.parts import TMP_DIR, is_part_name, write_part
from fusegen.jobs.plan import Partition, plan_partitions
from fusegen.jobs.redact import redact_url
from fusegen.jobs.storage import check_writable, filesystem, list_input_files, list_names, \
    read_partition, remove_tree
from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.resolve import ResolvedStep

log = logging.getLogger("fusegen.workflows")
_META_KEY = b"fusegen"


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
        from fusegen.jobs.cluster import open_client

        key = (job.scheduler, job.workers, job.partitions_per_worker)
        if key != self._key:
            self.close()
            self._stack = ExitStack()
            self._client = self._stack.enter_context(open_client(job))
            self._key = key
        return self._client

    def close(self):
        if self._stack is not None:
            stack, self._stack, self._client, self._key = self._stack, None, None, None
            stack.close()


def run_step(step: ResolvedStep, clients: Clients, overwrite: bool,
             input_changed: bool = False) -> StepCounts:
    """`input_changed`: the step it reads recomputed parts in this run, so parts this step
    committed earlier may come from another version of its input."""
    if not overwrite and step.in_workdir and (input_changed or _holds_another_job(step)):
        # The workflow's own intermediate output, made from an earlier input or version
        # of the file: recompute it.
        log.info("step %s: its input or definition changed since its output was made; "
                 "recomputing it", step.name)
        overwrite = True
    elif not overwrite and input_changed and _manifest(step) is not None:
        # An explicit `output:` is never discarded without --overwrite.
        raise WorkflowError(
            f"output {redact_url(step.output)} holds parts made from an earlier version of "
            f"its input (step {step.parents[0]!r} was recomputed in this run); rerun with "
            "--overwrite to recompute it, or give the step another `output:`")
    if step.job is not None:
        return _generate(step, clients, overwrite)
    return run_transform(step, overwrite)


def output_fingerprint(step: ResolvedStep) -> str:
    """The fingerprint the step's job will give its output (jobs' for generate steps)."""
    files = list_input_files(step.input, step.storage_options)
    inputs = [{"path": redact_url(f.path), "num_rows": f.num_rows} for f in files]
    if step.job is not None:
        return step.job.fingerprint(inputs)
    return _transform_fingerprint(_transform_config(step), inputs)


def _manifest(step: ResolvedStep) -> dict | None:
    fs, out_dir = filesystem(step.output, step.storage_options)
    return read_manifest(fs, out_dir.rstrip("/"))


def _holds_another_job(step: ResolvedStep) -> bool:
    old = _manifest(step)
    return old is not None and old.get("fingerprint") != output_fingerprint(step)


def _generate(step: ResolvedStep, clients: Clients, overwrite: bool) -> StepCounts:
    import dataclasses

    from fusegen.jobs.runner import run_job

    job = dataclasses.replace(step.job, overwrite=step.job.overwrite or overwrite)
    r = run_job(job, client=clients.get(job))
    return StepCounts(num_input_rows=r.num_rows, num_rows=r.num_rows, num_errors=r.num_errors,
                      errors_by_code=dict(r.errors_by_code),
                      num_prompt_tokens=r.num_prompt_tokens,
                      num_generated_tokens=r.num_generated_tokens, num_parts=r.num_parts,
                      num_parts_kept=r.num_parts_skipped)


# -- transforms -----------------------------------------------------------------------------

@dataclass(slots=True)
class TransformPart:
    """A committed transform part, as recorded in its footer and the manifest."""
    name: str
    fingerprint: str
    num_input_rows: int
    num_rows: int
    num_errors: int = 0
    seconds: float = 0.0


def run_transform(step: ResolvedStep, overwrite: bool, after_part=None) -> StepCounts:
    """Stream the step's input through its transform into committed parts. `after_part`
    (tests) is called with each newly committed part's name."""
    so = step.storage_options
    files = list_input_files(step.input, so)
    in_fs, _ = filesystem(step.input, so)
    plan = plan_partitions(files, step.partition_rows)
    inputs = [{"path": redact_url(f.path), "num_rows": f.num_rows} for f in files]
    config = _transform_config(step)
    fingerprint = _transform_fingerprint(config, inputs)
    out_fs, out_dir = filesystem(step.output, so)
    out_dir = out_dir.rstrip("/")
    check_writable(out_fs, out_dir, redact_url(step.output))
    old = read_manifest(out_fs, out_dir)
    names = list_names(out_fs, out_dir)
    mode = resume_mode(old, fingerprint, config, any(is_part_name(n) for n in names),
                       overwrite, redact_url(step.output))
    done: dict[int, TransformPart] = {}
    if mode == OVERWRITE:
        clear_output(out_fs, out_dir)
    else:
        if TMP_DIR in names:
            remove_tree(out_fs, f"{out_dir}/{TMP_DIR}")
        if mode == RESUME:
            done = _committed(out_fs, out_dir, plan, fingerprint)
    manifest = {"format": 1, "kind": "transform", "status": "running",
                "fingerprint": fingerprint, "config": config, "inputs": inputs,
                "num_partitions": len(plan)}
    write_manifest(out_fs, out_dir, manifest)
    parts = dict(done)
    for part in plan:
        if part.index not in done:
            parts[part.index] = _transform_part(step, in_fs, out_fs, out_dir, part, fingerprint)
            if after_part is not None:
                after_part(part.name)
    manifest.update(status="complete", parts=[asdict(parts[p.index]) for p in plan])
    write_manifest(out_fs, out_dir, manifest)
    remove_tree(out_fs, f"{out_dir}/{TMP_DIR}")
    return StepCounts(num_input_rows=sum(f.num_rows for f in files),
                      num_rows=sum(p.num_rows for p in parts.values()),
                      num_errors=sum(p.num_errors for p in parts.values()),
                      num_parts=len(plan), num_parts_kept=len(done))


def _transform_config(step: ResolvedStep) -> dict:
    return {**step.transform.config(), "partition_rows": step.partition_rows}


def _transform_fingerprint(config: dict, inputs: list) -> str:
    return hashlib.sha256(json.dumps([config, inputs], sort_keys=True).encode()).hexdigest()[:16]


def _transform_part(step, in_fs, out_fs, out_dir, part: Partition, fingerprint) -> TransformPart:
    start = time.perf_counter()
    table = step.transform.apply(read_partition(in_fs, part))
    errors = 0
    if "error" in table.column_names:
        errors = pc.count(table.column("error")).as_py()  # non-null: error rows
    stats = TransformPart(part.name, fingerprint, part.num_rows, table.num_rows, errors,
                          round(time.perf_counter() - start, 3))
    write_part(out_fs, out_dir, table, stats)
    return stats


def _committed(fs, out_dir: str, plan: list[Partition], fingerprint: str) -> dict:
    """index -> TransformPart of the parts a previous attempt of this transform committed."""
    existing = list_names(fs, out_dir)
    done = {}
    for part in plan:
        if part.name not in existing:
            continue
        with fs.open(f"{out_dir}/{part.name}", "rb") as f:
            md = pq.ParquetFile(f).metadata
        raw = (md.metadata or {}).get(_META_KEY)
        try:
            stats = TransformPart(**json.loads(raw)) if raw else None
        except (TypeError, ValueError):
            stats = None  # another writer's part: recompute it
        if stats and stats.fingerprint == fingerprint and stats.num_input_rows == part.num_rows \
                and md.num_rows == stats.num_rows:
            done[part.index] = stats
    return done
