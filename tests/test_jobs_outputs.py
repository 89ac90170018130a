"""A job's outputs and observability: one row per completion, error codes, logprobs and
structured_valid columns, stable row ids, the progress line, the HTML report."""
import io
import json
import logging
import os
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq

from fusegen.engine.llm_engine import LLMEngine
from fusegen.engine.outputs import CompletionOutput, RequestOutput
from fusegen.jobs.cluster import dashboard_link
from fusegen.jobs.parts import OutputShape, output_table, part_stats
from fusegen.jobs.progress import JobResult, Progress
from fusegen.jobs.report import render_report, throughput_rates
from fusegen.jobs.rows import RowRequest
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import fake_engine, read_output, write_prompts  # noqa: F401


def _lp(logprob, rank, token):
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=token)


def _two_completions() -> RequestOutput:
    first = CompletionOutput(0, "ab", [5, 6], "stop", logprobs=[
        {5: _lp(-0.5, 1, "a")}, {6: _lp(-1.0, 2, "b"), 7: _lp(-0.25, 1, "c")}],
        structured_valid=True)
    second = CompletionOutput(1, "x", [9], "length", logprobs=[{9: _lp(-3.0, 4, "x")}],
                              structured_valid=False)
    return RequestOutput(1, "hi", [1, 2, 3], [first, second],
                         prompt_logprobs=[None, {2: _lp(-2.0, 1, "h")}, {3: _lp(-0.5, 1, "i")}])


def _three_rows():
    table = pa.table({"id": ["a", "b", "c"], "prompt": ["hi", None, "long"]})
    requests = [RowRequest("hi", where="row 4 (id='a')"),
                RowRequest(error="null_prompt: row 5 (id='b'): column 'prompt' is null",
                           where="row 5 (id='b')"),
                RowRequest("long", where="row 6 (id='c')")]
    too_long = RequestOutput.failed(3, "prompt_too_long: the prompt has 90 tokens; the "
                                    "context limit is 64 (max_model_len)", None, [1] * 90)
    return table, requests, [_two_completions(), None, too_long]


def test_one_row_per_completion_with_index_error_code_and_logprobs():
    table, requests, outputs = _three_rows()
    shape = OutputShape(token_ids=True, logprobs=True, prompt_logprobs=True, structured=True)
    out = output_table(table, requests, outputs, True, shape)
    assert out.column_names == [
        "id", "prompt", "generated_text", "finish_reason", "num_prompt_tokens",
        "num_generated_tokens", "error", "generated_token_ids", "completion_index",
        "error_code", "logprobs", "prompt_logprobs", "structured_valid"]
    assert out.schema.field("completion_index").type == pa.int32()
    rows = out.to_pylist()
    assert [(r["id"], r["completion_index"], r["generated_text"]) for r in rows] == [
        ("a", 0, "ab"), ("a", 1, "x"), ("b", 0, None), ("c", 0, None)]
    assert [r["error_code"] for r in rows] == [None, None, "null_prompt", "prompt_too_long"]
    assert rows[3]["error"] == ("prompt_too_long: row 6 (id='c'): the prompt has 90 tokens; "
                                "the context limit is 64 (max_model_len)")
    assert [r["finish_reason"] for r in rows] == ["stop", "length", "error", "error"]
    assert [r["num_generated_tokens"] for r in rows] == [2, 1, 0, 0]
    assert [r["generated_token_ids"] for r in rows] == [[5, 6], [9], [], []]
    assert [r["structured_valid"] for r in rows] == [True, False, None, None]
    assert rows[0]["logprobs"] == [
        [{"token_id": 5, "logprob": -0.5, "rank": 1, "token": "a"}],
        [{"token_id": 6, "logprob": -1.0, "rank": 2, "token": "b"},
         {"token_id": 7, "logprob": -0.25, "rank": 1, "token": "c"}]]
    assert rows[1]["logprobs"] == [[{"token_id": 9, "logprob": -3.0, "rank": 4, "token": "x"}]]
    assert rows[0]["prompt_logprobs"] == rows[1]["prompt_logprobs"] == [
        None, [{"token_id": 2, "logprob": -2.0, "rank": 1, "token": "h"}],
        [{"token_id": 3, "logprob": -0.5, "rank": 1, "token": "i"}]]
    assert rows[2]["logprobs"] is None and rows[3]["prompt_logprobs"] is None
    stats = part_stats(out, "part-00000.parquet", "f", 1.0)
    # prompts counted once per input row; completions are the part's rows
    assert (stats.num_rows, stats.num_input_rows, stats.num_prompt_tokens,
            stats.num_generated_tokens, stats.errors_by_code) == (
        4, 3, 3 + 90, 3, {"null_prompt": 1, "prompt_too_long": 1})


