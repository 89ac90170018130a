"""pytest plugin for a timed GPU call: each failure's report written to $OUT/failures.log
the moment it arrives (pytest prints them only at the end of the session, which a
call's time limit may cut off). usage: pytest -p instafail, with tests/gpu on sys.path."""
import os

_LOG = os.path.join(os.environ.get("OUT", "."), "failures.log")


def pytest_runtest_logreport(report):
    if report.failed:
        with open(_LOG, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n")
