"""The driver: plan, check, resume, stream partitions through Dask, write the manifest.

The driver holds the plan (row ranges) and per-part counts only; rows live on workers,
at most `partitions_per_worker` partitions per worker at a time.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import islice

from fusegen.jobs.cluster import engine_devices, open_client
from fusegen.jobs.error_rate import ErrorRate, errors_by_code
from fusegen.jobs.errors import ErrorRateExceeded, JobError
from fusegen.jobs.formats import is_batch_input, part_suffix
from fusegen.jobs.interrupt import JobInterrupted, signal_of
from fusegen.jobs.output import Output, PartStats, input_records
from fusegen.jobs.plan import Partition, plan_partitions
from fusegen.jobs.preflight import check_job_options
from fusegen.jobs.progress import JobResult, Progress
from fusegen.jobs.redact import redact_url, redacted_logging
from fusegen.jobs.report import write_report
from fusegen.jobs.rows import RowPreparer
from fusegen.jobs.spec import JobSpec
from fusegen.jobs.shared_paths import absolute_url, check_shared_storage
from fusegen.jobs.storage import list_input_files
from fusegen.jobs.task import engine_stats, load_engine, progress_topic, run_partition

log = logging.getLogger("fusegen.jobs")


# What a failed run's manifest says resumes it when the caller names no command.
RERUN = "rerun the same job (same options, same output, without --overwrite)"


def run_job(spec: JobSpec, progress_stream=None, client=None,
            resume: str | None = None) -> JobResult:
    """Run a job to completion (or raise JobError with a message that says what to fix).

    `client`: an open Dask client to run on instead of opening one (workflows pass the
    same client to consecutive steps, so a worker's loaded engine serves them all).
    On Ctrl-C or SIGTERM (`jobs/interrupt.py`) raises JobInterrupted: the manifest then
    says "interrupted", and rerunning the job resumes it. A run that fails once its
    manifest is written leaves it "failed", with the error and `resume`: the command that
    resumes the job (credentials masked), or what to do."""
    redact = spec.redactor()
    with redacted_logging(redact):
        try:
            return _run(spec, progress_stream, client, redact(resume or RERUN))
        except JobInterrupted:
            raise
        except KeyboardInterrupt as exc:  # before the output was touched
            raise JobInterrupted(signal_of(exc), redact_url(spec.output)) from None
        except ErrorRateExceeded as exc:  # its own kind: the caller offers the resume
            raise ErrorRateExceeded(_message(exc, redact)) from None
        except Exception as exc:
            raise JobError(_message(exc, redact)) from None


def _message(exc: Exception, redact) -> str:
    """An error as the user reads it, credentials masked."""
    return redact(str(exc) if isinstance(exc, JobError) else f"{type(exc).__name__}: {exc}")


def _run(spec: JobSpec, progress_stream, client=None, resume: str = RERUN) -> JobResult:
    started, t0 = _now(), time.perf_counter()
    spec = _reachable(spec)
    files = list_input_files(spec.input, spec.storage_options)
    preparer = RowPreparer(spec)
    # A missing column fails here, before any model loads (a batch file has no columns:
    # its lines are requests, `jobs/openai_batch.py`).
    columned = [] if is_batch_input(files) else files
    for f in columned:
        try:
            preparer.input_columns(f.columns)
        except JobError as exc:
            raise JobError(f"input file {redact_url(f.path)}: {exc}") from None
    for warning in dict.fromkeys(w for f in columned
                                 for w in preparer.column_warnings(f.columns)):
        log.warning("%s", warning)
    plan = plan_partitions(files, spec.partition_rows, part_suffix(files, spec.output_format))
    # Job-wide options that would fail every row fail the job here, before the model loads.
    check_job_options(spec, preparer, plan, columned)
    inputs = input_records(files)
    identity = spec.identity()  # once: the workers run the dtype resolved here
    fingerprint = spec.fingerprint(inputs, identity)
    output = Output(spec.output, spec.storage_options)
    # The lease first: nothing (manifest, parts) is read or written without it.
    old, done = output.prepare(fingerprint, spec.output_config(), plan, spec.overwrite, inputs,
                               identity)
    run = _Run(spec, plan, output, started, t0, done, manifest={
        "format": 1, "fingerprint": fingerprint, "config": spec.public_dict(),
        **identity.manifest_fields(), "inputs": inputs, "num_partitions": len(plan),
        "runs": (old or {}).get("runs", [])})
    if output.earlier_fingerprint:
        run.manifest["earlier_fingerprint"] = output.earlier_fingerprint
    try:
        output.start(run.manifest)
        todo = [p for p in plan if p.index not in done]
        log.info("job %s: %d rows in %d partitions, %d to run, %d already committed; "
                 "dtype %s", fingerprint, sum(f.num_rows for f in files), len(plan),
                 len(todo), len(done), identity.dtype)
        if spec.scheduler and spec.engine.device == "auto" and spec.engine.dtype == "auto":
            log.info("dtype auto resolved to %s on this machine; pass --dtype to choose "
                     "another for the cluster's workers", identity.dtype)
        progress = Progress(sum(f.num_rows for f in files),
                            sum(s.num_rows for s in done.values()), spec.progress,
                            stream=progress_stream)
        errors = ErrorRate(spec.max_error_rate, len(plan), kept=list(done.values()))
        try:
            engines = _execute(spec.on_workers(identity), todo, fingerprint, output.owner,
                               progress, run.new, errors, client) if todo else []
        finally:
            progress.close()
        result = run.complete(engines, progress.timeline)
        if spec.report:
            write_report(spec, result, run.manifest)
        return result
    except KeyboardInterrupt as exc:
        raise run.interrupted(signal_of(exc)) from None
    except Exception as exc:
        run.failed(_message(exc, spec.redactor()), resume)
        raise
    finally:
        output.release()


@dataclass(slots=True)
class _Run:
    """One run of a job over its output, and what its manifest records at the end."""
    spec: JobSpec
    plan: list[Partition]
    output: Output
    started: str
    t0: float  # perf_counter at the start
    done: dict[int, PartStats]  # committed before this run
    manifest: dict
    new: dict[int, PartStats] = field(default_factory=dict)  # filled as parts commit

    def complete(self, engines: list[dict], timeline: list) -> JobResult:
        stats = {**self.done, **self.new}
        result = _result(self.spec, self.plan, stats, self.new, len(self.done),
                          time.perf_counter() - self.t0)
        result.timeline = timeline
        result.prompt_tokens_cached = sum(e.get("prompt_tokens_cached", 0) for e in engines)
        self.manifest.update(parts=[_part_entry(p, stats[p.index]) for p in self.plan],
                             totals=_totals(result))
        self._record(len(self.new), engines, "complete")
        self.output.finish(self.manifest)
        return result

    def interrupted(self, signum: int) -> JobInterrupted:
        """Record what is committed, parts that committed while the driver was stopping
        (not yet reported to it) included; the manifest says "interrupted"."""
        stats = self._committed()
        self._record(len(stats) - len(self.done), [], "interrupted")
        self.output.interrupt(self.manifest)
        return JobInterrupted(signum, redact_url(self.spec.output), len(stats), len(self.plan))

    def failed(self, error: str, resume: str) -> None:
        """Record what is committed and the error; the manifest says "failed". A manifest
        that cannot be written (the lease lost, the store gone) leaves the error to the
        caller as it was."""
        if self.manifest.get("status") == "complete":  # failed after it finished
            return
        try:
            stats = self._committed()
            self._record(len(stats) - len(self.done), [], "failed", error=error)
            self.output.fail(self.manifest, error, resume)
        except Exception as exc:  # noqa: BLE001 - the job's own error is the one to report
            log.warning("could not mark %s failed: %s", redact_url(self.spec.output),
                        self.spec.redactor()(str(exc)))

    def _committed(self) -> dict[int, PartStats]:
        """Every committed part, those committed while the driver was stopping (not yet
        reported to it) included; the manifest lists them."""
        stats = {**self.done, **self.new}
        unheard = [p for p in self.plan if p.index not in stats]
        stats.update(self.output.committed(unheard, self.manifest["fingerprint"]))
        self.manifest["parts"] = [_part_entry(p, stats[p.index]) for p in self.plan
                                  if p.index in stats]
        return stats

    def _record(self, num_computed: int, engines: list[dict], status: str,
                **extra) -> None:
        self.manifest["runs"].append({
            "started": self.started, "finished": _now(),
            "wall_seconds": round(time.perf_counter() - self.t0, 3),
            "parts_computed": num_computed, "parts_skipped": len(self.done),
            "engine_stats": engines, "status": status, **extra})


def _reachable(spec: JobSpec) -> JobSpec:
    """The spec with local input and output paths absolute (a worker resolves a relative
    one against its own working directory); refuses paths its workers cannot reach
    (`jobs/shared_paths.py`)."""
    spec = dataclasses.replace(spec, input=absolute_url(spec.input, spec.storage_options),
                               output=absolute_url(spec.output, spec.storage_options))
    check_shared_storage(spec.input, spec.output, spec.storage_options, spec.scheduler,
                         spec.workers)
    return spec


def _execute(spec: JobSpec, todo: list[Partition], fingerprint: str, owner: str,
             progress: Progress, results: dict[int, PartStats], errors: ErrorRate,
             client=None) -> list[dict]:
    """Run the partitions on the cluster, adding each committed part's stats to `results`
    (`errors` judges them: it stops the job past max_error_rate); returns each worker
    engine's counters for this job. `owner`: the run's lease, which every commit checks."""
    run_token = uuid.uuid4().hex[:8]
    with nullcontext(client) if client is not None else open_client(spec) as client:
        # Every worker loads its engine before any partition is read: a model that cannot
        # load fails the job here, with the engine's message.
        devices = engine_devices(spec, _workers(client))
        loaded = client.gather([client.submit(load_engine, spec, device, run_token,
                                              workers=[w], allow_other_workers=True, pure=False,
                                              key=f"fusegen-load-{run_token}-{i}")
                                for i, (w, device) in enumerate(devices.items())])
        fresh = [e for e in loaded if e["loaded"]]
        if fresh:  # where the weights and the KV cache live; not again for a reused engine
            progress.message("memory plan (per worker):\n" + fresh[0]["placement"])
        progress.begin()
        topic = progress_topic(run_token)
        client.subscribe_topic(topic, lambda event: progress.partial(**event[1]))
        parts_of = {}  # task key -> its partition's name, for a worker that dies
        client.subscribe_topic("all", lambda event: _worker_left(event[1], parts_of))
        try:
            _stream(client, spec, todo, fingerprint, owner, run_token, progress, results,
                    errors, parts_of)
        finally:
            client.unsubscribe_topic(topic)
            client.unsubscribe_topic("all")
        # Not as tasks: a task pinned to a worker that died would wait forever.
        stats = client.run(engine_stats, spec, run_token, on_error="return")
    return [s for s in stats.values() if isinstance(s, dict)]


def _stream(client, spec, todo, fingerprint, owner, run_token, progress, results, errors,
            parts_of):
    """Keep `partitions_per_worker` partitions per worker in flight until all committed.
    Only the partitions' descriptions travel; each task reads its own rows. `parts_of`:
    filled with each task's key -> its partition's name."""
    from distributed import as_completed

    pending, index_of = iter(todo), {}
    parts, retries = {p.index: p for p in todo}, {}
    running = as_completed(loop=client.loop)
    try:
        while True:
            window = spec.partitions_per_worker * max(1, len(client.scheduler_info()["workers"]))
            for part in islice(pending, max(0, window - running.count())):
                key = f"fusegen-{fingerprint}-{part.name}-{run_token}"
                index_of[key], parts_of[key] = part.index, part.name
                running.add(client.submit(run_partition, spec, part, fingerprint, run_token,
                                          owner, pure=False, key=key))
            if running.is_empty():
                return
            future = next(running)
            try:
                stats = future.result()
            except Exception as exc:
                error = _task_error(exc)
                part = parts.get(index_of.get(future.key))
                if part is None or not _retry(error, part, retries):
                    raise error from None
                index_of.pop(future.key)
                progress.message(f"{part.name}: {error}; retrying it on a fresh engine "
                                 f"(retry {retries[part.index]} of {GROUP_RETRIES})")
                key = f"fusegen-{fingerprint}-{part.name}-{run_token}-r{retries[part.index]}"
                index_of[key], parts_of[key] = part.index, part.name
                running.add(client.submit(run_partition, spec, part, fingerprint, run_token,
                                          owner, pure=False, key=key))
                continue
            index = index_of.pop(future.key)
            results[index] = stats
            progress.advance(index, stats.rows_read, stats.num_generated_tokens,
                             stats.num_errors)
            future.release()
            errors.check(results.values())
    except BaseException:  # a failed part or an interrupt: stop the rest
        unfinished = list(running.futures)
        running.clear()
        client.cancel(unfinished)
        raise


def _worker_left(event: dict, parts_of: dict[str, str]) -> None:
    """Name a worker that left the cluster while it ran (or held queued) partitions of
    this job, or held finished ones whose results the driver had not collected yet: the
    scheduler's "remove-worker" event. Dask runs those partitions again on the other
    workers; their parts are written only when they complete."""
    if event.get("action") != "remove-worker":
        return
    keys = [*event.get("processing-tasks", ()), *event.get("lost-computed-tasks", ())]
    names = sorted({parts_of[key] for key in keys if key in parts_of})
    if names:
        how = "was retired" if event.get("expected") else "died"
        log.warning("worker %s %s while running %s; Dask retries %s on the other workers",
                    event.get("worker"), how, ", ".join(names),
                    "it" if len(names) == 1 else "them")


# A partition whose engine's device group died (a rank crashed or stopped answering) runs
# again on a fresh engine this many times before the job fails; its part is written only
# when it completes, so a retry never doubles a row.
GROUP_RETRIES = 2


def _retry(error: JobError, part: Partition, retries: dict[int, int]) -> bool:
    if "device_group_failed" not in str(error) or retries.get(part.index, 0) >= GROUP_RETRIES:
        return False
    retries[part.index] = retries.get(part.index, 0) + 1
    return True


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
    return JobResult(
        output=redact_url(spec.output), num_rows=sum(s.num_rows for s in stats.values()),
        num_errors=sum(s.num_errors for s in stats.values()),
        errors_by_code=errors_by_code(stats.values()),
        num_truncated=sum(s.num_truncated or 0 for s in stats.values()),
        num_structured_invalid=sum(s.num_structured_invalid or 0 for s in stats.values()),
        num_prompt_tokens=sum(s.num_prompt_tokens for s in stats.values()),
        num_generated_tokens=sum(s.num_generated_tokens for s in stats.values()),
        num_parts=len(plan), num_parts_skipped=num_skipped,
        rows_computed=sum(s.num_rows for s in new.values()),
        tokens_computed=sum(s.num_generated_tokens for s in new.values()), wall_seconds=wall)


def _part_entry(part: Partition, stats: PartStats) -> dict:
    counts = {k: v for k, v in stats.as_dict().items() if k not in ("name", "fingerprint")}
    return {"name": part.name, "input": redact_url(part.path),
            "input_rows": [part.start, part.stop], **counts}


def _totals(r: JobResult) -> dict:
    return {k: getattr(r, k) for k in ("num_rows", "num_errors", "errors_by_code",
                                       "num_truncated", "num_structured_invalid",
                                       "num_prompt_tokens", "num_generated_tokens",
                                       "prompt_tokens_cached")}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
