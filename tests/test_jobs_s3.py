"""An S3 API (moto's server on 127.0.0.1) through s3fs: read, write, resume, and no
credential in logs, errors, the manifest or the output objects."""
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusegen.jobs.errors import JobError
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import fake_engine, read_output  # noqa: F401

s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

KEY, SECRET = "AKIAFUSEGENTEST0001", "fusegen-s3cr3t-value-1234"


@pytest.fixture(scope="module")
def s3_options():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": KEY, "secret": SECRET,
               "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("prompts")
    with fs.open("prompts/data/a.parquet", "wb") as f:
        pq.write_table(pa.table({"id": list(range(10)), "prompt": [f"s3 {i}" for i in range(10)]}),
                       f, row_group_size=3)
    yield options
    server.stop()


def test_s3_round_trip_and_resume_without_leaking_credentials(fake_engine, s3_options, caplog,
                                                               capsys):
    fs = s3fs.S3FileSystem(**s3_options)
    spec = JobSpec(model=fake_engine, input="s3://prompts/data", output="s3://results/run1",
                   max_tokens=2, partition_rows=4, progress="log",
                   storage_options=s3_options)
    with caplog.at_level(logging.INFO):
        res = run_job(spec)
        assert res.num_rows == 10 and res.num_parts == 3  # row groups 3+3+3+1 -> 3,3,4
        fs.rm("results/run1/part-00001.parquet")
        fs.invalidate_cache()
        again = run_job(spec)
    assert (again.num_parts_skipped, again.rows_computed) == (2, 3)
    out = read_output(fs, "results/run1")
    assert out.column("id").to_pylist() == list(range(10))
    assert out.column("num_generated_tokens").to_pylist() == [2] * 10
    manifest = fs.cat("results/run1/_manifest.json").decode()
    assert json.loads(manifest)["config"]["storage_options"]["secret"] == "***"
    assert "http://127.0.0.1" in manifest  # the endpoint is not a secret
    everything = caplog.text + "".join(capsys.readouterr()) + manifest
    everything += "".join(fs.cat(p).decode("latin-1") for p in fs.find("results/run1"))
    assert KEY not in everything and SECRET not in everything
    assert not fs.exists("results/run1/_tmp")


def test_s3_errors_name_the_url_not_the_credentials(fake_engine, s3_options):
    spec = JobSpec(model=fake_engine, input="s3://prompts/missing.parquet",
                   output="s3://results/run2", progress="none", storage_options=s3_options)
    with pytest.raises(JobError) as info:
        run_job(spec)
    assert "s3://prompts/missing.parquet does not exist" in str(info.value)
    # Credentials pasted into a URL are masked wherever the URL is quoted.
    spec = JobSpec(model=fake_engine, input=f"s3://{KEY}:{SECRET}@prompts/data",
                   output="s3://results/run3", progress="none", storage_options=s3_options)
    with pytest.raises(JobError) as info:
        run_job(spec)
    assert str(info.value).startswith("cannot read input s3://***@prompts/data: ")
    assert SECRET not in str(info.value) and KEY not in str(info.value)


def test_s3_output_is_held_by_one_run_and_a_rewritten_input_is_refused(fake_engine,
                                                                        s3_options):
    import os
    import socket
    import threading

    from fusegen.jobs.output import Output

    fs = s3fs.S3FileSystem(**s3_options)
    fs.copy("prompts/data/a.parquet", "prompts/held/a.parquet")
    taken, done, owner = threading.Event(), threading.Event(), []

    def hold():  # another run of this process, on its own thread
        held = Output("s3://results/held", s3_options)
        held.prepare("fp", {}, [], overwrite=False)
        owner.append(held.owner)
        taken.set()
        done.wait(60)
        held.release()

    thread = threading.Thread(target=hold)
    thread.start()
    taken.wait(60)
    fs.invalidate_cache()
    assert json.loads(fs.cat("results/held/_lease.json"))["owner"] == owner[0]
    spec = JobSpec(model=fake_engine, input="s3://prompts/held", output="s3://results/held",
                   max_tokens=2, partition_rows=4, progress="none", storage_options=s3_options)
    try:
        with pytest.raises(JobError, match=r"^output s3://results/held is in use by another "
                                           rf"fusegen run \(pid {os.getpid()} on "
                                           rf"{socket.gethostname()}, holding it since"):
            run_job(spec)
    finally:
        done.set()
        thread.join()
    assert run_job(spec).num_rows == 10
    fs.invalidate_cache()
    assert not fs.exists("results/held/_lease.json")
    etag = fs.info("prompts/held/a.parquet")["ETag"].strip('"')
    inputs = json.loads(fs.cat("results/held/_manifest.json"))["inputs"]
    assert inputs == [{"path": "prompts/held/a.parquet", "num_rows": 10,
                       "size": fs.info("prompts/held/a.parquet")["size"],
                       "version": f"ETag={etag}"}]
    fs.rm("results/held/part-00001.parquet")
    with fs.open("prompts/held/a.parquet", "wb") as f:  # same rows, other prompts
        pq.write_table(pa.table({"id": list(range(10)), "prompt": [f"S3 {i}" for i in range(10)]}),
                       f, row_group_size=3)
    fs.invalidate_cache()
    with pytest.raises(JobError, match=r"holds a different job \(changed: input "
                                       r"prompts/held/a.parquet was rewritten \(.*version "
                                       rf"'ETag={etag}' -> 'ETag="):
        run_job(spec)
