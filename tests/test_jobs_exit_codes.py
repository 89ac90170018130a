"""`fusegen run` tells the truth in its exit status: 0 every row generated, 3 finished
with error rows, 1 failed; job-wide options that would fail every row fail the job before
the model loads; --max-error-rate stops a job going wrong, resumably."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from fusegen.jobs.cli import main
from fusegen.jobs.driver import run_job
from fusegen.jobs.error_rate import ErrorRate, errors_by_code
from fusegen.jobs.errors import ErrorRateExceeded, JobError
from fusegen.jobs.output import PartStats
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import (  # noqa: F401
    FakeLLM, fake_engine, read_output, write_job, write_prompts)


def _run(model, inp, out, *flags):
    return CliRunner().invoke(main, ["run", "--model", model, "--input", str(inp),
                                     "--output", str(out), "--max-tokens", "2",
                                     "--progress", "none", *flags])


def test_all_rows_ok_exits_0_and_error_rows_exit_3(fake_engine, tmp_path):
    write_prompts(tmp_path / "ok.parquet", 4)
    ok = _run(fake_engine, tmp_path / "ok.parquet", tmp_path / "a")
    assert ok.exit_code == 0, ok.output
    assert "error rows" not in ok.output
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "prompt": ["a", None, "c", "d"]}),
                   tmp_path / "bad.parquet")
    bad = _run(fake_engine, tmp_path / "bad.parquet", tmp_path / "b")
    assert bad.exit_code == 3, bad.output
    assert "rows: 4, errors: 1 (null_prompt 1)" in bad.stdout
    assert bad.stderr.strip().endswith("finished with 1 error rows of 4 (exit status 3); "
                                       "their `error` column says why")
    # A rerun with nothing left to do says the same of the committed rows.
    again = _run(fake_engine, tmp_path / "bad.parquet", tmp_path / "b")
    assert again.exit_code == 3 and "1 kept from an earlier run" in again.stdout


def test_a_job_whose_rows_all_fail_does_not_exit_0(fake_engine, tmp_path):
    pq.write_table(pa.table({"prompt": [None] * 5}, pa.schema([("prompt", pa.string())])),
                   tmp_path / "in.parquet")
    res = _run(fake_engine, tmp_path / "in.parquet", tmp_path / "out")  # one partition
    assert res.exit_code == 3 and "rows: 5, errors: 5 (null_prompt 5)" in res.stdout


@pytest.mark.parametrize("flags, message", [
    (["--json-schema", '{"type": "objekt"}'],
     "Error: --json-schema is not valid: Invalid type: objekt; every row would fail with it"),
    (["--response-format", '{"type": "json_schema", "json_schema": {"name": "x", "schema": '
      '{"type": "object", "properties": {"a": {"type": "strin"}}}}}'],
     "Error: --response-format is not valid: Invalid type: strin; every row would fail "
     "with it"),
    (["--regex", "[a-"], 'Error: --regex is not valid: at 1(8): invalid regex "[a-" (in '
     "regex): regex parse error: unclosed character class; every row would fail with it"),
    (["--grammar", "start: foo"],
     'Error: --grammar is not valid: at 1(8): unknown name: "foo"; every row would fail with it'),
])
def test_a_constraint_that_fails_every_row_fails_before_the_model_loads(
        fake_engine, tmp_path, flags, message):
    write_prompts(tmp_path / "in.parquet", 3)
    res = _run(fake_engine, tmp_path / "in.parquet", tmp_path / "out", *flags)
    assert res.exit_code == 1, res.output
    assert message in res.output and len(res.output.strip().splitlines()) == 1
    assert FakeLLM.instances == []  # no engine loaded
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_valid_constraint_passes_the_check(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 3)
    res = _run(fake_engine, tmp_path / "in.parquet", tmp_path / "out", "--json-schema",
               '{"type": "object", "properties": {"a": {"type": "string"}}}')
    assert res.exit_code == 0, res.output
    assert read_output(tmp_path / "out").column("structured_valid").to_pylist() == [None] * 3


def test_a_template_that_fails_on_the_sample_rows_fails_the_job(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 12)
    res = _run(fake_engine, tmp_path / "in.parquet", tmp_path / "out",
               "--prompt-template", "Say {{ prompt.split()[1] | int // 0 }}", "--id-column", "id")
    assert res.exit_code == 1, res.output
    assert (f"Error: --prompt-template fails on row 0 (id=0) of {tmp_path / 'in.parquet'} "
            "(and on the 7 other rows tried): ZeroDivisionError: integer division or modulo "
            "by zero; every row would fail with it") in res.output
    assert FakeLLM.instances == [] and not (tmp_path / "out").exists()


def test_a_template_failing_on_some_rows_only_runs_the_job(fake_engine, tmp_path):
    # Row 0 divides by zero and row 1 has a null: the sample rows without nulls render,
    # so the job runs, and those rows are its error rows.
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "n": [0, None, 2, 4]}),
                   tmp_path / "in.parquet")
    res = _run(fake_engine, tmp_path / "in.parquet", tmp_path / "out",
               "--prompt-template", "{{ 100 // n }}", "--id-column", "id")
    assert res.exit_code == 3, res.output
    out = read_output(tmp_path / "out")
    assert out.column("error_code").to_pylist() == ["template_error", "template_error",
                                                    None, None]


def _half_bad(path, num_rows: int):
    """Rows whose prompt is null at every index but multiples of 3."""
    pq.write_table(pa.table({"id": list(range(num_rows)), "prompt": [
        f"p{i}" if i % 3 == 0 else None for i in range(num_rows)]}), path)


def test_max_error_rate_stops_the_job_with_the_resume_command(fake_engine, tmp_path):
    _half_bad(tmp_path / "in.parquet", 12)
    flags = ["--partition-rows", "2", "--partitions-per-worker", "1"]  # parts commit in order
    res = _run(fake_engine, tmp_path / "in.parquet", tmp_path / "out", *flags)
    assert res.exit_code == 1, res.output
    assert ("Error: 4 of the 6 rows committed are errors (67%: null_prompt 4), past "
            "--max-error-rate 0.5; the job stopped, its committed parts kept. Fix what the "
            "`error` column names and resume, or pass --max-error-rate 1 to finish with "
            "error rows") in res.stderr
    resume = (f"resume with: fusegen run --model {fake_engine} --input {tmp_path / 'in.parquet'} "
              f"--output {tmp_path / 'out'} --max-tokens 2 --progress none --partition-rows 2 "
              "--partitions-per-worker 1")
    assert resume in res.stderr
    # 1 of 2 rows, then 2 of 4 (at the limit), then 4 of 6: past it, the job stops.
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*")) == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["status"] == "failed" and "max-error-rate" in manifest["error"]
    # The limit is no part of the job's identity: raising it resumes the same output.
    done = _run(fake_engine, tmp_path / "in.parquet", tmp_path / "out", *flags,
                "--max-error-rate", "1")
    assert done.exit_code == 3, done.output
    assert "(6 parts, 3 kept from an earlier run)" in done.stdout
    assert "rows: 12, errors: 8 (null_prompt 8)" in done.stdout


def test_max_error_rate_from_the_job_file_and_python(fake_engine, tmp_path):
    _half_bad(tmp_path / "in.parquet", 12)
    job = write_job(tmp_path, fake_engine, max_tokens=2, partition_rows=2,
                    partitions_per_worker=1, max_error_rate=0.6)
    res = CliRunner().invoke(main, ["run", job])
    assert res.exit_code == 1 and "past --max-error-rate 0.6" in res.stderr
    spec = JobSpec(model=fake_engine, input=str(tmp_path / "in.parquet"),
                   output=str(tmp_path / "py"), max_tokens=2, partition_rows=6,
                   partitions_per_worker=1, progress="none", max_error_rate=0.9)
    result = run_job(spec)  # 8 of 12 rows (67%) are errors: under 0.9
    assert (result.num_rows, result.num_errors) == (12, 8)
    with pytest.raises(ErrorRateExceeded, match="5 of the 8 rows committed"):
        run_job(JobSpec(model=fake_engine, input=str(tmp_path / "in.parquet"),
                        output=str(tmp_path / "py2"), max_tokens=2, partition_rows=4,
                        partitions_per_worker=1, progress="none", max_error_rate=0.6))


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True, float("nan")])
def test_max_error_rate_must_be_a_fraction(value):
    with pytest.raises(JobError, match=r"max_error_rate must be a fraction of rows in \[0, 1\]"):
        JobSpec(model="/m", input="i", output="o", max_error_rate=value)


def test_max_error_rate_leaves_the_fingerprint_alone():
    inputs = [{"path": "i", "num_rows": 3, "size": 10, "version": None}]
    base = JobSpec(model="/m", input="i", output="o")
    strict = JobSpec(model="/m", input="i", output="o", max_error_rate=0.0)
    assert "max_error_rate" not in strict.output_config()
    assert strict.output_config() == base.output_config()
    from fusegen.jobs.output import output_fingerprint

    assert output_fingerprint(strict.output_config(), inputs) == \
        output_fingerprint(base.output_config(), inputs)


def test_error_rate_policy():
    def part(rows, errors):
        return PartStats("p", "fp", num_rows=rows, num_errors=errors,
                         errors_by_code={"null_prompt": errors} if errors else {})

    rate = ErrorRate(0.5, num_planned=4)
    rate.check([part(4, 4)])  # the first part alone: a sample, never judged
    rate.check([part(4, 4), part(4, 0)])  # 4 of 8: at the limit, not past it
    with pytest.raises(ErrorRateExceeded, match=r"5 of the 12 rows committed are errors "
                       r"\(42%: null_prompt 5\), past --max-error-rate 0.4"):
        ErrorRate(0.4, 4).check([part(4, 4), part(4, 0), part(4, 1)])
    # parts kept from an earlier run count with this run's
    with pytest.raises(ErrorRateExceeded, match="5 of the 12 rows committed"):
        ErrorRate(0.4, 4, kept=[part(4, 4), part(4, 0)]).check([part(4, 1)])
    ErrorRate(0.4, 4, kept=[part(4, 4)]).check([])  # one part in all: not judged yet
    last = ErrorRate(0.0, num_planned=2)
    last.check([part(4, 4), part(4, 4)])  # every part committed: stopping would save nothing
    assert errors_by_code([part(2, 1), PartStats("q", "fp", num_rows=3, num_errors=3,
                                                 errors_by_code={"prompt_too_long": 2,
                                                                 "null_prompt": 1})]) == \
        {"null_prompt": 2, "prompt_too_long": 2}


def test_help_documents_the_exit_status():
    text = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    assert "Exit status:" in text
    assert "  3  the job finished, but some rows are errors" in text
    assert "--max-error-rate" in text and "[default: 0.5]" in text
