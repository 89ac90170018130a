"""The Dask tasks: what runs on a worker. Each returns small plain data (never rows), so
the driver holds counts only, whatever the dataset size."""
from __future__ import annotations

import time
from concurrent.futures import wait

from fusegen.engine.errors import DeviceGroupError
from fusegen.engine.llm_engine import stats_since
from fusegen.jobs.engines import (drop_engine, get_engine, job_start, job_started,
                                  loaded_engine, set_worker_device)
from fusegen.jobs.errors import JobError
from fusegen.jobs.formats import OPENAI_BATCH, mark_line_errors
from fusegen.jobs.openai_batch import run_batch_partition
from fusegen.jobs.output import Output, PartStats
from fusegen.jobs.parts import OutputShape, output_table, part_stats
from fusegen.jobs.plan import Partition
from fusegen.jobs.rows import RowPreparer
from fusegen.jobs.spec import JobSpec
from fusegen.jobs.storage import filesystem, read_partition


def progress_topic(job: str) -> str:
    """The Dask event topic on which job `job`'s partitions report their progress."""
    return f"fusegen-progress-{job}"


def load_engine(spec: JobSpec, device: str | None = None, job: str | None = None) -> dict:
    """Load (or find) this worker's engine before any partition runs; fail early if the
    model cannot load or the job needs a chat template the tokenizer lacks. `device`: the
    one the driver assigned this worker; its partitions' engine lookups then find it.
    `job`: the run's token; the engine's counters now are where this job's start."""
    if device is not None:
        set_worker_device(spec.engine.device, device)
    loads = loaded_engine(spec.model, spec.engine_kwargs()) is None
    llm = _guard(spec, "loading the model", lambda: get_engine(spec.model, spec.engine_kwargs()))
    if job is not None:
        job_start(job, llm)
    if spec.chat or spec.messages_column:
        if not spec.chat_template and not getattr(llm.tokenizer, "chat_template", None):
            flag = "--messages-column" if spec.messages_column else "--chat"
            raise JobError(f"{flag} needs a chat template, but {spec.model} has none in its "
                           f"{llm.tokenizer.template_home}; drop {flag} and use --prompt-column or "
                           "--prompt-template, or pass --chat-template")
        # A template that cannot render a plain user turn would fail every row: fail once.
        _guard(spec, "the chat template",
               lambda: _chat_ids(llm, [{"role": "user", "content": "hello"}],
                                 spec.chat_template))
    # loaded: False when an earlier job's engine serves this one (its plan was shown then)
    return {"max_model_len": llm.max_model_len, "placement": llm.placement.table(),
            "loaded": loads}


def engine_stats(spec: JobSpec, job: str | None = None) -> dict | None:
    """The worker engine's counters (steps, mean running batch, prompt and generated
    tokens...) for job `job` alone: since the job first used this engine, not since it
    loaded (a persistent worker's engine served earlier jobs). None where this worker ran
    none of the job (no engine, or another job's)."""
    llm = loaded_engine(spec.model, spec.engine_kwargs())
    start = None if llm is None or job is None else job_started(job, llm)
    if llm is None or (job is not None and start is None):
        return None
    stats = llm.stats() if start is None else stats_since(start, llm.stats())
    # model_path: the files the model's name resolved to here (a hub id: its snapshot).
    return {**stats, "memory": llm.memory_report(), "model_path": llm.config.model}


def run_partition(spec: JobSpec, part: Partition, fingerprint: str, job: str | None = None,
                  owner: str | None = None) -> PartStats:
    """Read one partition, generate every row through the worker's engine, commit its part
    (only while the run `owner` holds the output's lease). While it runs, the part's rows
    done so far and the engine's load and tokens generated for job `job` go to the Dask
    event `progress_topic(job)` about once a second."""
    return _guard(spec, f"{part.name} ({part.path} rows {part.start}-{part.stop})",
                  lambda: _run_partition(spec, part, fingerprint, job, owner))


