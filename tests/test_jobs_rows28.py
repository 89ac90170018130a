"""Issue 28, the rows' side: a deeply nested cell is its row's coded error (never a failed
partition), a numeric parameter's text cell is read as its number (only a cell that is
none fails its row), and a conversation is checked before its template renders it."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusegen.engine.tokenizer import PromptLimit
from fusegen.jobs.params import MAX_DEPTH, TooDeep, coerce, read_json
from fusegen.jobs.rows import RowPreparer
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import fake_engine, read_output  # noqa: F401

DEEP = (f"is nested more than {MAX_DEPTH} levels deep (lists and objects); fusegen reads "
        f"at most {MAX_DEPTH}: flatten it")
OBJECTS = ("json_schema", "logit_bias", "response_format")
PARAMS = ("choice", "json_schema", "logit_bias", "stop_token_ids", "bad_words",
          "response_format")


def _nested(column: str, depth: int) -> str:
    """JSON text nested `depth` levels: objects or lists, as the column takes them."""
    if column in OBJECTS:
        return '{"a": ' * depth + "1" + "}" * depth
    return "[" * depth + '"x"' + "]" * depth


def _messages(extra: str | None = None) -> str:
    extra = "" if extra is None else f', "extra": {extra}'
    return f'[{{"role": "user", "content": "hi"{extra}}}]'


def test_deeply_nested_cells_are_row_errors_and_the_job_completes(fake_engine, tmp_path):
    # 5,000 levels exhaust json.loads' recursion; MAX_DEPTH + 1 is the first depth refused
    cases = [(c, d) for c in PARAMS for d in (5000, MAX_DEPTH + 1)]
    rows = [{"messages": _messages()}]
    rows += [{"messages": _messages(), c: _nested(c, d)} for c, d in cases]
    rows += [{"messages": "[" * 5000 + "]" * 5000},
             {"messages": _messages("[" * MAX_DEPTH + "]" * MAX_DEPTH)}]
    schema = pa.schema([(n, pa.string()) for n in ("messages",) + PARAMS])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "in.parquet")
    spec = JobSpec(model=fake_engine, input=str(tmp_path / "in.parquet"),
                   output=str(tmp_path / "out"), messages_column="messages", max_tokens=2,
                   partition_rows=5, progress="none",
                   max_error_rate=1.0)  # rows made to fail: none may stop the job
    result = run_job(spec)
    out = read_output(str(tmp_path / "out"))
    assert out.num_rows == len(rows) == 15
    assert out.column("error").to_pylist() == [None] + [
        f"invalid_params: row {i}: column {c!r} {DEEP} (per-row column)"
        for i, (c, _) in enumerate(cases, 1)] + [
        f"invalid_prompt: row 13: column 'messages' {DEEP}",
        f"invalid_prompt: row 14: column 'messages' {DEEP}"]
    assert out.column("num_generated_tokens").to_pylist() == [2] + [0] * 14
    assert result.num_errors == 14
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["totals"]["errors_by_code"] == {"invalid_params": 12, "invalid_prompt": 2}


def test_depth_limit_is_exact():
    at_limit = "[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH
    assert read_json(at_limit) == json.loads(at_limit)
    with pytest.raises(TooDeep, match=f"more than {MAX_DEPTH} levels"):
        read_json("[" + at_limit + "]")
    value = [1]
    for _ in range(MAX_DEPTH - 1):
        value = [value]
    assert coerce("stop_token_ids", value) is value  # Arrow lists: the same limit
    with pytest.raises(TooDeep):
        coerce("stop_token_ids", [value])
    with pytest.raises(TooDeep):  # a job's own option (JSON text) too
        coerce("json_schema", '{"a": ' * (MAX_DEPTH + 1) + "1" + "}" * (MAX_DEPTH + 1))


def test_csv_numeric_text_cells_fail_only_their_own_row(fake_engine, tmp_path):
    (tmp_path / "in.csv").write_text("prompt,max_tokens\nhello,3\nworld,abc\nfoo,4\n"
                                     "blank,\nfloat,2.0\n")
    run_job(JobSpec(model=fake_engine, input=str(tmp_path / "in.csv"),
                    output=str(tmp_path / "out"), max_tokens=5, progress="none"))
    out = read_output(str(tmp_path / "out"))
    assert out.column("max_tokens").to_pylist() == ["3", "abc", "4", "", "2.0"]  # as given
    assert out.column("num_generated_tokens").to_pylist() == [3, 0, 4, 5, 2]
    assert out.column("error").to_pylist() == [
        None, "invalid_params: row 1: column 'max_tokens' must be an integer, got 'abc' "
        "(per-row column)", None, None, None]


def test_jsonl_numeric_text_cells_are_read_as_numbers_too(fake_engine, tmp_path):
    (tmp_path / "in.jsonl").write_text(
        '{"prompt": "a", "max_tokens": "2"}\n{"prompt": "b", "max_tokens": "lots"}\n')
    run_job(JobSpec(model=fake_engine, input=str(tmp_path / "in.jsonl"),
                    output=str(tmp_path / "out"), progress="none"))
    out = read_output(str(tmp_path / "out"))
    assert out.column("num_generated_tokens").to_pylist() == [2, 0]
    assert out.column("error").to_pylist() == [
        None, "invalid_params: row 1: column 'max_tokens' must be an integer, got 'lots' "
        "(per-row column)"]


def test_text_cells_become_each_parameters_type():
    table = pa.table({"prompt": ["a", "b", "c", "d"],
                      "temperature": ["0.5", " 1 ", "warm", None],
                      "seed": ["18446744073709551615", "7", "1", "1.5"],
                      "ignore_eos": ["TRUE", "false", "yes", ""]})
    spec = JobSpec(model="/m", input="i", output="o")
    reqs = RowPreparer(spec).prepare(table, 0)
    assert (reqs[0].params.temperature, reqs[0].params.seed, reqs[0].params.ignore_eos) == (
        0.5, 2**64 - 1, True)
    assert (reqs[1].params.temperature, reqs[1].params.seed, reqs[1].params.ignore_eos) == (
        1.0, 7, False)
    assert type(reqs[1].params.temperature) is float
    assert reqs[2].error == ("invalid_params: row 2: column 'temperature' must be a number, "
                             "got 'warm' (per-row column)")
    assert reqs[3].error == ("invalid_params: row 3: column 'seed' must be an integer, got "
                             "'1.5' (per-row column)")
    assert RowPreparer(spec).prepare(pa.table({"prompt": ["e"], "ignore_eos": ["yes"]}), 4)[
        0].error == ("invalid_params: row 4: column 'ignore_eos' must be true or false, got "
                     "'yes' (per-row column)")


def test_conversation_is_refused_before_the_template_renders_it():
    rendered = []
    spec = JobSpec(model="/m", input="i", output="o", messages_column="m",
                   system_prompt="s" * 40)
    prep = RowPreparer(spec, chat=lambda messages: rendered.append(messages) or [1],
                       prompt_limit=PromptLimit(max_model_len=10, max_token_bytes=5))
    table = pa.table({"m": [json.dumps([{"role": "user", "content": "x" * 10}]),
                            json.dumps([{"role": "user", "content": "x" * 11}]),
                            '[{"role": "user", "content": "a\\ud800"}]']})
    reqs = prep.prepare(table, 0)
    assert reqs[0].error is None and rendered == [
        [{"role": "system", "content": "s" * 40}, {"role": "user", "content": "x" * 10}]]
    assert reqs[1].error == (  # the system prompt counts
        "prompt_too_long: row 1: the messages' content has 51 bytes; no text over 50 bytes "
        "fits the context (max_model_len 10 tokens x 5 bytes, the longest token); shorten it")
    assert reqs[2].error == (
        "invalid_prompt: row 2: column 'm' holds a lone surrogate U+D800 (character 1 of "
        "[0].content), which is not valid Unicode; remove it")
    assert len(rendered) == 1
