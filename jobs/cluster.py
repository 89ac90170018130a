"""Where the job's tasks run: an embedded local Dask cluster, or an existing one."""
from __future__ import annotations

import logging
from contextlib import contextmanager

import dask

from fusegen.jobs.engines import close_engines
from fusegen.jobs.errors import JobError
from fusegen.jobs.redact import redact_url
from fusegen.jobs.spec import JobSpec

_LOOPBACK = "127.0.0.1"


@contextmanager
def open_client(spec: JobSpec):
    """A dask.distributed Client: to `spec.scheduler`, or to an embedded cluster."""
    from distributed import Client

    if spec.scheduler:
        try:
            client = Client(spec.scheduler, timeout="30s")
        except (OSError, TimeoutError) as exc:
            raise JobError(f"cannot reach the Dask scheduler at {redact_url(spec.scheduler)} "
                           f"({exc}); start one with `dask scheduler` or drop --scheduler") from None
        with client:
            yield client
        return
    cluster = _local_cluster(spec)
    try:
        with Client(cluster) as client:
            yield client
    finally:
        close_engines()  # in-process engines: unblocks any task thread still waiting
        cluster.close()


def _local_cluster(spec: JobSpec):
    """One in-process worker (inproc transport) whose `partitions_per_worker` threads all
    feed one engine; with workers > 1, that many worker processes. Every socket, the
    HTTP ones included, listens on 127.0.0.1 only."""
    from distributed import LocalCluster

    processes = spec.workers > 1
    # Dask's statistical profiler samples every thread's stack each 10 ms: GIL time taken
    # from the engine's step loop, for a profile nobody reads in a batch job.
    with dask.config.set({"distributed.worker.profile.enabled": False}):
        return LocalCluster(
            n_workers=spec.workers, threads_per_worker=spec.partitions_per_worker,
            processes=processes, host=_LOOPBACK if processes else None,
            # Schedulers and workers always serve HTTP (health, metrics); without an
            # explicit address they bind every interface.
            dashboard_address=f"{_LOOPBACK}:0", worker_dashboard_address=f"{_LOOPBACK}:0",
            # In-process, a failed task is reported once, by the JobError; worker
            # processes keep their warnings (memory pressure, restarts).
            silence_logs=logging.WARNING if processes else logging.CRITICAL)
