"""Nothing lost, nothing doubled: a SIGKILLed job process rerun, and a Dask worker process
killed mid-partition, both end with the output of an uninterrupted run."""
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import read_output, tiny_model_dir, write_prompts

REPO = Path(__file__).resolve().parent.parent
JOB = dict(max_tokens=24, partition_rows=16, max_num_seqs=16, temperature=0.7)


def _parts(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("part-*.parquet")) if out.exists() else []


def _wait_for(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _reference(tmp_path: Path, inp: Path):
    run_job(JobSpec(model=tiny_model_dir(), input=str(inp), output=str(tmp_path / "ref"),
                    progress="none", **JOB))
    return read_output(tmp_path / "ref")


def test_sigkill_job_then_rerun_equals_uninterrupted_run(tmp_path):
    inp = tmp_path / "in.parquet"
    write_prompts(inp, 320, row_group_size=16)
    out = tmp_path / "out"
    args = [sys.executable, "-m", "fusegen.jobs.cli", "run", "--model", tiny_model_dir(),
            "--input", str(inp), "--output", str(out), "--progress", "log"]
    args += [f"--{k.replace('_', '-')}={v}" for k, v in JOB.items()]
    with open(tmp_path / "log1", "wb") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        _wait_for(lambda: len(_parts(out)) >= 2 or proc.poll() is not None)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_with = len(_parts(out))
    assert 2 <= killed_with < 20, (tmp_path / "log1").read_text()
    rerun = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert f"(20 parts, {killed_with} kept from an earlier run)" in rerun.stdout
    result = read_output(out)
    assert result.column("id").to_pylist() == list(range(320))
    assert result.equals(_reference(tmp_path, inp))
    assert _parts(out) == [f"part-{i:05d}.parquet" for i in range(20)]
    assert not (out / "_tmp").exists()


def test_killed_dask_worker_partition_is_retried_elsewhere(tmp_path, caplog):
    from distributed import Client, LocalCluster

    caplog.set_level(logging.WARNING, logger="fusegen.jobs")

    inp = tmp_path / "in.parquet"
    # 40 partitions: the job must still be mid-way when the kill lands, however fast
    # the engine runs them.
    write_prompts(inp, 640, row_group_size=16)
    out = tmp_path / "out"
    spec = JobSpec(model=tiny_model_dir(), input=str(inp), output=str(out), progress="none",
                   partitions_per_worker=2, **JOB)
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        spec.scheduler = cluster.scheduler_address
        outcome = []
        job = threading.Thread(target=lambda: outcome.append(_capture(run_job, spec)))
        job.start()
        _wait_for(lambda: len(_parts(out)) >= 1 or not job.is_alive())

        def busy_worker():
            return next((w for w, keys in client.processing().items()
                         if any("-part-" in str(k) for k in keys)), None)

        victim = None

        def pick_victim():  # the worker seen busy is the one killed, with no second look
            nonlocal victim
            victim = busy_worker()
            return victim is not None or not job.is_alive()

        _wait_for(pick_victim)
        assert victim is not None, outcome
        before = len(_parts(out))
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        job.join(timeout=300)
        # The scheduler lives in this process: a partition went to "processing" twice.
        starts = Counter(str(t[0]) for t in cluster.scheduler.transition_log
                         if "-part-" in str(t[0]) and t[2] == "processing")
        retried = [key for key, n in starts.items() if n > 1]
    print("retried:", retried, "committed before the kill:", before)
    assert before < 40 and retried, (before, starts)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    result = read_output(out)
    assert result.column("id").to_pylist() == list(range(640))
    assert result.equals(_reference(tmp_path, inp))
    assert not (out / "_tmp").exists()
    assert pq.read_metadata(out / "part-00039.parquet").num_rows == 16
    # the job's log names the dead worker and the partitions it was running
    (left,) = [r.getMessage() for r in caplog.records if "died while running" in
               r.getMessage()]
    # It names what the scheduler held on the worker when it left: partitions running,
    # queued, or finished with their results not yet collected. Which of those run again
    # depends on timing (a result may arrive as the worker dies; work stealing also moves
    # queued ones), so the test asks for a partition of this job that ran again among them.
    found = re.fullmatch(rf"worker {re.escape(victim)} died while running "
                         r"((?:part-\d{5}\.parquet(?:, )?)+); Dask retries (it|them) on the "
                         r"other workers", left)
    assert found, left
    named = found.group(1).split(", ")
    assert found.group(2) == ("it" if len(named) == 1 else "them")
    assert named == sorted(set(named))
    assert {re.search(r"part-\d+\.parquet", key).group() for key in retried} & set(named)


def _capture(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported by the test's assertion
        return exc
