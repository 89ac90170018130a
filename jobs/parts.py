"""A generation part's table: the input rows plus the generation columns, and the
`PartStats` it commits with (the commit itself is `jobs/output.py`'s)."""
from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc

from fusegen.jobs.output import PartStats


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
