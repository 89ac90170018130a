"""Ctrl-C and SIGTERM stop a job cleanly: the manifest says "interrupted", the output is
released, the user is told how many parts are committed and the command that resumes."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fusegen.jobs import driver
from fusegen.jobs.cli import main
from fusegen.jobs.interrupt import Interrupted, JobInterrupted
from fusegen.jobs.progress import Progress
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import fake_engine, read_output, tiny_model_dir, write_prompts  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def _parts(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("part-*.parquet"))


def _interrupt_after(monkeypatch, num_parts: int, exc: BaseException):
    """Progress.advance raises `exc` once `num_parts` parts have committed."""
    advance, seen = Progress.advance, []

    def advance_then_stop(self, *args):
        advance(self, *args)
        seen.append(args)
        if len(seen) == num_parts:
            raise exc

    monkeypatch.setattr(Progress, "advance", advance_then_stop)


@pytest.mark.parametrize("exc, signum", [(KeyboardInterrupt(), signal.SIGINT),
                                         (Interrupted(signal.SIGTERM), signal.SIGTERM)])
def test_an_interrupted_job_marks_its_manifest_and_resumes(fake_engine, tmp_path, monkeypatch,
                                                           exc, signum):
    write_prompts(tmp_path / "in.parquet", 40)
    out = tmp_path / "out"
    spec = JobSpec(model=fake_engine, input=str(tmp_path / "in.parquet"), output=str(out),
                   max_tokens=3, partition_rows=4, partitions_per_worker=1, progress="none")
    _interrupt_after(monkeypatch, 2, exc)
    with pytest.raises(JobInterrupted) as info:
        driver.run_job(spec)
    committed = _parts(out)
    assert 2 <= len(committed) < 10
    got = info.value
    assert (got.signum, got.num_committed, got.num_parts) == (signum, len(committed), 10)
    assert got.exit_code == 128 + signum
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert [p["name"] for p in manifest["parts"]] == committed
    assert manifest["runs"][-1]["status"] == "interrupted"
    assert not (out / "_lease.json").exists()
    result = driver.run_job(spec)  # the interrupt fired once: this run goes to the end
    assert (result.num_parts_skipped, result.num_rows) == (len(committed), 40)
    assert read_output(out).column("id").to_pylist() == list(range(40))
    assert json.loads((out / "_manifest.json").read_text())["status"] == "complete"


def test_the_cli_says_what_is_committed_and_the_exact_command_that_resumes(fake_engine,
                                                                             tmp_path,
                                                                             monkeypatch):
    write_prompts(tmp_path / "in.parquet", 5)
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {fake_engine}\nmax_tokens: 2\noverwrite: true\n")

    def interrupted(spec, *args, **kwargs):
        raise JobInterrupted(signal.SIGTERM, spec.output, num_committed=3, num_parts=7)

    monkeypatch.setattr(driver, "run_job", interrupted)
    args = ["run", str(job), "--input", str(tmp_path / "in.parquet"), "--output",
            str(tmp_path / "o u t"), "--overwrite", "--stop", "a", "--stop", "b",
            "--chat", "--storage-option", "client_kwargs.token=tok-s3cr3t-123"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 143
    assert res.output.splitlines()[-2:] == [
        f"interrupted by SIGTERM: 3 of 7 parts committed to {tmp_path / 'o u t'} "
        "(its manifest says \"interrupted\")",
        f"resume with: fusegen run {job} --input {tmp_path / 'in.parquet'} --output "
        f"'{tmp_path / 'o u t'}' --stop a --stop b --chat --storage-option "
        "client_kwargs.token=*** --no-overwrite   (put back the masked secrets)"]
    assert "tok-s3cr3t-123" not in res.output


def test_an_interrupt_before_the_output_is_touched(fake_engine, tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver, "list_input_files", stop)
    res = CliRunner().invoke(main, ["run", "--model", fake_engine, "--input", "in.parquet",
                                    "--output", str(tmp_path / "out")])
    assert res.exit_code == 130
    assert res.output.splitlines()[-2:] == [
        f"interrupted by SIGINT before any part was committed to {tmp_path / 'out'}",
        f"resume with: fusegen run --model {fake_engine} --input in.parquet --output "
        f"{tmp_path / 'out'}"]
    # before the job is built: every storage option value is masked
    monkeypatch.setattr("fusegen.jobs.run_cmd.build_spec", stop)
    res = CliRunner().invoke(main, ["run", "--output", "o", "--storage-option", "anon=false"])
    assert res.exit_code == 130
    assert res.output.splitlines()[-2:] == [
        "interrupted by SIGINT before any part was committed to the output",
        "resume with: fusegen run --output o --storage-option 'anon=***'   "
        "(put back the masked secrets)"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_cli_run_stops_cleanly_and_its_command_resumes(tmp_path, signum):
    inp, out = tmp_path / "in.parquet", tmp_path / "out"
    write_prompts(inp, 320, row_group_size=16)
    args = ["--model", tiny_model_dir(), "--input", str(inp), "--output", str(out),
            "--progress", "log", "--max-tokens", "24", "--partition-rows", "16",
            "--max-num-seqs", "16", "--temperature", "0.7"]
    cli = [sys.executable, "-m", "fusegen.jobs.cli", "run"]
    proc = subprocess.Popen(cli + args, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(_parts(out)) < 2 and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    committed = _parts(out)
    assert 2 <= len(committed) < 20
    name = signal.Signals(signum).name
    lines = stderr.splitlines()
    assert lines[-2] == (f"interrupted by {name}: {len(committed)} of 20 parts committed to "
                         f"{out} (its manifest says \"interrupted\")"), stderr
    assert lines[-1] == "resume with: fusegen run " + shlex.join(args)
    assert "Aborted!" not in stderr and "Traceback" not in stderr
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "interrupted" and not (out / "_lease.json").exists()
    if signum == signal.SIGINT:
        return  # the same stop; the resume is checked once, below
    resume = shlex.split(lines[-1].removeprefix("resume with: "))
    assert resume[:2] == ["fusegen", "run"]
    again = subprocess.run(cli + resume[2:], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"(20 parts, {len(committed)} kept from an earlier run)" in again.stdout
    assert read_output(out).column("id").to_pylist() == list(range(320))
    assert os.listdir(out).count("_lease.json") == 0
