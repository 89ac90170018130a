"""One run at a time per output: a second run is refused naming the holder, a dead run's
lease is taken over, a run that lost its lease commits nothing more."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import pytest

from fusegen.jobs import engines, lease
from fusegen.jobs.errors import JobError
from fusegen.jobs.output import Output, PartStats
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import FakeLLM, fake_engine, read_output, write_prompts  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
HOST = socket.gethostname()


def _spec(model, inp, out, **kw):
    kw = {"max_tokens": 3, "partition_rows": 4, "progress": "none", **kw}
    return JobSpec(model=model, input=str(inp), output=str(out), **kw)


def _holder(**kw) -> dict:
    now = time.time()
    return {"owner": "f" * 32, "host": "elsewhere", "pid_ns": "pid:[1]", "pid": 4242,
            "pid_started": now - 100, "acquired": now - 100, "heartbeat": now, **kw}


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_second_run_on_a_held_output_is_refused_naming_the_holder(fake_engine, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setattr(engines, "_load", lambda m, kw: FakeLLM(m, step_seconds=0.02, **kw))
    write_prompts(tmp_path / "in.parquet", 8)
    out = tmp_path / "out"
    first = _spec(fake_engine, tmp_path / "in.parquet", out, max_tokens=20)
    outcome = []
    job = threading.Thread(target=lambda: outcome.append(run_job(first)))
    job.start()
    _wait_for(lambda: (out / "_lease.json").exists())
    second = _spec(fake_engine, tmp_path / "in.parquet", out, partition_rows=3, max_tokens=8)
    with pytest.raises(JobError) as info:
        run_job(second)
    assert str(info.value).startswith(
        f"output {out} is in use by another fusegen run (pid {os.getpid()} on {HOST}, "
        "holding it since ")
    assert "wait for it to finish or stop it, or choose another output" in str(info.value)
    job.join(timeout=60)
    assert outcome and outcome[0].num_rows == 8
    table = read_output(out)  # the first run's rows only, once each
    assert table.column("id").to_pylist() == list(range(8))
    assert table.column("num_generated_tokens").to_pylist() == [20] * 8
    assert sorted(os.listdir(out)) == ["_manifest.json", "part-00000.parquet",
                                       "part-00001.parquet"]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["fingerprint"] == first.fingerprint(manifest["inputs"])
    assert len(manifest["runs"]) == 1


_HOLD = """
import sys, time
import fsspec
from fusegen.jobs.lease import Lease
lease = Lease(fsspec.filesystem("file"), sys.argv[1], sys.argv[1])
lease.acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_another_process_holds_until_it_dies_then_the_output_is_taken_over(fake_engine,
                                                                           tmp_path, caplog):
    write_prompts(tmp_path / "in.parquet", 5)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(JobError, match=rf"^output {out} is in use by another fusegen run "
                                           rf"\(pid {holder.pid} on {HOST}, holding it since"):
            run_job(_spec(fake_engine, tmp_path / "in.parquet", out))
        assert sorted(os.listdir(out)) == ["_lease.json"]  # nothing written, no manifest
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with caplog.at_level(logging.WARNING, logger="fusegen.jobs"):
        assert run_job(_spec(fake_engine, tmp_path / "in.parquet", out)).num_rows == 5
    assert f"taking over the lease of a run that is gone (pid {holder.pid} on {HOST}" \
        in caplog.text
    assert sorted(os.listdir(out)) == ["_manifest.json", "part-00000.parquet",
                                       "part-00001.parquet"]


def test_a_lease_from_another_machine_is_live_until_its_heartbeat_is_stale(fake_engine,
                                                                           tmp_path):
    write_prompts(tmp_path / "in.parquet", 3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "_lease.json").write_text(json.dumps(_holder(heartbeat=time.time() - 5)))
    with pytest.raises(JobError, match=r"in use by another fusegen run \(pid 4242 on "
                                       r"elsewhere, .*last heartbeat [56] s ago\)"):
        run_job(_spec(fake_engine, tmp_path / "in.parquet", out))
    stale = time.time() - lease.STALE_SECONDS - 1
    (out / "_lease.json").write_text(json.dumps(_holder(heartbeat=stale)))
    assert run_job(_spec(fake_engine, tmp_path / "in.parquet", out)).num_rows == 3
    assert not (out / "_lease.json").exists()


