"""What went wrong in rows that are no errors is counted beside the errors: rows cut at
their length limit (finish_reason "length") and rows whose structured output is invalid
(structured_valid False), per part (its footer), in the summary, the manifest's totals
and _report.html, kept across a resume."""
import json

import pyarrow as pa
import pyarrow.compute as pc

from fusegen.engine.outputs import CompletionOutput, RequestOutput
from fusegen.jobs.driver import run_job
from fusegen.jobs.output import PartStats
from fusegen.jobs.parts import OutputShape, output_table, part_stats
from fusegen.jobs.progress import JobResult
from fusegen.jobs.report import REPORT, render_report
from fusegen.jobs.rows import RowRequest
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import read_output, tiny_model_dir


SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'


def _part() -> pa.Table:
    """Five input rows: a complete valid one, a cut invalid one, an error, and a row of
    two completions (one cut and invalid, one complete)."""
    table = pa.table({"prompt": ["a", "b", None, "d"]})
    requests = [RowRequest("a"), RowRequest("b"),
                RowRequest(error="null_prompt: row 2: column 'prompt' is null"), RowRequest("d")]
    outputs = [
        RequestOutput(1, "a", [1], [CompletionOutput(0, "{}", [5, 6], "stop",
                                                     structured_valid=True)]),
        RequestOutput(2, "b", [1], [CompletionOutput(0, "{", [5], "length",
                                                     structured_valid=False)]),
        None,
        RequestOutput(4, "d", [1], [
            CompletionOutput(0, '{"', [5, 7], "length", structured_valid=False),
            CompletionOutput(1, "{}", [5, 6], "stop", structured_valid=True)])]
    return output_table(table, requests, outputs, False, OutputShape(structured=True))


def test_a_part_counts_cut_and_invalid_rows():
    stats = part_stats(_part(), "part-00000.parquet", "fp", 0.5)
    assert (stats.num_rows, stats.num_errors) == (5, 1)
    assert (stats.num_truncated, stats.num_structured_invalid) == (2, 2)
    assert stats.as_dict()["num_truncated"] == 2  # in the footer and the manifest's parts


def test_an_unconstrained_part_counts_cut_rows_and_no_invalid_ones():
    table = pa.table({"prompt": ["a", "b"]})
    outputs = [RequestOutput(1, "a", [1], [CompletionOutput(0, "x", [5], "length")]),
               RequestOutput(2, "b", [1], [CompletionOutput(0, "y", [6], "stop")])]
    stats = part_stats(output_table(table, [RowRequest("a"), RowRequest("b")], outputs,
                                    False), "p", "fp", 0.1)
    assert (stats.num_truncated, stats.num_structured_invalid) == (1, 0)


def test_summary_and_report_show_them_beside_the_errors():
    r = JobResult("out", num_rows=200, num_errors=2, errors_by_code={"null_prompt": 2},
                  num_truncated=90, num_structured_invalid=83, num_parts=1,
                  wall_seconds=1.0)
    assert r.summary().splitlines()[1] == (
        "rows: 200, errors: 2 (null_prompt 2), cut at the length limit: 90, "
        "invalid structured output: 83")
    page = render_report(r, {"config": {}})
    assert "<tr><th>rows cut at the length limit</th><td>90</td></tr>" in page
    assert "<tr><th>rows with invalid structured output</th><td>83</td></tr>" in page
    clean = JobResult("out", num_rows=3, num_parts=1)
    assert clean.summary().splitlines()[1] == "rows: 3, errors: 0"


def test_a_transform_part_without_counts_reads_as_none():
    # Parts committed before fusegen counted these (or by a transform step) hold no count.
    stats = PartStats(**{"name": "p", "fingerprint": "fp", "num_rows": 3})
    assert (stats.num_truncated, stats.num_structured_invalid) == (None, None)
    assert "num_truncated" not in stats.as_dict()


def test_a_job_counts_them_in_its_summary_manifest_and_report(tmp_path):
    # A tiny random model asked for {"name": ...} in 3 tokens: rows cut invalid, the
    # counts equal to what the output's columns hold, and the same after a resume.
    pa.parquet.write_table(pa.table({"prompt": [f"item {i}" for i in range(10)],
                                     "max_tokens": [3] * 7 + [40] * 3}),
                           tmp_path / "in.parquet")
    spec = JobSpec(model=tiny_model_dir(), input=str(tmp_path / "in.parquet"),
                   output=str(tmp_path / "out"), json_schema=SCHEMA,
                   temperature=0.0, partition_rows=4, progress="none", report=True)
    result = run_job(spec)
    out = read_output(tmp_path / "out")
    cut = pc.sum(pc.equal(out.column("finish_reason"), "length")).as_py()
    invalid = out.column("structured_valid").to_pylist().count(False)
    assert cut >= 7 and invalid >= 7  # 3 tokens make no such object
    assert (result.num_truncated, result.num_structured_invalid) == (cut, invalid)
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    totals = manifest["totals"]
    assert (totals["num_truncated"], totals["num_structured_invalid"]) == (cut, invalid)
    assert sum(p["num_structured_invalid"] for p in manifest["parts"]) == invalid
    page = (tmp_path / "out" / REPORT).read_text()
    assert f"<tr><th>rows with invalid structured output</th><td>{invalid}</td></tr>" in page
    assert f"invalid structured output: {invalid}" in result.summary()
    again = run_job(spec)  # every part kept: the counts come from their footers
    assert again.num_parts_skipped == 3
    assert (again.num_truncated, again.num_structured_invalid) == (cut, invalid)
