"""Stopping a job cleanly on Ctrl-C (SIGINT) or SIGTERM.

`fusegen run` turns either signal into `Interrupted` in its main thread (`stop_on_signals`);
the runner then stops its partitions, writes the manifest with status "interrupted",
releases the output and raises `JobInterrupted` with what is committed. Both are
KeyboardInterrupts, so Python callers that stop on Ctrl-C keep doing so.
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager


class Interrupted(KeyboardInterrupt):
    """A signal asked the run to stop (SIGINT or SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class JobInterrupted(KeyboardInterrupt):
    """A job stopped early: `num_committed` of `num_parts` parts are in the output (None
    when it stopped before touching the output); rerunning the job resumes it."""

    def __init__(self, signum: int, output: str, num_committed: int | None = None,
                 num_parts: int | None = None):
        self.signum, self.output = signum, output
        self.num_committed, self.num_parts = num_committed, num_parts
        super().__init__(self.message)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM

    @property
    def message(self) -> str:
        name = signal.Signals(self.signum).name
        if self.num_parts is None:
            return f"interrupted by {name} before any part was committed to {self.output}"
        return (f"interrupted by {name}: {self.num_committed} of {self.num_parts} parts "
                f"committed to {self.output} (its manifest says \"interrupted\")")


def signal_of(exc: KeyboardInterrupt) -> int:
    return getattr(exc, "signum", signal.SIGINT)


@contextmanager
def stop_on_signals():
    """SIGINT and SIGTERM raise `Interrupted` in the main thread, once: a second signal
    while the run stops is noted and ignored, so the manifest is written whole."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = []

    def handler(signum, frame):
        if stopping:
            sys.stderr.write("still stopping: writing the manifest and releasing the "
                             "output\n")
            return
        stopping.append(signum)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
