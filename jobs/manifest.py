"""The job manifest (`_manifest.json`) and the resume decision.

The manifest is written before any generation (status "running") and again at the end
(status "complete"), each time under a temporary name then renamed. It holds the public
config (credentials masked), the planned inputs, and per-part counts and timings.
"""
from __future__ import annotations

import json
import uuid

from fusegen.jobs.errors import JobError
from fusegen.jobs.parts import TMP_DIR, is_part_name
from fusegen.jobs.storage import list_names, remove_tree

MANIFEST = "_manifest.json"
FRESH, RESUME, OVERWRITE = "fresh", "resume", "overwrite"


def read_manifest(fs, out_dir: str) -> dict | None:
    path = f"{out_dir}/{MANIFEST}"
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        try:
            return json.loads(f.read())
        except ValueError:
            return {}  # torn by hand or by a foreign tool: treated as "not this job"


def write_manifest(fs, out_dir: str, manifest: dict) -> None:
    tmp = f"{out_dir}/{TMP_DIR}/{MANIFEST}.{uuid.uuid4().hex}"
    fs.makedirs(f"{out_dir}/{TMP_DIR}", exist_ok=True)
    with fs.open(tmp, "wb") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True, default=str).encode())
    fs.mv(tmp, f"{out_dir}/{MANIFEST}")


def resume_mode(old: dict | None, fingerprint: str, config: dict, has_parts: bool,
                overwrite: bool, output: str) -> str:
    """FRESH, RESUME or OVERWRITE; raises JobError when the output holds another job."""
    if overwrite:
        return OVERWRITE
    if old is None:
        if has_parts:
            raise JobError(f"output {output} holds part files but no {MANIFEST}, so they are "
                           "not from this job; pass --overwrite to replace them or choose "
                           "another --output")
        return FRESH
    if old.get("fingerprint") == fingerprint:
        return RESUME
    if not has_parts:  # e.g. the model failed to load: nothing to keep, nothing to lose
        return FRESH
    changed = [f"{k}: {old.get('config', {}).get(k)!r} -> {v!r}" for k, v in config.items()
               if old.get("config", {}).get(k) != v]
    what = "; ".join(changed) or "the input files or their row counts"
    raise JobError(f"output {output} holds a different job (changed: {what}); rerun with "
                   "--overwrite to start afresh, or choose another --output")


def clear_output(fs, out_dir: str) -> None:
    """Remove what a job writes (parts, manifest, temporaries) and nothing else."""
    for name in list_names(fs, out_dir):
        if name == TMP_DIR:
            remove_tree(fs, f"{out_dir}/{name}")
        elif name == MANIFEST or is_part_name(name):
            fs.rm(f"{out_dir}/{name}")
