"""`fusegen run` through click: help, job file + overrides, errors, progress output."""
import io
import logging

import pyarrow.parquet as pq
from click.testing import CliRunner

from fusegen.jobs.cli import main
from fusegen.jobs.progress import JobResult, Progress
from fusegen.jobs.spec import FIELD_NAMES
from jobs_fixtures import fake_engine, write_job, write_prompts  # noqa: F401


def test_help_documents_every_option_with_its_default():
    text = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    for name in FIELD_NAMES:  # every job-file key: the job's, the engine's, the sampling's
        flag = "--" + name.replace("_", "-")
        assert (flag if name != "storage_options" else "--storage-option") in text, flag
    assert "Rows per partition (and per output part) at most.  [default: 1000]" in text
    assert "Column holding the prompt text.  [default: prompt]" in text
    assert text.count("[default:") >= len(FIELD_NAMES) - 1


def test_job_file_with_flag_overrides(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 6)
    job = write_job(tmp_path, fake_engine, max_tokens=2, **{"partition-rows": 4})
    res = CliRunner().invoke(main, ["run", job, "--max-tokens", "5",
                                    "--storage-option", "auto_mkdir=true"])
    assert res.exit_code == 0, res.output
    assert "rows: 6, errors: 0" in res.output
    assert "tokens: 54 prompt, 30 generated" in res.output
    table = pq.read_table(tmp_path / "out" / "part-00000.parquet")
    assert table.column("num_generated_tokens").to_pylist() == [5] * 4


def test_errors_exit_nonzero_with_redacted_message(fake_engine, tmp_path):
    res = CliRunner().invoke(main, ["run", "--model", fake_engine, "--input",
                                    "memory://nobody:hunter2secret@nowhere/in.parquet",
                                    "--output", str(tmp_path / "out"),
                                    "--storage-option", "client_kwargs.token=tok-abcdef"])
    assert res.exit_code == 1
    assert "Error: input memory://***@nowhere/in.parquet does not exist" in res.output
    assert "hunter2secret" not in res.output and "tok-abcdef" not in res.output


def test_missing_required_option(tmp_path):
    res = CliRunner().invoke(main, ["run", "--model", "m", "--input", "i"])
    assert res.exit_code == 1 and "output is required: pass --output" in res.output


def test_progress_log_lines(caplog):
    p = Progress(10, done_rows=2, mode="log", stream=io.StringIO(), log_every=0.0)
    with caplog.at_level(logging.INFO, logger="fusegen.progress"):
        p.partial(0, 1, 10)  # part 0 running: 1 row done so far
        p.partial(1, 2, 20)
        p.advance(0, 4, 40)  # part 0 committed with 4 rows
        p.partial(0, 3, 30)  # late report of a committed part: ignored
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split("] ")[1].split(" rows")[0] for line in lines] == ["3/10", "5/10", "8/10"]
    assert "tok/s | ETA 0:00:" in lines[-1]


def test_progress_bar_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    p = Progress(8, stream=stream)
    p.advance(0, 8, 16)
    p.close()
    assert p.mode == "bar" and stream.getvalue().startswith("\r[" + "#" * 30 + "] 8/8 rows (100%)")


def test_summary_lists_errors_by_code_and_throughput():
    r = JobResult("out", num_rows=10, num_errors=3, errors_by_code={"null_prompt": 2,
                  "prompt_too_long": 1}, num_prompt_tokens=50, num_generated_tokens=70,
                  num_parts=2, num_parts_skipped=1, rows_computed=5, tokens_computed=35,
                  wall_seconds=2.0)
    assert r.summary().splitlines() == [
        "output: out (2 parts, 1 kept from an earlier run)",
        "rows: 10, errors: 3 (null_prompt 2, prompt_too_long 1)",
        "tokens: 50 prompt, 70 generated",
        "wall time: 2.0 s; this run: 2.5 rows/s, 17.5 output tokens/s"]