def test_optional_columns_absent_unless_asked_and_row_ids_from_the_first_row():
    table, requests, outputs = _three_rows()
    out = output_table(table.drop_columns(["id"]), requests, outputs, False,
                       OutputShape(row_ids=True, first_row=40))
    assert out.column_names == ["prompt", "generated_text", "finish_reason",
                                "num_prompt_tokens", "num_generated_tokens", "error",
                                "completion_index", "error_code", "row_id"]
    assert out.column("row_id").to_pylist() == [40, 40, 41, 42]  # the input row's, per completion
    empty = output_table(pa.table({"prompt": pa.array([], pa.string())}), [], [], False)
    assert empty.column_names[-2:] == ["completion_index", "error_code"]


def test_a_per_row_logprobs_column_is_replaced_by_the_list_column():
    table = pa.table({"prompt": ["hi"], "logprobs": [2]})
    out = output_table(table, [RowRequest("hi")], [_two_completions()], False,
                       OutputShape(logprobs=True))
    assert out.column_names.count("logprobs") == 1
    assert out.column("logprobs").type == pa.list_(pa.list_(pa.struct([
        ("token_id", pa.int64()), ("logprob", pa.float64()), ("rank", pa.int64()),
        ("token", pa.string())])))


def _spec(model, inp, out, **kw):
    kw = {"max_tokens": 3, "progress": "none", **kw}
    return JobSpec(model=model, input=str(inp), output=str(out), **kw)


def test_row_ids_are_stable_across_partitionings_and_reruns(fake_engine, tmp_path):
    write_prompts(tmp_path / "a.parquet", 5)
    write_prompts(tmp_path / "b.parquet", 4, start=5)
    got = []
    for rows, name in ((2, "out2"), (3, "out3"), (3, "out3")):  # the last one resumes
        run_job(_spec(fake_engine, tmp_path / "*.parquet", tmp_path / name, partition_rows=rows))
        table = read_output(tmp_path / name)
        got.append(list(zip(table.column("row_id").to_pylist(), table.column("id").to_pylist(),
                            table.column("generated_text").to_pylist())))
    assert got[0] == got[1] == got[2]
    assert [row_id for row_id, *_ in got[0]] == list(range(9))
    assert [i for _, i, _ in got[0]] == list(range(9))


def test_an_input_row_id_column_names_rows_and_is_kept(fake_engine, tmp_path):
    pq.write_table(pa.table({"row_id": [70, 71], "prompt": ["ok", "z" * 100]}),
                   tmp_path / "in.parquet")
    run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out"))
    table = read_output(tmp_path / "out")
    assert table.column_names.count("row_id") == 1
    assert table.column("row_id").to_pylist() == [70, 71]
    assert table.column("error").to_pylist()[1] == \
        "prompt_too_long: row 1 (row_id=71): 101 tokens > max_model_len 64"


def test_unknown_parameter_columns_are_warned_before_the_job_runs(fake_engine, tmp_path,
                                                                   caplog):
    write_prompts(tmp_path / "a.parquet", 2, max_token=[1, 2])
    write_prompts(tmp_path / "b.parquet", 2, start=2, max_token=[1, 2])
    with caplog.at_level(logging.WARNING, logger="fusegen.jobs"):
        run_job(_spec(fake_engine, tmp_path / "*.parquet", tmp_path / "out"))
    assert [r.getMessage() for r in caplog.records if r.name == "fusegen.jobs"] == [
        "column 'max_token' is not a parameter fusegen knows (did you mean 'max_tokens'?); "
        "it is kept as data and does not change generation"]  # once, not once per file
    assert read_output(tmp_path / "out").column("num_generated_tokens").to_pylist() == [3] * 4


def test_chat_template_option_reaches_the_tokenizer(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 1)
    run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out", chat=True,
                  chat_template="T{{ x }}", system_prompt="S"))
    # the fake tokenizer writes the template's text, then "<role>content" per turn
    expected = len("T{{ x }}" + "<system>S" + "<user>prompt 0" + "<assistant>")
    assert read_output(tmp_path / "out").column("num_prompt_tokens").to_pylist() == [expected]


def test_progress_line_shows_errors_engine_load_and_kv_use():
    p = Progress(10, mode="log", stream=io.StringIO())
    p.start = 0.0
    p.partial(0, 3, 20, errors=1, worker="w1",
              engine={"running": 3, "waiting": 5, "kv_used": 0.25})
    p.partial(1, 1, 10, errors=0, worker="w2",
              engine={"running": 2, "waiting": 0, "kv_used": 0.42})
    p.advance(2, 1, 10, errors=1)
    assert p.line(10.0) == ("[" + "#" * 15 + " " * 15 + "] 5/10 rows (50%) | 2 errors | "
                            "4.0 tok/s | 5 running, 5 waiting | KV 42% | ETA 0:00:10")
    assert Progress(4, mode="log").line(p.start + 1) .endswith("| 0 errors | 0.0 tok/s | ETA --:--")


