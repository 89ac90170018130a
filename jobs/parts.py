"""Output parts: the input rows plus generation columns, written under a temporary name
and committed by a rename, so a part is either absent or complete."""
from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from fusegen.jobs.plan import Partition
from fusegen.jobs.storage import list_names

TMP_DIR = "_tmp"
_META_KEY = b"fusegen"


@dataclass(slots=True)
class PartStats:
    """What one committed part holds; kept in its Parquet footer and in the manifest."""
    name: str
    fingerprint: str  # the job that wrote it
    num_rows: int = 0
    num_errors: int = 0
    errors_by_code: dict = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seconds: float = 0.0  # read + generate + write, on the worker

    @classmethod
    def from_json(cls, text) -> "PartStats":
        return cls(**json.loads(text))


def output_table(table: pa.Table, requests, outputs, with_token_ids: bool) -> pa.Table:
    """`table` plus the generation columns; row i comes from requests[i] / outputs[i]
    (outputs[i] is None for a row rejected before the engine)."""
    rows = [_row_values(req, out) for req, out in zip(requests, outputs)]
    text, reason, n_prompt, n_gen, error, ids = zip(*rows) if rows else ([],) * 6
    columns = {"generated_text": pa.array(text, pa.string()),
               "finish_reason": pa.array(reason, pa.string()),
               "num_prompt_tokens": pa.array(n_prompt, pa.int64()),
               "num_generated_tokens": pa.array(n_gen, pa.int64()),
               "error": pa.array(error, pa.string())}
    if with_token_ids:
        columns["generated_token_ids"] = pa.array(ids, pa.list_(pa.int64()))
    for name, values in columns.items():
        table = table.append_column(name, values)
    return table


def _row_values(req, out) -> tuple:
    """(text, finish_reason, num_prompt_tokens, num_generated_tokens, error, token_ids)"""
    if out is None:
        return None, "error", 0, 0, req.error, []
    if out.finish_reason == "error":
        return None, "error", out.num_prompt_tokens, 0, out.error, []
    return (out.text, out.finish_reason, out.num_prompt_tokens, out.num_generated_tokens,
            None, list(out.token_ids))


def part_stats(table: pa.Table, name: str, fingerprint: str, seconds: float) -> PartStats:
    errs = [e for e in table.column("error").to_pylist() if e is not None]
    return PartStats(
        name=name, fingerprint=fingerprint, num_rows=table.num_rows, num_errors=len(errs),
        errors_by_code=dict(Counter(e.split(":", 1)[0] for e in errs)),
        num_prompt_tokens=int(pc.sum(table.column("num_prompt_tokens")).as_py() or 0),
        num_generated_tokens=int(pc.sum(table.column("num_generated_tokens")).as_py() or 0),
        seconds=round(seconds, 3))


def write_part(fs, out_dir: str, table: pa.Table, stats: PartStats) -> None:
    """Write under _tmp/ with a unique name, then rename onto the final name. A retried
    partition (killed worker) writes its own temporary file and commits the same content."""
    meta = dict(table.schema.metadata or {})
    meta[_META_KEY] = json.dumps(asdict(stats)).encode()
    table = table.replace_schema_metadata(meta)
    tmp = f"{out_dir}/{TMP_DIR}/{stats.name}.{uuid.uuid4().hex}"
    fs.makedirs(f"{out_dir}/{TMP_DIR}", exist_ok=True)
    with fs.open(tmp, "wb") as f:
        pq.write_table(table, f)
    fs.mv(tmp, f"{out_dir}/{stats.name}")


def is_part_name(name: str) -> bool:
    return name.startswith("part-") and name.endswith(".parquet")


def committed_stats(fs, out_dir: str, plan: list[Partition], fingerprint: str) -> dict:
    """index -> PartStats of the parts already committed by this job with the planned row
    count; anything else (another job's part, a short one) will be recomputed."""
    existing = list_names(fs, out_dir)
    done = {}
    for part in plan:
        if part.name not in existing:
            continue
        try:
            with fs.open(f"{out_dir}/{part.name}", "rb") as f:
                md = pq.ParquetFile(f).metadata
        except (OSError, pa.ArrowException):  # damaged by hand: recompute it
            continue
        raw = (md.metadata or {}).get(_META_KEY)
        stats = PartStats.from_json(raw) if raw else None
        if stats and stats.fingerprint == fingerprint and md.num_rows == part.num_rows:
            done[part.index] = stats
    return done
