"""fusegen's log lines reach the Dask workers' logs (what client.get_worker_logs() and
the dashboard show), with the job's secrets masked; the dashboard's missing dependency
is named by the extra that installs it."""
import importlib.util
import logging
from types import SimpleNamespace

import pytest
from distributed import Client, LocalCluster

from fusegen.jobs import cluster
from fusegen.jobs.cluster import open_client
from fusegen.jobs.spec import JobSpec

SECRET = "wJalrXUtnFEMI-K7MDENG"  # a storage option the job must not show


def _spec(**kw) -> JobSpec:
    return JobSpec(model="/m", input="i", output="o", partitions_per_worker=1,
                   storage_options={"secret": SECRET}, **kw)


def _log_on_worker(message: str) -> None:
    logging.getLogger("fusegen.engine").info(message)
    logging.getLogger("fusegen.kernels").warning("careful with %s", SECRET)


def _fusegen_lines(client) -> dict[str, list[tuple[str, str]]]:
    return {worker: [(level, text) for level, text in lines if " - fusegen." in text]
            for worker, lines in client.get_worker_logs().items()}


def test_worker_processes_log_fusegen_lines():
    # --workers 2: worker processes, whose "fusegen" logger nobody configures.
    with open_client(_spec(workers=2)) as client:
        workers = sorted(client.scheduler_info()["workers"])
        for i, worker in enumerate(workers):
            client.submit(_log_on_worker, f"hello from worker {i}", workers=[worker],
                          pure=False).result()
        lines = _fusegen_lines(client)
    assert sorted(lines) == workers
    for i, worker in enumerate(workers):
        # newest first, in Dask's worker log format
        assert [(level, text.split(" - ", 1)[1]) for level, text in lines[worker]] == [
            ("WARNING", "fusegen.kernels - WARNING - careful with ***"),
            ("INFO", f"fusegen.engine - INFO - hello from worker {i}")]


def test_the_in_process_worker_logs_them_as_the_driver_set_its_level():
    logger = logging.getLogger("fusegen")
    level = logger.level
    logger.setLevel(logging.INFO)  # as `fusegen run` sets it
    try:
        with open_client(_spec(workers=1)) as client:
            client.submit(_log_on_worker, "in-process", pure=False).result()
            (lines,) = _fusegen_lines(client).values()
        assert [text.split(" - ", 1)[1] for _, text in lines] == [
            "fusegen.kernels - WARNING - careful with ***",
            "fusegen.engine - INFO - in-process"]
    finally:
        logger.setLevel(level)
    assert not [h for h in logger.handlers if type(h).__name__ == "_ToWorkerLog"]


@pytest.fixture
def driver_at_warning():
    """The driver's logging as a plain script leaves it, whatever tests before set:
    "fusegen" at WARNING, its children unset."""
    loggers = [logging.getLogger(n) for n in ("fusegen", "fusegen.engine", "fusegen.kernels")]
    levels = [lg.level for lg in loggers]
    for lg, level in zip(loggers, (logging.WARNING, logging.NOTSET, logging.NOTSET)):
        lg.setLevel(level)
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


def test_an_external_cluster_is_left_as_found(driver_at_warning):
    logger = logging.getLogger("fusegen")
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as local, \
            Client(local) as mine:
        with open_client(_spec(scheduler=local.scheduler_address)) as client:
            client.submit(_log_on_worker, "external", pure=False).result()
            assert [h for h in logger.handlers if type(h).__name__ == "_ToWorkerLog"]
        (lines,) = _fusegen_lines(mine).values()
        assert [text.split(" - ", 1)[1] for _, text in lines] == [
            "fusegen.kernels - WARNING - careful with ***"]  # the driver's level: WARNING
        assert not [h for h in logger.handlers if type(h).__name__ == "_ToWorkerLog"]
        assert "fusegen-logs" not in mine.run_on_scheduler(
            lambda dask_scheduler: list(dask_scheduler.worker_plugins))


def test_a_dashboard_without_bokeh_names_the_extra(monkeypatch, caplog):
    client = SimpleNamespace(scheduler_info=lambda: {"services": {"dashboard": 4321}})
    found = {"bokeh": None}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found[name])
    with caplog.at_level(logging.INFO, logger="fusegen.jobs"):
        cluster._show_dashboard(client, local=True)
        found["bokeh"] = object()
        cluster._show_dashboard(client, local=True)
    assert [r.getMessage() for r in caplog.records] == [
        "Dask dashboard: off, its pages need bokeh: pip install 'fusegen[dashboard]'",
        "Dask dashboard: http://127.0.0.1:4321/status"]


def test_the_dashboard_extra_installs_bokeh():
    import ast
    from pathlib import Path

    setup = ast.parse((Path(cluster.__file__).parents[1] / "setup.py").read_text())
    extras = next(kw.value for node in ast.walk(setup) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    extras = ast.literal_eval(extras)
    assert extras["dashboard"] == ["bokeh>=3.1"]
    from distributed.versions import BOKEH_REQUIREMENT
    assert str(BOKEH_REQUIREMENT) == "bokeh>=3.1.0"  # Dask's own floor for its dashboard


@pytest.fixture(autouse=True)
def _no_stray_handlers():
    yield
    logger = logging.getLogger("fusegen")
    assert not [h for h in logger.handlers if type(h).__name__ == "_ToWorkerLog"]