def test_a_damaged_lease_is_nobodys(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 3)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "_lease.json").write_text('{"owner": "torn')
    assert run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out")).num_rows == 3


def _stats(name="part-00000.parquet"):
    return PartStats(name, "fp", num_rows=1)


@pytest.mark.parametrize("url", ["memory://fusegen-lease-test/out", "LOCAL"])
def test_a_run_that_lost_its_lease_commits_nothing(tmp_path, url):
    import pyarrow as pa

    url = str(tmp_path / "out") if url == "LOCAL" else url
    plan = []
    first = Output(url, {})
    first.prepare("fp", {}, plan, overwrite=False)
    first.start({"fingerprint": "fp"})
    worker = Output(url, {}, owner=first.owner)  # a worker of the first run
    worker.commit(pa.table({"x": [1]}), _stats())
    # A run on another thread takes over only a lease left by its own thread: here the
    # first run's thread is this one, so a second prepare here takes its lease over.
    second = Output(url, {})
    second.prepare("fp", {}, plan, overwrite=False)
    with pytest.raises(JobError, match=r"this run no longer holds the output \(pid "
                                       rf"{os.getpid()} on {HOST}, .*\); it stopped without "
                                       "committing more parts"):
        worker.commit(pa.table({"x": [2]}), _stats("part-00001.parquet"))
    assert not second.fs.exists(f"{second.path}/part-00001.parquet")
    with pytest.raises(JobError, match="no longer holds the output"):
        first.finish({})
    second.finish({})
    assert not second.fs.exists(f"{second.path}/_lease.json")
    if url.startswith("memory"):
        second.fs.rm(second.path, recursive=True)


def test_a_lease_held_by_another_live_thread_of_this_process_is_live(tmp_path):
    url = str(tmp_path / "out")
    taken, done = threading.Event(), threading.Event()

    def hold():
        output = Output(url, {})  # held while referenced
        output.prepare("fp", {}, [], overwrite=False)
        taken.set()
        done.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        taken.wait(30)
        with pytest.raises(JobError, match="in use by another fusegen run"):
            Output(url, {}).prepare("fp", {}, [], overwrite=False)
    finally:
        done.set()
        thread.join()
    # its thread is gone: the lease it left is taken over
    Output(url, {}).prepare("fp", {}, [], overwrite=False)


def test_the_holder_renews_its_heartbeat_and_releases_when_collected(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "HEARTBEAT_SECONDS", 0.05)
    fs = fsspec.filesystem("file")
    held = lease.Lease(fs, str(tmp_path), str(tmp_path))
    held.acquire()
    first = lease.read_holder(fs, str(tmp_path / "_lease.json"))
    _wait_for(lambda: lease.read_holder(fs, str(tmp_path / "_lease.json")).heartbeat
              > first.heartbeat + 0.1)
    assert lease.read_holder(fs, str(tmp_path / "_lease.json")).owner == held.owner
    del held  # a run that forgot to release: its lease goes with it
    _wait_for(lambda: not (tmp_path / "_lease.json").exists())


def test_dead_or_live_policy():
    here = lease.Holder(**_holder(host=HOST, pid_ns="ns", pid=1, owner="me"))
    now = time.time()
    other = lease.Holder(**_holder(heartbeat=now - lease.STALE_SECONDS + 1))
    assert not lease.is_dead(other, now, here, alive=lambda h: False)
    assert lease.is_dead(other, now + 2, here, alive=lambda h: True)
    local = lease.Holder(**_holder(host=HOST, pid_ns="ns", heartbeat=now))
    assert lease.is_dead(local, now, here, alive=lambda h: False)  # its process is gone
    assert not lease.is_dead(local, now + 3600, here, alive=lambda h: True)
    other_ns = lease.Holder(**_holder(host=HOST, pid_ns="other", heartbeat=now))
    assert not lease.is_dead(other_ns, now, here, alive=lambda h: False)  # pids not comparable
