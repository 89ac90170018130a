"""Where the job's tasks run: an embedded local Dask cluster, or an existing one; and
which device each worker's engine uses."""
from __future__ import annotations

import importlib.util
import logging
from contextlib import contextmanager

import dask

from fusegen.jobs.engines import close_engines
from fusegen.jobs.errors import JobError
from fusegen.jobs.redact import redact_url
from fusegen.jobs.spec import JobSpec

_LOOPBACK = "127.0.0.1"
_ANY_GPU = ("auto", "cuda")  # device options that leave the GPU to fusegen
log = logging.getLogger("fusegen.jobs")
# Where the embedded cluster's dashboard gets its pages: Dask draws them with bokeh.
DASHBOARD_EXTRA = "pip install 'fusegen[dashboard]'"


@contextmanager
def open_client(spec: JobSpec):
    """A dask.distributed Client: to `spec.scheduler`, or to an embedded cluster. Its
    workers' logs carry fusegen's log lines (jobs/worker_logs.py) while it is open."""
    from distributed import Client

    from fusegen.jobs.worker_logs import WorkerLogs, unregister

    if spec.scheduler:
        try:
            client = Client(spec.scheduler, timeout="30s")
        except (OSError, TimeoutError) as exc:
            raise JobError(f"cannot reach the Dask scheduler at {redact_url(spec.scheduler)} "
                           f"({exc}); start one with `dask scheduler` or drop --scheduler") from None
        with client:
            _show_dashboard(client, local=False)
            client.register_plugin(WorkerLogs(spec.redactor()))
            try:
                yield client
            finally:
                unregister(client)  # a shared cluster is left as it was found
        return
    cluster = _local_cluster(spec)
    try:
        with Client(cluster) as client:
            _show_dashboard(client, local=True)
            client.register_plugin(WorkerLogs(spec.redactor()))
            yield client
    finally:
        close_engines()  # in-process engines: unblocks any task thread still waiting
        cluster.close()


def dashboard_link(client, local: bool) -> str | None:
    """The Dask dashboard's address when the scheduler serves one, else None. The embedded
    (`local`) cluster's listens on 127.0.0.1 at a free port, and shows pages only where
    bokeh is installed (`fusegen[dashboard]`); an external scheduler's is at its own
    host."""
    try:
        port = client.scheduler_info().get("services", {}).get("dashboard")
    except Exception:  # noqa: BLE001 - no dashboard to show is no reason to fail the job
        return None
    if port is None:
        return None
    if not local:
        return client.dashboard_link
    return f"http://{_LOOPBACK}:{port}/status" if importlib.util.find_spec("bokeh") else None


def _show_dashboard(client, local: bool) -> None:
    link = dashboard_link(client, local)
    if link:
        log.info("Dask dashboard: %s", redact_url(link))
    elif local:
        log.info("Dask dashboard: off, its pages need bokeh: %s", DASHBOARD_EXTRA)


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


def worker_devices(workers: list[str], num_gpus: int, device: str,
                   external: bool, group_size: int = 1) -> dict[str, str]:
    """Worker address -> the device its engine uses (`workers` sorted, `num_gpus` visible
    on this machine, `device` the job's option).

    With `auto` or `cuda` and GPUs visible, worker i gets `cuda:{i % num_gpus}`: its own
    GPU while there are at least as many GPUs as workers; beyond that workers share GPUs
    round-robin, each with its own engine. An explicit `cuda:K` or `cpu` is kept, and so
    is any option on an external cluster (`--scheduler`), whose workers usually see one
    GPU each through CUDA_VISIBLE_DEVICES. No GPU: the option as given.

    A device group of `group_size` ranks (tensor x pipeline parallel) per engine: worker
    i gets GPUs [i * group_size, (i + 1) * group_size) as "cuda:a,b,...", never shared;
    too few GPUs is an error before anything loads. On an external cluster each worker
    forms its group from the GPUs its own machine shows it ("cuda")."""
    if external or num_gpus < 1 or device not in _ANY_GPU:
        return {w: device for w in workers}
    if group_size == 1:
        return {w: f"cuda:{i % num_gpus}" for i, w in enumerate(workers)}
    needed = len(workers) * group_size
    if needed > num_gpus:
        raise JobError(f"{len(workers)} worker(s) x a device group of {group_size} ranks "
                       f"(tensor_parallel_size x pipeline_parallel_size) need {needed} GPUs; "
                       f"this machine has {num_gpus}: lower --workers or the group's size")
    return {w: "cuda:" + ",".join(str(i * group_size + r) for r in range(group_size))
            for i, w in enumerate(workers)}


def engine_devices(spec: JobSpec, workers: list[str]) -> dict[str, str]:
    """`worker_devices` for this job. The embedded cluster's workers are processes of this
    machine, so the GPUs are counted here; an external cluster's are not."""
    if spec.scheduler:
        return worker_devices(workers, 0, spec.engine.device, external=True)
    on_gpus = spec.engine.device in _ANY_GPU
    num_gpus = _num_visible_gpus() if on_gpus else 0  # `cpu` never touches CUDA
    group = spec.engine.tensor_parallel_size * spec.engine.pipeline_parallel_size
    if group > 1:
        return worker_devices(workers, num_gpus, spec.engine.device, external=False,
                              group_size=group)
    if on_gpus and 0 < num_gpus < len(workers):
        log.warning("%d workers share %d GPUs (round-robin, one engine each); use --workers "
                    "%d for one GPU per worker", len(workers), num_gpus, num_gpus)
    return worker_devices(workers, num_gpus, spec.engine.device, external=False)


def _num_visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()
