"""The worker-local engine registry: each worker process loads a model once and every
partition task running on it submits into that one engine, so the engine's running batch
is fed across partition boundaries.

Only one engine is kept per process (a job asking for another model or other engine knobs
closes the previous one), so a long-lived Dask worker does not accumulate models.

The driver may assign this worker a device (`cuda:i`, one GPU per worker); every later
lookup with the same device option then finds the engine on that device. A worker process
started after the assignment (a restarted one) loads with the job's option as given.
"""
from __future__ import annotations

import threading
import weakref

_lock = threading.Lock()
_engines: dict = {}  # key -> LLM; at most one entry
_devices: dict[str, str] = {}  # the job's device option -> this worker's device
# job -> (a weak reference to its engine, that engine's stats when the job first used it);
# the latest _MAX_JOBS jobs only, so a long-lived worker does not accumulate them
_job_starts: dict[str, tuple[weakref.ref, dict]] = {}
_MAX_JOBS = 16


def _load(model: str, engine_kwargs: dict):
    from fusegen.engine import LLM

    return LLM(model, **engine_kwargs)


def set_worker_device(option: str, device: str) -> None:
    """Jobs with device `option` load their engine on `device` in this process."""
    _devices[option] = device


def get_engine(model: str, engine_kwargs: dict):
    engine_kwargs = _on_worker_device(engine_kwargs)
    key = _key(model, engine_kwargs)
    with _lock:  # other tasks wait for the load rather than loading the model again
        llm = _engines.get(key)
        if llm is None:
            _close_all()
            llm = _engines[key] = _load(model, engine_kwargs)
        return llm


def job_start(job: str, llm) -> dict:
    """`llm`'s counters (`LLM.stats()`) when job `job` first used it in this process: an
    engine that served earlier jobs (a persistent worker's) counts them too, so the job's
    own figures are the later counters less these (`stats_since`). An engine loaded
    afresh mid-job (its device group failed) starts from its own zero counters."""
    with _lock:
        start = job_started(job, llm)
        if start is None:
            _job_starts.pop(job, None)
            start = llm.stats()
            _job_starts[job] = (weakref.ref(llm), start)
            while len(_job_starts) > _MAX_JOBS:
                del _job_starts[next(iter(_job_starts))]
        return start


def job_started(job: str, llm) -> dict | None:
    """`job_start(job, llm)` where job `job` has used `llm` in this process, else None."""
    start = _job_starts.get(job)
    return start[1] if start is not None and start[0]() is llm else None


def loaded_engine(model: str, engine_kwargs: dict):
    """This process's engine for that config, or None (never loads)."""
    return _engines.get(_key(model, _on_worker_device(engine_kwargs)))


def _on_worker_device(engine_kwargs: dict) -> dict:
    device = _devices.get(engine_kwargs.get("device"))
    return engine_kwargs if device is None else {**engine_kwargs, "device": device}


def _key(model: str, engine_kwargs: dict) -> tuple:
    return model, tuple(sorted(engine_kwargs.items()))


def drop_engine(model: str, engine_kwargs: dict) -> None:
    """Close and forget this process's engine for that config if its device group died:
    the next task on this worker loads a fresh one (a fresh one another task already
    loaded is kept)."""
    key = _key(model, _on_worker_device(engine_kwargs))
    with _lock:
        llm = _engines.get(key)
        if llm is None or not llm.engine.runner.failed:
            return
        del _engines[key]
    llm.close()


def close_engines() -> None:
    """Close this process's engine and forget its device: its cluster is gone."""
    with _lock:
        _close_all()
        _devices.clear()


def _close_all():
    for llm in _engines.values():
        llm.close()
    _engines.clear()
