"""Workflows after things went wrong: a SIGKILLed run resumed by id, a damaged transform
part recomputed, a torn manifest named as such, the failure hint's run id, and logs that
say only what happened (a first run changed nothing)."""
import logging
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from fusegen.jobs.cli import main
from fusegen.workflows import steps as wf_steps
from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.run import run_workflow, utc_now
from fusegen.workflows.spec import load_workflow
from fusegen.workflows.store import new_owner, open_store
from jobs_fixtures import read_output

REPO = Path(__file__).resolve().parent.parent
RUN_DATE = "2024-05-01"
EVEN_IDS = list(range(0, 20, 2))


def _file(root: Path, output=None, filter="id % 2 == 0") -> str:
    """20 rows -> a (filter, 5 rows a partition) -> b (select id)."""
    if not (root / "in.parquet").exists():  # rewritten, it would be another input
        pq.write_table(pa.table({"id": list(range(20)), "x": [f"v{i}" for i in range(20)]}),
                       root / "in.parquet")
    a = {"input": "in.parquet", "filter": filter, "partition_rows": 5}
    if output:
        a["output"] = output
    doc = {"name": "twostep", "workdir": "work",
           "steps": {"a": a, "b": {"from": "a", "select": ["id"], "partition_rows": 5}}}
    path = root / "wf.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def _kill_holding_the_lock(store_url: str, wf: str) -> None:
    """A process that starts a run of `wf` (taking its lock) and is SIGKILLed in it."""
    code = ("import os, signal\n"
            "from fusegen.workflows.spec import load_workflow\n"
            "from fusegen.workflows.run import utc_now\n"
            "from fusegen.workflows.store import open_store, new_owner\n"
            f"wf = load_workflow({wf!r})\n"
            f"open_store({store_url!r}).start_run(wf.name, source=wf.path, "
            f"run_date={RUN_DATE!r}, params={{}}, owner=new_owner(), now=utc_now())\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()


def test_resume_takes_over_the_lock_of_a_killed_run(tmp_path):
    wf = _file(tmp_path)
    store_url = f"sqlite:///{tmp_path}/runs.db"
    _kill_holding_the_lock(store_url, wf)
    store = open_store(store_url)
    assert store.run(1).status == "running" and store.lock("twostep").run_id == 1

    result = CliRunner().invoke(main, ["workflow", "resume", "1", "--store", store_url])
    assert result.exit_code == 0, result.output
    assert "run 2 of twostep (2024-05-01) succeeded" in result.output
    killed, resumed = store.run(1), store.run(2)
    assert (killed.status, killed.error) == \
        ("interrupted", "the process running it stopped (killed or lost)")
    assert (resumed.status, resumed.resumes) == ("succeeded", 1)
    assert store.lock("twostep") is None
    assert read_output(tmp_path / "work" / "b").column("id").to_pylist() == EVEN_IDS


def test_resume_still_refuses_a_live_run(tmp_path):
    wf = load_workflow(_file(tmp_path))
    store_url = f"sqlite:///{tmp_path}/runs.db"
    store = open_store(store_url)
    owner = new_owner()
    store.start_run(wf.name, source=wf.path, run_date=RUN_DATE, params={}, owner=owner,
                    now=utc_now())
    result = CliRunner().invoke(main, ["workflow", "resume", "1", "--store", store_url])
    assert result.exit_code == 1
    host, pid, _ = owner.rsplit(":", 2)
    assert f"run 1 is running (pid {pid} on {host}); wait for it to end" in result.output
    assert store.run(1).status == "running"


def _flip_page_bytes(path: Path) -> None:
    """Damage a part's data pages, leaving its footer (and so its PartStats) readable."""
    data = bytearray(path.read_bytes())
    for i in range(8, 40):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_transform_part_is_recomputed(tmp_path):
    wf = _file(tmp_path)
    store = open_store(tmp_path / "runs.db")
    run_workflow(load_workflow(wf), store, run_date=RUN_DATE)
    reference = read_output(tmp_path / "work" / "b")
    _flip_page_bytes(tmp_path / "work" / "a" / "part-00001.parquet")
    for part in (tmp_path / "work" / "b").glob("part-*"):  # b never read the damaged part
        part.unlink()
    (tmp_path / "work" / "b" / "_manifest.json").unlink()

    outcome = run_workflow(load_workflow(wf), store, run_date=RUN_DATE)
    counts = {s.name: (s.counts.num_parts, s.counts.num_parts_kept) for s in outcome.steps}
    assert counts == {"a": (4, 3), "b": (4, 0)}
    assert read_output(tmp_path / "work" / "b").equals(reference)
    assert read_output(tmp_path / "work" / "a").column("id").to_pylist() == EVEN_IDS


def test_a_torn_manifest_is_named_not_diffed(tmp_path):
    wf = _file(tmp_path, output="out/a")
    store = open_store(tmp_path / "runs.db")
    run_workflow(load_workflow(wf), store, run_date=RUN_DATE)
    manifest = tmp_path / "out" / "a" / "_manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    with pytest.raises(WorkflowError) as info:
        run_workflow(load_workflow(wf), store, run_date=RUN_DATE)
    message = str(info.value)
    assert message == (
        f"step 'a' failed: output {tmp_path}/out/a holds part files and a _manifest.json "
        "that is damaged or not fusegen's, so they cannot be matched to this job; pass "
        "--overwrite to replace them or choose another --output")
    assert "None ->" not in message


def test_the_failure_hint_names_the_run(tmp_path, monkeypatch):
    wf = _file(tmp_path)
    store = f"sqlite:///{tmp_path}/runs.db"
    runner = CliRunner()
    assert runner.invoke(main, ["workflow", "run", wf, "--run-date", RUN_DATE,
                                "--store", store]).exit_code == 0

    def broken(*args):
        raise OSError("bucket unreachable (injected)")

    monkeypatch.setattr(wf_steps, "_transform_part", broken)
    result = runner.invoke(main, ["workflow", "run", wf, "--run-date", RUN_DATE, "--overwrite",
                                  "--store", store])
    assert result.exit_code == 1
    assert (f"to continue where it stopped: fusegen workflow run {wf} --run-date {RUN_DATE} "
            f"--store {store} (or fusegen workflow resume 2 --store {store})") in result.output
    assert "RUN_ID" not in result.output
    again = runner.invoke(main, ["workflow", "resume", "2", "--store", store])
    assert again.exit_code == 1
    assert (f"to continue where it stopped: fusegen workflow resume 3 --store {store}"
            in again.output)


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fusegen.workflows"]


def test_a_first_run_logs_no_change_and_a_rerun_says_what_changed(tmp_path, caplog):
    store = open_store(tmp_path / "runs.db")
    with caplog.at_level(logging.INFO, logger="fusegen.workflows"):
        run_workflow(load_workflow(_file(tmp_path)), store, run_date=RUN_DATE)
    assert [m for m in _messages(caplog) if "changed" in m or "recomput" in m] == []

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fusegen.workflows"):
        run_workflow(load_workflow(_file(tmp_path, filter="id % 2 == 1")), store,
                     run_date=RUN_DATE)
    assert [m for m in _messages(caplog) if "changed" in m or "recomput" in m] == [
        "step a: its definition or input changed since its output was made; recomputing it",
        "step b: step 'a' recomputed parts in this run; recomputing it"]


def test_a_torn_intermediate_manifest_is_recomputed_and_said_so(tmp_path, caplog):
    wf = _file(tmp_path)
    store = open_store(tmp_path / "runs.db")
    run_workflow(load_workflow(wf), store, run_date=RUN_DATE)
    (tmp_path / "work" / "a" / "_manifest.json").write_text('{"fingerp')
    with caplog.at_level(logging.INFO, logger="fusegen.workflows"):
        outcome = run_workflow(load_workflow(wf), store, run_date=RUN_DATE)
    assert [m for m in _messages(caplog) if "recomput" in m] == [
        "step a: its output's _manifest.json is damaged; recomputing it",
        "step b: step 'a' recomputed parts in this run; recomputing it"]
    assert [s.counts.num_parts_kept for s in outcome.steps] == [0, 0]
    assert read_output(tmp_path / "work" / "b").column("id").to_pylist() == EVEN_IDS


def test_a_damaged_input_file_is_named(tmp_path):
    wf = _file(tmp_path)
    _flip_page_bytes(tmp_path / "in.parquet")
    with pytest.raises(WorkflowError) as info:
        run_workflow(load_workflow(wf), open_store(tmp_path / "runs.db"), run_date=RUN_DATE)
    assert str(info.value).startswith(f"step 'a' failed: cannot read rows 0-4 of "
                                      f"{tmp_path}/in.parquet: ")
    assert str(info.value).endswith("; if it is a part of an earlier step's output, delete "
                                    "that part and rerun: the step recomputes it")
