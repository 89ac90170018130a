"""The embedded Dask cluster listens on 127.0.0.1 only (HTTP servers included); each
worker's engine gets its own GPU (the assignment, tested without GPUs)."""
from types import SimpleNamespace

import psutil
import pytest

from fusegen.jobs import engines
from fusegen.jobs.cluster import engine_devices, open_client, worker_devices
from fusegen.jobs.spec import JobSpec


def _listening() -> set[tuple[str, int]]:
    """(ip, port) of every listening socket of this process and its children."""
    me = psutil.Process()
    return {(c.laddr.ip, c.laddr.port) for p in [me] + me.children(recursive=True)
            for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("workers", [1, 2])
def test_embedded_cluster_binds_loopback_only(workers):
    before = _listening()
    spec = JobSpec(model="/m", input="i", output="o", workers=workers, partitions_per_worker=1)
    with open_client(spec) as client:
        assert len(client.scheduler_info()["workers"]) == workers
        new = _listening() - before
    assert new, "expected listening sockets (the HTTP servers at least)"
    assert {ip for ip, _ in new} == {"127.0.0.1"}, new


WORKERS = ["tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002", "tcp://127.0.0.1:4003"]


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_one_gpu_per_worker_when_there_are_enough(device):
    assert worker_devices(WORKERS, 4, device, external=False) == {
        WORKERS[0]: "cuda:0", WORKERS[1]: "cuda:1", WORKERS[2]: "cuda:2"}
    assert worker_devices(WORKERS[:1], 1, device, external=False) == {WORKERS[0]: "cuda:0"}


def test_more_workers_than_gpus_share_them_round_robin():
    assert list(worker_devices(WORKERS, 2, "auto", external=False).values()) == \
        ["cuda:0", "cuda:1", "cuda:0"]


@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_an_explicit_device_is_kept(device):
    assert worker_devices(WORKERS, 4, device, external=False) == dict.fromkeys(WORKERS, device)


@pytest.mark.parametrize("num_gpus", [0, 4])
def test_an_external_cluster_keeps_the_option(num_gpus):
    # its workers usually see one GPU each (CUDA_VISIBLE_DEVICES): "auto" is theirs
    assert worker_devices(WORKERS, num_gpus, "auto", external=True) == \
        dict.fromkeys(WORKERS, "auto")


def test_no_gpu_keeps_the_option():
    assert worker_devices(WORKERS, 0, "auto", external=False) == dict.fromkeys(WORKERS, "auto")


def test_the_scheduler_option_means_external(monkeypatch):
    from fusegen.jobs import cluster

    monkeypatch.setattr(cluster, "_num_visible_gpus", lambda: 8)
    local = JobSpec(model="/m", input="i", output="o")
    external = JobSpec(model="/m", input="i", output="o", scheduler="tcp://10.0.0.1:8786")
    assert engine_devices(local, WORKERS[:2]) == {WORKERS[0]: "cuda:0", WORKERS[1]: "cuda:1"}
    assert engine_devices(external, WORKERS[:2]) == dict.fromkeys(WORKERS[:2], "auto")


def test_a_worker_finds_its_engine_on_its_assigned_device(monkeypatch):
    loads = []
    monkeypatch.setattr(engines, "_load",
                        lambda model, kw: loads.append(kw) or SimpleNamespace(close=lambda: None))
    kwargs = {"device": "auto", "dtype": "auto"}
    try:
        engines.set_worker_device("auto", "cuda:1")
        llm = engines.get_engine("/m", kwargs)
        assert loads == [{"device": "cuda:1", "dtype": "auto"}]
        assert engines.get_engine("/m", kwargs) is llm and len(loads) == 1
        assert engines.loaded_engine("/m", kwargs) is llm
        # another device option is not this assignment's
        assert engines.loaded_engine("/m", {**kwargs, "device": "cpu"}) is None
    finally:
        engines.close_engines()
    assert engines.loaded_engine("/m", kwargs) is None  # the assignment went with it