def test_engine_load_reads_the_schedulers_queues_and_free_blocks():
    blocks = SimpleNamespace(num_blocks=200, num_free_blocks=150)
    scheduler = SimpleNamespace(running=[1, 2], waiting=[3], swapped=[4, 5],
                                block_manager=blocks)
    engine = SimpleNamespace(scheduler=scheduler,
                             stats=SimpleNamespace(num_generated_tokens=1234))
    assert LLMEngine.load(engine) == {"running": 2, "waiting": 3, "kv_used": 0.25,
                                      "num_generated_tokens": 1234}


def test_dashboard_link_only_when_the_scheduler_serves_one(monkeypatch):
    import importlib.util

    def client(services):
        return SimpleNamespace(scheduler_info=lambda: {"services": services},
                               dashboard_link="http://10.0.0.5:8787/status")

    assert dashboard_link(client({"dashboard": 8787}), local=False) == \
        "http://10.0.0.5:8787/status"
    assert dashboard_link(client({}), local=False) is None
    has_bokeh = {"bokeh": True}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: has_bokeh[name] or None)
    # the embedded cluster's listens on the loopback, whatever its scheduler's address says
    assert dashboard_link(client({"dashboard": 4321}), local=True) == \
        "http://127.0.0.1:4321/status"
    has_bokeh["bokeh"] = False  # served, but its pages only say to install bokeh
    assert dashboard_link(client({"dashboard": 4321}), local=True) is None


def test_html_report_holds_the_numbers_and_the_throughput_plot():
    result = JobResult("out", num_rows=12, num_errors=2, errors_by_code={"null_prompt": 2},
                       num_prompt_tokens=300, num_generated_tokens=90, num_parts=3,
                       rows_computed=12, tokens_computed=90, wall_seconds=3.0,
                       prompt_tokens_cached=128,
                       timeline=[(0.0, 0, 0), (1.0, 4, 20), (2.0, 8, 60), (3.0, 12, 90)])
    assert throughput_rates(result.timeline) == [(1.0, 20.0), (2.0, 40.0), (3.0, 30.0)]
    page = render_report(result, {"fingerprint": "abc", "config": {"model": "<m>"}})
    for cell in ("<th>rows</th><td>12</td>", "<th>errors</th><td>2</td>",
                 "<th>prompt tokens from the prefix cache</th><td>128</td>",
                 "<th>generated tokens</th><td>90</td>", "<th>model</th><td>&lt;m&gt;</td>",
                 "<th>this run</th><td>4.0 rows/s, 30.0 output tokens/s</td>",
                 "<li>null_prompt: 2</li>"):
        assert cell in page, cell
    # x: 48 + 544 t / 3; y: 192 - 144 rate / 40
    assert ('<polyline class="throughput" fill="none" stroke="#1f6feb" stroke-width="2" '
            'points="48.0,120.0 229.3,120.0 229.3,48.0 410.7,48.0 410.7,84.0 592.0,84.0"/>'
            ) in page
    assert "<script" not in page and "http" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")


def test_report_is_written_beside_the_manifest(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 5)
    result = run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out",
                           report=True))
    assert sorted(os.listdir(tmp_path / "out")) == ["_manifest.json", "_report.html",
                                                     "part-00000.parquet"]
    assert pq.read_table(tmp_path / "out").num_rows == 5  # readers skip it like the manifest
    page = (tmp_path / "out" / "_report.html").read_text()
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert f"<th>fingerprint</th><td>{manifest['fingerprint']}</td>" in page
    assert "<th>generated tokens</th><td>15</td>" in page and 'class="throughput"' in page
    assert result.timeline[0] == (0.0, 0, 0) and result.timeline[-1][1:] == (5, 15)
    assert manifest["totals"]["prompt_tokens_cached"] == 0


def test_n_completions_write_n_rows_per_input_row(fake_engine, tmp_path):
    pq.write_table(pa.table({"prompt": ["a", "b", None, "c"], "n": [None, 3, 2, 1]}),
                   tmp_path / "in.parquet")
    result = run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out", n=2,
                           partition_rows=3))
    table = read_output(tmp_path / "out")
    assert list(zip(table.column("prompt").to_pylist(),
                    table.column("completion_index").to_pylist(),
                    table.column("row_id").to_pylist())) == [
        ("a", 0, 0), ("a", 1, 0), ("b", 0, 1), ("b", 1, 1), ("b", 2, 1), (None, 0, 2),
        ("c", 0, 3)]
    texts = table.column("generated_text").to_pylist()
    assert len(set(texts[:2])) == 2 and len(set(texts[2:5])) == 3  # each its own seed
    assert table.column("error_code").to_pylist() == [None] * 5 + ["null_prompt", None]
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert [(p["num_rows"], p.get("num_input_rows")) for p in manifest["parts"]] == [
        (6, 3), (1, None)]
    assert (result.num_rows, result.num_generated_tokens) == (7, 18)
    # a rerun resumes: the parts' input row counts match the plan
    again = run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out", n=2,
                          partition_rows=3))
    assert again.num_parts_skipped == 2
