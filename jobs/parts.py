"""A generation part's table: the input rows plus the generation columns, one output row
per completion (a row asking for n completions gives n rows, completion_index 0..n-1),
and the `PartStats` it commits with (the commit itself is `jobs/output.py`'s)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from fusegen.jobs.output import PartStats
from fusegen.jobs.spec import ROW_ID_COLUMN

# One position's logprobs: the sampled (or prompt) token and the top-k, as given.
LOGPROB = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()),
                     ("rank", pa.int64()), ("token", pa.string())])
POSITIONS = pa.list_(pa.list_(LOGPROB))  # [positions][entries]
# JSONL parts: OpenAI's chat-completion logprobs, {"content": [{token, logprob, bytes,
# top_logprobs}], "refusal"}, the shape OpenAI clients parse
_TOKEN = [("token", pa.string()), ("logprob", pa.float64()), ("bytes", pa.list_(pa.int64()))]
OPENAI_LOGPROBS = pa.struct([
    ("content", pa.list_(pa.struct(_TOKEN + [("top_logprobs", pa.list_(pa.struct(_TOKEN)))]))),
    ("refusal", pa.string())])


@dataclass(slots=True, frozen=True)
class OutputShape:
    """Which optional columns a part has; the same for every part of a job (given the
    input file's columns), so the parts of one output share a schema."""
    token_ids: bool = False  # generated_token_ids
    row_ids: bool = False  # row_id: the global row index, when the input names no rows
    logprobs: bool = False
    prompt_logprobs: bool = False
    structured: bool = False  # structured_valid
    openai_logprobs: bool = False  # logprobs in OpenAI's chat shape (JSONL parts)
    first_row: int = 0  # global index of the table's first row (row_id)


def output_table(table: pa.Table, requests, outputs, with_token_ids: bool,
                 shape: OutputShape | None = None) -> pa.Table:
    """`table` plus the generation columns, one row per completion; input row i comes from
    requests[i] / outputs[i] (outputs[i] is None for a row rejected before the engine)."""
    shape = shape or OutputShape(token_ids=with_token_ids)
    rows, take = [], []
    for i, (req, out) in enumerate(zip(requests, outputs)):
        for values in _completion_rows(req, out):
            rows.append(values)
            take.append(i)
    if len(take) != table.num_rows or take != list(range(len(take))):
        table = table.take(pa.array(take, pa.int64()))  # n > 1: input cells repeated
    cols = dict(zip(_NAMES, zip(*rows))) if rows else {n: [] for n in _NAMES}
    columns = {"generated_text": pa.array(cols["text"], pa.string()),
               "finish_reason": pa.array(cols["reason"], pa.string()),
               "num_prompt_tokens": pa.array(cols["n_prompt"], pa.int64()),
               "num_generated_tokens": pa.array(cols["n_gen"], pa.int64()),
               "error": pa.array(cols["error"], pa.string())}
    if shape.token_ids:
        columns["generated_token_ids"] = pa.array(cols["ids"], pa.list_(pa.int64()))
    columns["completion_index"] = pa.array(cols["index"], pa.int32())
    columns["error_code"] = pa.array([e and e.split(":", 1)[0] for e in cols["error"]],
                                     pa.string())
    if shape.logprobs and shape.openai_logprobs:
        columns["logprobs"] = pa.array(_openai_logprobs(requests, outputs), OPENAI_LOGPROBS)
    elif shape.logprobs:
        columns["logprobs"] = pa.array(cols["logprobs"], POSITIONS)
    if shape.prompt_logprobs:
        columns["prompt_logprobs"] = pa.array(cols["prompt_logprobs"], POSITIONS)
    if shape.structured:
        columns["structured_valid"] = pa.array(cols["valid"], pa.bool_())
    if shape.row_ids:
        columns[ROW_ID_COLUMN] = pa.array([shape.first_row + i for i in take], pa.int64())
    for name, values in columns.items():
        if name in table.column_names:  # a per-row logprobs parameter: the list replaces it
            table = table.drop_columns([name])
        table = table.append_column(name, values)
    return table


_NAMES = ("text", "reason", "n_prompt", "n_gen", "error", "ids", "index", "logprobs",
          "prompt_logprobs", "valid")


def _completion_rows(req, out) -> list[tuple]:
    """One tuple (in _NAMES' order) per completion of one input row."""
    if out is None:
        return [(None, "error", 0, 0, req.error, [], 0, None, None, None)]
    if out.error is not None or out.finish_reason == "error":
        code, _, message = (out.error or "engine_error: no message").partition(": ")
        error = f"{code}: {req.where}: {message}" if req.where else out.error
        return [(None, "error", out.num_prompt_tokens, 0, error, [], 0, None, None, None)]
    prompt = _positions(getattr(out, "prompt_logprobs", None))
    return [(c.text, c.finish_reason, out.num_prompt_tokens, len(c.token_ids), None,
             list(c.token_ids), getattr(c, "index", 0), _positions(getattr(c, "logprobs", None)),
             prompt, getattr(c, "structured_valid", None))
            for c in getattr(out, "outputs", None) or [out]]


def _openai_logprobs(requests, outputs) -> list[dict | None]:
    """Per completion row (in output_table's order): OpenAI's chat logprobs of its tokens,
    each with the row's top `logprobs` alternatives; None where it has none."""
    from fusegen.jobs.openai_batch import chat_logprobs

    column = []
    for req, out in zip(requests, outputs):
        completions = [] if out is None or out.error is not None or \
            out.finish_reason == "error" else getattr(out, "outputs", None) or [out]
        for c in completions or [None]:
            positions = getattr(c, "logprobs", None)
            column.append(None if positions is None else chat_logprobs(
                c.token_ids, positions, req.params.logprobs or 0,
                lambda token_id, lp: lp.decoded_token or ""))
    return column


def _positions(positions) -> list | None:
    """Logprob dicts (token id -> Logprob, None for a prompt's first position) as lists
    of LOGPROB structs."""
    if positions is None:
        return None
    return [None if p is None else
            [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank,
              "token": lp.decoded_token} for t, lp in p.items()] for p in positions]


def part_stats(table: pa.Table, name: str, fingerprint: str, seconds: float) -> PartStats:
    """Counts over a part: its rows are completions; prompts (and their tokens) are
    counted once, on each input row's first completion."""
    errs = [e for e in table.column("error").to_pylist() if e is not None]
    invalid = 0
    if "structured_valid" in table.column_names:
        invalid = int(pc.sum(pc.invert(table.column("structured_valid").fill_null(True)))
                      .as_py() or 0)
    first = table
    if "completion_index" in table.column_names:
        first = table.filter(pc.equal(table.column("completion_index"), 0))
    return PartStats(
        name=name, fingerprint=fingerprint, num_rows=table.num_rows, num_errors=len(errs),
        errors_by_code=dict(Counter(e.split(":", 1)[0] for e in errs)),
        num_prompt_tokens=int(pc.sum(first.column("num_prompt_tokens")).as_py() or 0),
        num_generated_tokens=int(pc.sum(table.column("num_generated_tokens")).as_py() or 0),
        seconds=round(seconds, 3),
        num_input_rows=first.num_rows if first.num_rows != table.num_rows else None,
        num_truncated=int(pc.sum(pc.equal(table.column("finish_reason"), "length"))
                          .as_py() or 0),
        num_structured_invalid=invalid)
