"""Jobs over an engine with a device group: the same rows and tokens as one device, a
killed rank's partitions retried on a fresh group, and each Dask worker's own GPUs."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from fusegen.jobs import engines
from fusegen.jobs.cluster import worker_devices
from fusegen.jobs.errors import JobError
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import read_output, tiny_model_dir, write_prompts


def _spec(inp, out, **kw):
    kw = {"model": tiny_model_dir(), "max_tokens": 24, "partition_rows": 8, "max_num_seqs": 8,
          "progress": "none", "temperature": 0.0, "dtype": "float32", "output_token_ids": True, **kw}
    return JobSpec(input=str(inp), output=str(out), **kw)


def _rows(out) -> list[tuple]:
    table = read_output(str(out)).sort_by("id")
    return list(zip(table["id"].to_pylist(), table["generated_token_ids"].to_pylist()))


def _ranks() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "fusegen.engine.parallel" in " ".join(p.cmdline())]


def test_each_worker_gets_its_own_gpus_for_its_group():
    workers = ["tcp://a:1", "tcp://b:2"]
    assert worker_devices(workers, 4, "cuda", external=False, group_size=2) == \
        {"tcp://a:1": "cuda:0,1", "tcp://b:2": "cuda:2,3"}
    assert worker_devices(workers, 8, "auto", external=False, group_size=4) == \
        {"tcp://a:1": "cuda:0,1,2,3", "tcp://b:2": "cuda:4,5,6,7"}
    # one rank per engine keeps the one-GPU-per-worker rule; CPUs and external clusters
    # keep the option (each external worker groups the GPUs its machine shows it)
    assert worker_devices(workers, 2, "cuda", external=False) == \
        {"tcp://a:1": "cuda:0", "tcp://b:2": "cuda:1"}
    assert worker_devices(workers, 0, "cpu", external=False, group_size=2) == \
        {w: "cpu" for w in workers}
    assert worker_devices(workers, 0, "cuda", external=True, group_size=2) == \
        {w: "cuda" for w in workers}
    with pytest.raises(JobError) as info:
        worker_devices(workers, 3, "cuda", external=False, group_size=2)
    assert str(info.value) == ("2 worker(s) x a device group of 2 ranks (tensor_parallel_size "
                               "x pipeline_parallel_size) need 4 GPUs; this machine has 3: "
                               "lower --workers or the group's size")


def test_tensor_parallel_job_equals_single_device_job(tmp_path):
    """`fusegen run --tensor-parallel-size 2` over Parquet: the single-device job's rows."""
    from click.testing import CliRunner

    from fusegen.jobs.cli import main

    write_prompts(tmp_path / "in.parquet", 24)
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "one"))
    args = ["run", "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "two"),
            "--model", tiny_model_dir(), "--max-tokens", "24", "--partition-rows", "8",
            "--max-num-seqs", "8", "--temperature", "0", "--dtype", "float32",
            "--output-token-ids", "--progress", "none", "--tensor-parallel-size", "2"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert _rows(tmp_path / "two") == _rows(tmp_path / "one")
    assert [r[0] for r in _rows(tmp_path / "two")] == list(range(24))
    assert _ranks() == []


def test_killed_rank_mid_job_retries_its_partitions_on_a_fresh_group(tmp_path):
    """SIGKILL to one rank while partitions run: those partitions fail with
    device_group_failed, run again on a fresh group, and the job's output equals an
    uninterrupted one, every id exactly once."""
    write_prompts(tmp_path / "in.parquet", 32)
    spec = dict(tensor_parallel_size=2, max_tokens=48)
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "whole", **spec))
    killed = []

    def kill_a_rank():  # once the in-process worker's engine has run a few steps
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            llm = next(iter(engines._engines.values()), None)
            if llm is not None and llm.engine.stats.num_steps >= 3:
                pid = llm.engine.runner.group.pids[1]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.01)
    thread = threading.Thread(target=kill_a_rank)
    thread.start()
    result = run_job(_spec(tmp_path / "in.parquet", tmp_path / "killed", **spec))
    thread.join()
    assert killed, "no rank was killed"
    assert result.num_rows == 32 and result.num_errors == 0
    assert _rows(tmp_path / "killed") == _rows(tmp_path / "whole")
    assert _ranks() == []
