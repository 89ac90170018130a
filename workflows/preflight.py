"""What a run needs on this machine, checked before it starts: each generate step's model
folder, read as the engine reads it (its config.json). A step whose model is read by the
workers of a `scheduler:` cluster is not checked here; the note says so.
"""
from __future__ import annotations

import os

from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models.config import ModelConfig
from fusegen.jobs import redact_url
from fusegen.workflows.errors import Problem, ValidationError
from fusegen.workflows.resolve import ResolvedWorkflow


def check_models(resolved: ResolvedWorkflow) -> list[str]:
    """Raises ValidationError naming each step whose model folder is missing or not a
    checkpoint; returns a note for each model left to the cluster's workers."""
    problems, notes = [], []
    for step in resolved.steps:
        job = step.job
        if job is None:
            continue
        if job.scheduler:
            notes.append(f"{step.name}: model {job.model} is read by the workers of "
                         f"{redact_url(job.scheduler)}; not checked here")
            continue
        problem = _model_problem(job.model)
        if problem:
            problems.append(Problem(step.name, "generate.model", problem))
    if problems:
        raise ValidationError(resolved.workflow.source, problems)
    return notes


def _model_problem(model: str) -> str | None:
    if not os.path.isdir(model):
        return (f"model folder {model} does not exist; set generate.model (or "
                "defaults.model) to a Hugging Face checkpoint directory")
    try:
        ModelConfig.from_dir(model)
    except ModelLoadError as exc:
        return str(exc)
    return None
