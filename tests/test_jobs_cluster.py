"""The embedded Dask cluster listens on 127.0.0.1 only (HTTP servers included)."""
import psutil
import pytest

from fusegen.jobs.cluster import open_client
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
