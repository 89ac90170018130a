"""The driver: plan, check, resume, stream partitions through Dask, write the manifest.

The driver holds the plan (row ranges) and per-part counts only; rows live on workers,
at most `partitions_per_worker` partitions per worker at a time.
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import nullcontext
from dataclasses import asdict
from datetime import datetime, timezone
from itertools import islice

from fusegen.jobs.cluster import open_client
from fusegen.jobs.errors import JobError
from fusegen.jobs.manifest import (OVERWRITE, RESUME, clear_output, read_manifest, resume_mode,
                           write_manifest)
from fusegen.jobs.parts import TMP_DIR, PartStats, committed_stats, is_part_name
from fusegen.jobs.plan import Partition, plan_partitions
from fusegen.jobs.progress import JobResult, Progress
from fusegen.jobs.redact import redact_url, redacted_logging
from fusegen.jobs.rows import RowPreparer
from fusegen.jobs.spec import JobSpec
from fusegen.jobs.storage import (check_writable, filesystem, list_input_files, list_names,
                          remove_tree)
from fusegen.jobs.task import engine_stats, load_engine, run_partition

log = logging.getLogger("fusegen.jobs")


def run_job(spec: JobSpec, progress_stream=None, client=None) -> JobResult:
    """Run a job to completion (or raise JobError with a message that says what to fix).

    `client`: an open Dask client to run on instead of opening one (workflows pass the
    same client to consecutive steps, so a worker's loaded engine serves them all)."""
    redact = spec.redactor()
    with redacted_logging(redact):
        try:
            return _run(spec, progress_stream, client)
        except JobError as exc:
            raise JobError(redact(str(exc))) from None
        except Exception as exc:
            raise JobError(redact(f"{type(exc).__name__}: {exc}")) from None


def _run(spec: JobSpec, progress_stream, client=None) -> JobResult:
    started, t0 = _now(), time.perf_counter()
    files = list_input_files(spec.input, spec.storage_options)
    preparer = RowPreparer(spec)
    for f in files:  # a missing column fails here, before any model loads
        try:
            preparer.input_columns(f.columns)
        except JobError as exc:
            raise JobError(f"input file {redact_url(f.path)}: {exc}") from None
    plan = plan_partitions(files, spec.partition_rows)
    inputs = [{"path": redact_url(f.path), "num_rows": f.num_rows} for f in files]
    fingerprint = spec.fingerprint(inputs)
    out_fs, out_dir = filesystem(spec.output, spec.storage_options)
    out_dir = out_dir.rstrip("/")
    check_writable(out_fs, out_dir, spec.output)
    old, done = _prepare_output(spec, out_fs, out_dir, plan, fingerprint)
    manifest = {"format": 1, "status": "running", "fingerprint": fingerprint,
                "config": spec.public_dict(), "inputs": inputs, "num_partitions": len(plan),
                "runs": (old or {}).get("runs", [])}
    write_manifest(out_fs, out_dir, manifest)
    todo = [p for p in plan if p.index not in done]
    log.info("job %s: %d rows in %d partitions, %d to run, %d already committed",
             fingerprint, sum(f.num_rows for f in files), len(plan), len(todo), len(done))
    progress = Progress(sum(f.num_rows for f in files), sum(s.num_rows for s in done.values()),
                        spec.progress, stream=progress_stream)
    new, engines = _execute(spec, todo, fingerprint, progress, client) if todo else ({}, [])
    progress.close()
    stats = {**done, **new}
    result = _result(spec, plan, stats, new, len(done), time.perf_counter() - t0)
    manifest.update(status="complete", parts=[_part_entry(p, stats[p.index]) for p in plan],
                    totals=_totals(result))
    manifest["runs"].append({"started": started, "finished": _now(),
                             "wall_seconds": round(result.wall_seconds, 3),
                             "parts_computed": len(new), "parts_skipped": len(done),
                             "engine_stats": engines})
    write_manifest(out_fs, out_dir, manifest)
    remove_tree(out_fs, f"{out_dir}/{TMP_DIR}")
    return result


def _prepare_output(spec, fs, out_dir, plan, fingerprint) -> tuple[dict | None, dict]:
    """Decide fresh / resume / overwrite; return the old manifest and the committed parts."""
    old = read_manifest(fs, out_dir)
    names = list_names(fs, out_dir)
    has_parts = any(is_part_name(n) for n in names)
    mode = resume_mode(old, fingerprint, spec.output_config(), has_parts, spec.overwrite,
                       redact_url(spec.output))
    if mode == OVERWRITE:
        clear_output(fs, out_dir)
        return None, {}
    if TMP_DIR in names:  # leftovers of a killed run: never committed, never read
        remove_tree(fs, f"{out_dir}/{TMP_DIR}")
    return old, committed_stats(fs, out_dir, plan, fingerprint) if mode == RESUME else {}


def _execute(spec: JobSpec, todo: list[Partition], fingerprint: str,
             progress: Progress, client=None) -> tuple[dict[int, PartStats], list[dict]]:
    """Run the partitions on the cluster; returns the new parts' stats and each worker
    engine's counters."""
    run_token = uuid.uuid4().hex[:8]
    with nullcontext(client) if client is not None else open_client(spec) as client:
        # Every worker loads its engine before any partition is read: a model that cannot
        # load fails the job here, with the engine's message.
        loaded = client.gather([client.submit(load_engine, spec, workers=[w],
                                              allow_other_workers=True, pure=False,
                                              key=f"fusegen-load-{run_token}-{i}")
                                for i, w in enumerate(_workers(client))])
        if loaded:  # where the weights and the KV cache live, once per job
            progress.message("memory plan (per worker):\n" + loaded[0]["placement"])
        topic = f"fusegen-progress-{run_token}"
        client.subscribe_topic(topic, lambda event: progress.partial(
            event[1]["index"], event[1]["rows"], event[1]["tokens"]))
        try:
            results = _stream(client, spec, todo, fingerprint, topic, run_token, progress)
        finally:
            client.unsubscribe_topic(topic)
        # Not as tasks: a task pinned to a worker that died would wait forever.
        stats = client.run(engine_stats, spec, on_error="return")
    return results, [s for s in stats.values() if isinstance(s, dict)]


def _stream(client, spec, todo, fingerprint, topic, run_token, progress) -> dict[int, PartStats]:
    """Keep `partitions_per_worker` partitions per worker in flight until all committed.
    Only the partitions' descriptions travel; each task reads its own rows."""
    from distributed import as_completed

    pending, index_of, results = iter(todo), {}, {}
    running = as_completed(loop=client.loop)
    while True:
        window = spec.partitions_per_worker * max(1, len(client.scheduler_info()["workers"]))
        for part in islice(pending, max(0, window - running.count())):
            key = f"fusegen-{fingerprint}-{part.name}-{run_token}"
            index_of[key] = part.index
            running.add(client.submit(run_partition, spec, part, fingerprint, topic,
                                      pure=False, key=key))
        if running.is_empty():
            return results
        future = next(running)
        try:
            stats = future.result()
        except Exception as exc:
            unfinished = list(running.futures)
            running.clear()
            client.cancel(unfinished)
            raise _task_error(exc) from None
        index = index_of.pop(future.key)
        results[index] = stats
        progress.advance(index, stats.num_rows, stats.num_generated_tokens)
        future.release()


def _workers(client) -> list[str]:
    try:
        client.wait_for_workers(1, timeout=60)
    except TimeoutError:
        raise JobError("the Dask cluster has no workers after 60 s; start some with "
                       "`dask worker ADDRESS`") from None
    return sorted(client.scheduler_info()["workers"])


def _task_error(exc: Exception) -> JobError:
    from distributed import KilledWorker

    if isinstance(exc, KilledWorker):
        return JobError(f"a partition killed its worker repeatedly ({exc}); the worker "
                        "probably ran out of memory: lower --partition-rows or "
                        "--partitions-per-worker, or give workers more memory")
    if isinstance(exc, JobError):
        return exc
    return JobError(f"{type(exc).__name__}: {exc}")


def _result(spec, plan, stats, new, num_skipped, wall) -> JobResult:
    codes: dict[str, int] = {}
    for s in stats.values():
        for code, n in s.errors_by_code.items():
            codes[code] = codes.get(code, 0) + n
    return JobResult(
        output=redact_url(spec.output), num_rows=sum(s.num_rows for s in stats.values()),
        num_errors=sum(s.num_errors for s in stats.values()), errors_by_code=codes,
        num_prompt_tokens=sum(s.num_prompt_tokens for s in stats.values()),
        num_generated_tokens=sum(s.num_generated_tokens for s in stats.values()),
        num_parts=len(plan), num_parts_skipped=num_skipped,
        rows_computed=sum(s.num_rows for s in new.values()),
        tokens_computed=sum(s.num_generated_tokens for s in new.values()), wall_seconds=wall)


def _part_entry(part: Partition, stats: PartStats) -> dict:
    counts = {k: v for k, v in asdict(stats).items() if k not in ("name", "fingerprint")}
    return {"name": part.name, "input": redact_url(part.path),
            "input_rows": [part.start, part.stop], **counts}


def _totals(r: JobResult) -> dict:
    return {k: getattr(r, k) for k in ("num_rows", "num_errors", "errors_by_code",
                                       "num_prompt_tokens", "num_generated_tokens")}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
