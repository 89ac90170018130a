"""Workflow parameters that carry credentials: found, masked, and asked for again.

A parameter is a credential when its name says so (`password`, `api_token`), when its
value holds one (a URL's `user:password@`, `sig=...`), or when it feeds a place whose
value the job's manifest would mask: a secret-bearing storage option, an option fusegen
does not know, a URL's userinfo. The run store, `workflow show`, the hints and the
messages show such a parameter as MASK; a resume asks for it again (`--param`).
"""
from __future__ import annotations

from fusegen.jobs import Redactor, redact_url
from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.render import (RUN_DATE, RUN_ID, RUN_TIME, TemplateError, names_in,
                                      render)
from fusegen.workflows.spec import Workflow

MASK = "***"
_PROBE = "fusegenParamProbe7d1e"  # stands in for one parameter's value while rendering


def secret_params(workflow: Workflow, params: dict, run_date: str,
                  run_variables: dict | None = None) -> set[str]:
    """The names of the parameters that are credentials, with these values.
    `run_variables`: the run's other variables (run_time, run_id)."""
    found = {name for name, value in params.items()
             if Redactor.is_secret_key(name) or _holds_secret(value)}
    uses = list(_uses(workflow))
    for name in set(params) - found:
        variables = {RUN_TIME: f"{run_date}T00:00:00Z", RUN_ID: 0, **(run_variables or {}),
                     RUN_DATE: run_date, **params, name: _PROBE}
        if any(_hidden(name, key, path, text, variables) for key, path, text in uses):
            found.add(name)
    return found


def public_params(params: dict, secret: set[str]) -> dict:
    """The params as they may be stored and shown."""
    return {k: MASK if k in secret else v for k, v in params.items()}


def shown_params(params: dict) -> dict:
    """Recorded params as `workflow show` prints them: masked again by name and value,
    for runs recorded before the store kept credentials masked."""
    return public_params(params, {name for name, value in params.items()
                                  if Redactor.is_secret_key(name) or _holds_secret(value)})


def secret_values(params: dict, secret: set[str]) -> list[str]:
    """The texts a message must not show."""
    return [text for name in sorted(secret & set(params)) for text in _leaves(params[name])]


def restore_params(run_id: int, recorded: dict, given: dict) -> dict:
    """A resumed run's params: the recorded ones, with the masked credentials given again
    (`given`, from --param). Raises WorkflowError naming what is missing or not allowed."""
    masked = sorted(k for k, v in recorded.items() if v == MASK)
    for key in given:
        if key not in masked:
            raise WorkflowError(f"--param {key}: run {run_id} recorded {key}="
                                f"{recorded.get(key)} and a resume runs with what it "
                                "recorded; start a new run with `fusegen workflow run` to "
                                "change it")
    missing = [k for k in masked if k not in given]
    if missing:
        again = " ".join(f"--param {k}=..." for k in missing)
        raise WorkflowError(f"run {run_id} used the credential parameter(s) "
                            f"{', '.join(missing)}, which the run store does not keep; pass "
                            f"them again: fusegen workflow resume {run_id} {again}")
    return {**recorded, **given}


def _holds_secret(value) -> bool:
    return any(redact_url(text) != text for text in _leaves(value))


def _hidden(name: str, key: str, option_path: list[str] | None, text: str,
            variables: dict) -> bool:
    """Whether `text` (under `key`), once rendered, would show less than the parameter's
    value: masked as a storage option at `option_path`, or as a URL's credentials."""
    try:
        if name not in names_in(text, key):
            return False
        rendered = render(text, variables, key)
    except TemplateError:
        return False  # resolve reports it
    if option_path is not None:
        shown = Redactor.public(option_path, rendered)
    else:
        shown = redact_url(str(rendered))
    return _PROBE not in str(shown)


def _uses(workflow: Workflow):
    """(key, option path, text) of every string a parameter can fill; the option path is
    the keys inside storage options, None outside them."""
    for key, value in [("workdir", workflow.workdir)] + [
            (k, v) for step in workflow.steps.values()
            for k, v in [("input", step.input), ("output", step.output),
                         *(step.generate or {}).items(),
                         ("storage_options", step.storage_options)]]:
        options = key == "storage_options"
        for path, text in _strings(value, [] if options else [key]):
            yield path[-1], (path if options else None), text


def _strings(value, path: list[str]):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, [*path, str(k)])
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v, path)
    elif isinstance(value, str) and path:
        yield path, value


def _leaves(value) -> list[str]:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [text for v in value for text in _leaves(v)]
    return [] if value is None or isinstance(value, bool) else [str(value)]
