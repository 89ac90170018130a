"""Paths the workers can reach: relative local paths made absolute on the driver, local
disk refused for a scheduler on another machine, and a worker that dies mid-job named in
the job's log with the partitions Dask retries."""
import logging
import os
import socket

import pytest

from fusegen.jobs import driver, shared_paths
from fusegen.jobs.errors import JobError
from fusegen.jobs.driver import run_job
from fusegen.jobs.shared_paths import is_shared_path, scheduler_is_remote
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import fake_engine, read_output, write_prompts  # noqa: F401

REMOTE = "tcp://203.0.113.7:8786"  # TEST-NET-3: another machine, never reached


def test_relative_paths_are_resolved_on_the_driver_not_in_each_workers_directory(
        fake_engine, tmp_path, monkeypatch):
    write_prompts(tmp_path / "in.parquet", 5)
    elsewhere = tmp_path / "worker-cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    real = driver.run_partition

    def in_another_directory(*args):  # a worker started in another working directory
        os.chdir(elsewhere)
        return real(*args)

    monkeypatch.setattr(driver, "run_partition", in_another_directory)
    result = run_job(JobSpec(model=fake_engine, input="in.parquet", output="out",
                             max_tokens=2, partition_rows=2, progress="none"))
    assert result.output == str(tmp_path / "out") and result.num_rows == 5
    assert read_output(tmp_path / "out").column("id").to_pylist() == list(range(5))
    assert os.listdir(elsewhere) == []


@pytest.fixture
def mounts(tmp_path, monkeypatch):
    """This machine's mount table: the root on local disk, tmp_path/shared over NFS."""
    table = tmp_path / "mounts"
    table.write_text(f"overlay / overlay rw 0 0\n"
                     f"nas:/export {tmp_path / 'shared'} nfs4 rw 0 0\n")
    monkeypatch.setattr(shared_paths, "_MOUNTS", str(table))
    (tmp_path / "shared").mkdir()
    return table


def test_a_remote_scheduler_refuses_local_disk_naming_the_path(fake_engine, tmp_path,
                                                                monkeypatch, mounts):
    write_prompts(tmp_path / "in.parquet", 3)
    write_prompts(tmp_path / "shared" / "in.parquet", 3)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JobError) as info:
        run_job(JobSpec(model=fake_engine, input="in.parquet", output="shared/out",
                        scheduler=REMOTE, progress="none"))
    assert str(info.value) == (
        f"input {tmp_path}/in.parquet is on this machine's local disk, which the workers of "
        f"--scheduler {REMOTE} (another machine) cannot reach; put it on a shared "
        "filesystem that every worker mounts at the same path (NFS, Lustre...) or in an "
        "object store (s3://, gs://...)")
    with pytest.raises(JobError, match=f"^output {tmp_path}/out is on this machine's local "
                       "disk, which the workers of --scheduler"):
        run_job(JobSpec(model=fake_engine, input="shared/in.parquet", output="out",
                        scheduler=REMOTE, progress="none"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "shared" / "out").exists()


def test_shared_path_is_the_type_of_the_mount_that_holds_it():
    table = ("overlay / overlay rw 0 0\n"
             "nas:/export /mnt/data nfs4 rw 0 0\n"
             "/dev/sdb1 /mnt/data/scratch ext4 rw 0 0\n"
             "fs@tcp:/lustre /mnt/my\\040lustre lustre rw 0 0\n")
    assert is_shared_path("/mnt/data/run/out", table) is True
    assert is_shared_path("/mnt/data", table) is True
    assert is_shared_path("/mnt/data/scratch/out", table) is False  # a local disk inside
    assert is_shared_path("/mnt/database/out", table) is False  # not under /mnt/data
    assert is_shared_path("/mnt/my lustre/x", table) is True
    assert is_shared_path("/home/me/out", table) is False


def test_scheduler_addresses_of_this_machine_are_not_remote():
    assert not scheduler_is_remote("tcp://127.0.0.1:8786")
    assert not scheduler_is_remote("localhost:8786")
    assert not scheduler_is_remote("inproc://10.0.0.1/123/1")
    assert not scheduler_is_remote(f"tcp://{socket.gethostname()}:8786")
    assert scheduler_is_remote(REMOTE)
    assert scheduler_is_remote("tcp://no-such-host.invalid:8786")


def test_a_worker_that_leaves_mid_job_is_named_with_its_partitions(caplog):
    parts_of = {"fusegen-abc-part-00003.parquet-t1": "part-00003.parquet",
                "fusegen-abc-part-00001.parquet-t1": "part-00001.parquet",
                "fusegen-abc-part-00002.parquet-t1": "part-00002.parquet"}
    with caplog.at_level(logging.WARNING, logger="fusegen.jobs"):
        driver._worker_left({"action": "remove-worker", "worker": "tcp://10.0.0.9:4001",
                             "processing-tasks": {"fusegen-abc-part-00003.parquet-t1",
                                                  "fusegen-abc-part-00001.parquet-t1",
                                                  "other-job-key"},
                             # finished there, its result not collected: computed again
                             "lost-computed-tasks": {"fusegen-abc-part-00002.parquet-t1"},
                             "expected": False}, parts_of)
        driver._worker_left({"action": "remove-worker", "worker": "tcp://10.0.0.8:4001",
                             "processing-tasks": {"other-job-key"}, "expected": False},
                            parts_of)  # ran nothing of this job: not this job's news
        driver._worker_left({"action": "add-worker", "worker": "tcp://10.0.0.7:4001"},
                            parts_of)
    assert [r.getMessage() for r in caplog.records] == [
        "worker tcp://10.0.0.9:4001 died while running part-00001.parquet, "
        "part-00002.parquet, part-00003.parquet; Dask retries them on the other workers"]