def _run_partition(spec: JobSpec, part: Partition, fingerprint: str,
                   job: str | None, owner: str | None) -> PartStats:
    start = time.perf_counter()
    llm = get_engine(spec.model, spec.engine_kwargs())
    in_fs, _ = filesystem(spec.input, spec.storage_options)
    line_errors = {}  # JSONL / CSV lines that could not be read: error rows
    table = read_partition(in_fs, part, line_errors)
    if part.text is not None and part.text.format == OPENAI_BATCH:
        return run_batch_partition(
            spec, part, llm, table, fingerprint, owner, lambda futures, rejected: _wait(
                futures, _reporter(job, part.index, llm, rejected)), start)
    preparer = RowPreparer(spec, chat=lambda messages: _chat_ids(llm, messages,
                                                                 spec.chat_template),
                           prompt_limit=llm.prompt_limit)
    requests = mark_line_errors(preparer.prepare(table, part.first_row), line_errors)
    valid = [r for r in requests if r.error is None]
    futures = llm.submit_many([(r.prompt, r.params) for r in valid])
    report = _reporter(job, part.index, llm, len(requests) - len(valid))
    results = iter(_wait(futures, report))
    outputs = [None if r.error else next(results) for r in requests]
    table = output_table(table, requests, outputs, spec.output_token_ids,
                         output_shape(spec, preparer, table.column_names, part.first_row))
    stats = part_stats(table, part.name, fingerprint, time.perf_counter() - start)
    Output(spec.output, spec.storage_options, owner=owner).commit(table, stats)
    return stats


def output_shape(spec: JobSpec, preparer: RowPreparer, columns, first_row: int) -> OutputShape:
    """The optional output columns of a part read from a file with these columns."""
    params = set(preparer.parameters(columns))
    return OutputShape(
        token_ids=spec.output_token_ids, row_ids=preparer.id_column(columns) is None,
        logprobs=spec.sampling.logprobs is not None or "logprobs" in params,
        prompt_logprobs=spec.sampling.prompt_logprobs is not None or "prompt_logprobs" in params,
        structured=preparer.constrained(columns), first_row=first_row,
        openai_logprobs=spec.output_format == "jsonl")


def _wait(futures: list, report, every: float = 1.0) -> list:
    """The futures' results in order; meanwhile report(done) with the finished ones, and
    once more when all are (the engine's load as the part ends, so the driver's line
    does not keep showing this part's requests running)."""
    while True:
        done, pending = wait(futures, timeout=every)
        if not pending:
            results = [f.result() for f in futures]
            report(results)
            return results
        report([f.result() for f in done])


def _reporter(job: str | None, index: int, llm, num_rejected: int):
    """Sends the part's finished rows, their tokens and errors so far, and the engine's
    load with the tokens it generated for this job (running requests' included: a long
    generation counts before any row finishes), to the driver's progress line.
    `num_rejected`: rows that failed before the engine."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:  # not on a Dask worker
        worker = None
    if job is None or worker is None:
        return lambda done: None
    start = job_start(job, llm).get("num_generated_tokens", 0)
    topic = progress_topic(job)

    def report(done: list) -> None:
        engine = llm.engine_load()
        if engine is not None:
            engine = {**engine, "num_generated_tokens": engine["num_generated_tokens"] - start}
        worker.log_event(topic, {
            "index": index, "rows": len(done) + num_rejected,
            "tokens": sum(o.num_generated_tokens for o in done),
            "errors": num_rejected + sum(o.error is not None for o in done),
            "worker": worker.address, "engine": engine})
    return report


def _chat_ids(llm, messages, chat_template: str | None = None) -> list[int]:
    return llm.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                     chat_template=chat_template)


def _guard(spec: JobSpec, what: str, fn):
    """Run fn; turn any failure into a JobError with credentials redacted, so neither the
    driver nor Dask's worker logs ever see a secret."""
    try:
        return fn()
    except DeviceGroupError as exc:  # the engine is gone: a retry here starts a fresh one
        drop_engine(spec.model, spec.engine_kwargs())
        raise JobError(spec.redactor()(f"{what}: {exc}")) from None
    except JobError as exc:
        raise JobError(spec.redactor()(f"{what}: {exc}")) from None
    except Exception as exc:  # noqa: BLE001
        raise JobError(spec.redactor()(f"{what}: {type(exc).__name__}: {exc}")) from None
