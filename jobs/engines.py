"""The worker-local engine registry: each worker process loads a model once and every
partition task running on it submits into that one engine, so the engine's running batch
is fed across partition boundaries.

Only one engine is kept per process (a job asking for another model or other engine knobs
closes the previous one), so a long-lived Dask worker does not accumulate models.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_engines: dict = {}  # key -> LLM; at most one entry


def _load(model: str, engine_kwargs: dict):
    from fusegen.engine import LLM

    return LLM(model, **engine_kwargs)


def get_engine(model: str, engine_kwargs: dict):
    key = (model, tuple(sorted(engine_kwargs.items())))
    with _lock:  # other tasks wait for the load rather than loading the model again
        llm = _engines.get(key)
        if llm is None:
            _close_all()
            llm = _engines[key] = _load(model, engine_kwargs)
        return llm


def loaded_engine(model: str, engine_kwargs: dict):
    """This process's engine for that config, or None (never loads)."""
    return _engines.get((model, tuple(sorted(engine_kwargs.items()))))


def close_engines() -> None:
    with _lock:
        _close_all()


def _close_all():
    for llm in _engines.values():
        llm.close()
    _engines.clear()
