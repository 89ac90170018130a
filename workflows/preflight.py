"""What a run needs on this machine, checked before it starts: each generate step's model
folder, read as the engine reads it (its config.json). A step whose model is read by the
workers of a `scheduler:` cluster is not checked here; the note says so.
"""
from __future__ import annotations

import os

from fusegen.engine.config import read_model_config
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.weights.gguf_names import is_gguf
from fusegen.engine.weights.hub import hub_offline, looks_like_hub_id, resolve_model
from fusegen.jobs import redact_url
from fusegen.workflows.errors import Problem, ValidationError
from fusegen.workflows.resolve import ResolvedWorkflow


def check_models(resolved: ResolvedWorkflow) -> list[str]:
    """Raises ValidationError naming each step whose model folder is missing or not a
    checkpoint; returns a note for each model left to the cluster's workers."""
    problems, notes = model_problems(resolved)
    if problems:
        raise ValidationError(resolved.workflow.source, problems)
    return notes


def model_problems(resolved: ResolvedWorkflow) -> tuple[list[Problem], list[str]]:
    """(a problem for each step whose model folder is missing or not a checkpoint, a note
    for each model left to the cluster's workers or the hub)."""
    problems, notes = [], []
    for step in resolved.steps:
        job = step.job
        if job is None:
            continue
        if job.scheduler:
            notes.append(f"{step.name}: model {job.model} is read by the workers of "
                         f"{redact_url(job.scheduler)}; not checked here")
            continue
        hub_id = looks_like_hub_id(job.model) and not os.path.exists(job.model)
        if hub_id and not hub_offline():
            notes.append(f"{step.name}: model {job.model} is a hub id, fetched into the "
                         "Hugging Face cache (downloaded if missing) when the step loads")
            continue
        problem = _model_problem(job.model, job.engine.revision, hub_id)
        if problem:
            problems.append(Problem(step.name, "generate.model", problem))
    return problems, notes


def _model_problem(model: str, revision: str | None, hub_id: bool) -> str | None:
    if not hub_id and not (os.path.isdir(model) or (is_gguf(model) and os.path.isfile(model))):
        return (f"model folder {model} does not exist; set generate.model (or "
                "defaults.model) to a Hugging Face checkpoint directory, a .gguf file or "
                "a hub id")
    try:  # offline, a hub id is looked up in the cache alone
        read_model_config(resolve_model(model, revision))
    except ModelLoadError as exc:
        return str(exc)
    return None
