"""Starting, watching and stopping a device group's worker processes.

Workers are plain subprocesses (`python -m fusegen.engine.parallel RANK`), not
multiprocessing children: a Dask worker process is daemonic and may not have those. Each
connects back to the controller over a Unix socket with a random key; the ranks meet
each other through torch.distributed's TCP rendezvous on 127.0.0.1.

Every wait on a rank is bounded: the controller polls the rank's connection briefly and,
between polls, checks that every process is alive, so a rank that crashes (or is
killed) fails the step at once with `DeviceGroupError`, and one that hangs fails it after
`collective_timeout` seconds. Closing stops every process: a polite stop, then terminate,
then kill.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Listener
from multiprocessing.shared_memory import SharedMemory

from fusegen.engine.errors import DeviceGroupError, EngineConfigError
from fusegen.engine.parallel.plan import RankInfo
from fusegen.engine.parallel.worker import ADDRESS_ENV, AUTHKEY_ENV

POLL_SECONDS = 0.05


class DeviceGroup:
    def __init__(self, config, infos: list[RankInfo], logits_bytes: int, num_slots: int):
        self.infos = infos
        self.timeout = config.options.collective_timeout
        self.processes: list[subprocess.Popen] = []
        self.conns: dict[int, object] = {}
        self._dir = tempfile.mkdtemp(prefix="fusegen-group-")
        self.logits = SharedMemory(create=True, size=max(logits_bytes, 1)) \
            if logits_bytes else None
        self.failed: str | None = None
        try:
            self._start(config, num_slots)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _start(self, config, num_slots: int) -> None:
        authkey = os.urandom(16)
        address = os.path.join(self._dir, "controller")
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = {**os.environ, ADDRESS_ENV: address, AUTHKEY_ENV: authkey.hex()}
        try:
            for info in self.infos:
                self.processes.append(subprocess.Popen(
                    [sys.executable, "-m", "fusegen.engine.parallel", str(info.rank)],
                    env=env))
            self._accept(listener)
        finally:
            listener.close()
        port = _free_port()
        name = self.logits.name if self.logits else ""
        for info in self.infos:
            self.conns[info.rank].send(("init", config, info, port, name, num_slots,
                                        self.timeout))
        self.reports = {}
        for info in self.infos:  # loading the weights: as long as the timeout allows
            _, rank, report = self.receive(info.rank, "ready", "start")
            self.reports[rank] = report

    def _accept(self, listener: Listener) -> None:
        accepted: list = []

        def accept():
            for _ in self.infos:
                try:
                    accepted.append(listener.accept())
                except OSError:
                    return
        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout
        while thread.is_alive():
            thread.join(POLL_SECONDS)
            self._check_processes("start")
            if time.monotonic() > deadline:
                raise self._fail(f"the ranks did not connect within {self.timeout} s "
                                 "(collective_timeout)")
        for conn in accepted:
            _, rank, _pid = conn.recv()
            self.conns[rank] = conn

    def send_all(self, message) -> None:
        if self.failed:
            raise DeviceGroupError(self.failed)
        for rank, conn in self.conns.items():
            try:
                conn.send(message)
            except OSError as exc:
                self._check_processes(f"step {message[1]}")
                raise self._fail(f"rank {rank} cannot be reached ({exc})") from None

    def ask(self, kind: str) -> dict[int, object]:
        """Every rank's answer to the query `kind` (between steps: none in flight)."""
        self.send_all((kind, -1))
        return {info.rank: self.receive(info.rank, kind, kind)[2] for info in self.infos}

    def receive(self, rank: int, kind: str | tuple[str, ...], what: str):
        """The next message from `rank`, which must be of `kind` (one or several);
        DeviceGroupError when any rank died or reported an error, or after the timeout."""
        kinds = (kind,) if isinstance(kind, str) else kind
        if self.failed:
            raise DeviceGroupError(self.failed)
        conn, deadline = self.conns[rank], time.monotonic() + self.timeout
        while True:
            if conn.poll(POLL_SECONDS):
                try:
                    message = conn.recv()
                except EOFError:
                    self._check_processes(what)
                    raise self._fail(f"rank {rank} closed its connection during {what}") \
                        from None
                if message[0] == "error":  # a rank that died is the cause, if any did
                    time.sleep(POLL_SECONDS)
                    self._check_processes(what, echo=f"rank {message[1]}: {message[2]}",
                                          reporter=message[1])
                    raise self._fail(f"rank {message[1]} failed during {what}:\n{message[2]}")
                if message[0] not in kinds:
                    raise self._fail(f"rank {rank} answered {message[0]!r} where "
                                     f"{' or '.join(kinds)} was due during {what}")
                return message
            self._check_processes(what)
            if time.monotonic() > deadline:
                raise self._fail(f"rank {rank} did not answer {what} within "
                                 f"{self.timeout} s (collective_timeout)")

    def _check_processes(self, what: str, echo: str | None = None,
                         reporter: int | None = None) -> None:
        """DeviceGroupError naming the first rank whose process ended (other than the
        `reporter` of `echo`, an error already received, which follows its cause)."""
        for info, process in zip(self.infos, self.processes):
            code = process.poll()
            if code is not None and info.rank != reporter:
                error = echo or self._reported_error()
                detail = f":\n{error}" if error else ""
                raise self._fail(f"rank {info.rank} (pid {process.pid}) exited with code "
                                 f"{code} during {what}{detail}")

    def _reported_error(self) -> str | None:
        """A traceback some rank sent before it ended (the cause, not the echo)."""
        for conn in self.conns.values():
            try:
                while conn.poll(0):
                    message = conn.recv()
                    if message[0] == "error":
                        return f"rank {message[1]}: {message[2]}"
            except (EOFError, OSError):
                continue
        return None

    def _fail(self, detail: str) -> DeviceGroupError:
        self.failed = f"device_group_failed: {detail}"
        return DeviceGroupError(self.failed)

    def close(self) -> None:
        """Stop every rank: a polite stop, then terminate, then kill; never leaves one."""
        for conn in self.conns.values():
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for conn in self.conns.values():
            conn.close()
        self.conns = {}
        if self.logits is not None:
            self.logits.close()
            self.logits.unlink()
            self.logits = None
        shutil.rmtree(self._dir, ignore_errors=True)


def check_shared_memory(nbytes: int, what: str, free: int | None = None) -> None:
    """Refuse a buffer /dev/shm cannot hold before any rank starts: past its size a
    write kills the writer with SIGBUS (containers often give /dev/shm 64 MiB)."""
    if free is None:
        if not os.path.isdir("/dev/shm"):
            return
        stat = os.statvfs("/dev/shm")
        free = stat.f_bavail * stat.f_frsize
    if nbytes > free:
        raise EngineConfigError(
            f"a device group passes sampled logits through {nbytes / 2**20:.0f} MiB of shared "
            f"memory ({what}); /dev/shm has {free / 2**20:.0f} MiB free: give it more (a "
            "container's --shm-size) or lower max_num_seqs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
