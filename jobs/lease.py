"""One run at a time per output directory: a lease object, `_lease.json`, in the output.

A run takes the lease before it reads the old manifest or touches anything, renews it
every `HEARTBEAT_SECONDS` from a background thread, and removes it when it ends. The
lease names its holder (an owner id per run, host, pid and the process's start time),
so a second run is refused with a message naming the holder. It works on any fsspec
store: created with exclusive create (`xb`: O_EXCL on local disks, a conditional PUT on
S3) and read back, so a store without exclusive create still never leaves two runs
each believing it holds the lease for longer than one heartbeat.

A lease whose holder is gone is taken over: on the holder's own machine (same host and
pid namespace) as soon as its process is gone; elsewhere after `STALE_SECONDS` without
a heartbeat. Within one process a lease held by another live thread is live; one held
by the calling thread was left by an earlier run of that thread (a thread runs one job
at a time) and is taken over.

Every commit checks the lease first (`check_holder`): a run that lost its lease stops
before it writes into an output another run now holds.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from fusegen.jobs.errors import JobError
from fusegen.jobs.storage import move

LEASE = "_lease.json"
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0  # a lease not renewed for this long belongs to a run that died

log = logging.getLogger("fusegen.jobs")
# owner -> (the Lease, the thread that took it), for the leases this process holds
_held: dict[str, tuple[weakref.ref, int]] = {}


@dataclass(frozen=True, slots=True)
class Holder:
    """The lease's content: who holds the output."""
    owner: str  # one id per run
    host: str
    pid_ns: str  # the pid namespace: pids compare only within one
    pid: int
    pid_started: float  # the process's start time: a reused pid is another process
    acquired: float  # epoch seconds
    heartbeat: float  # epoch seconds of the last renewal

    def describe(self, now: float) -> str:
        since = datetime.fromtimestamp(self.acquired, timezone.utc).isoformat(timespec="seconds")
        return (f"pid {self.pid} on {self.host}, holding it since {since}, last heartbeat "
                f"{max(0.0, now - self.heartbeat):.0f} s ago")


def is_dead(holder: Holder, now: float, here: Holder, alive) -> bool:
    """Whether the holder's run is gone (policy; `here` is this process as a Holder,
    `alive(holder)` tells whether a process on this machine still runs it)."""
    if (holder.host, holder.pid_ns) != (here.host, here.pid_ns):
        return now - holder.heartbeat > STALE_SECONDS
    return not alive(holder)


class Lease:
    """The lease of one output directory for one run (driver side)."""

    def __init__(self, fs, output_path: str, url: str):
        self.fs, self.url = fs, url
        self.path = f"{output_path}/{LEASE}"
        self.owner = uuid.uuid4().hex
        self._finalizer = None

    def acquire(self) -> None:
        """Take the lease or raise JobError naming its holder."""
        for _ in range(5):
            if self._create():
                return self._hold()
            holder = read_holder(self.fs, self.path)
            if holder is None:  # released meanwhile, or junk: take it
                self._remove(None)
                continue
            now = time.time()
            if not is_dead(holder, now, _this_process(self.owner, now), _alive):
                raise JobError(
                    f"output {self.url} is in use by another fusegen run "
                    f"({holder.describe(now)}); wait for it to finish or stop it, or choose "
                    "another output. The output of a run that died is taken over as soon "
                    f"as its process is gone (same machine) or after {STALE_SECONDS:.0f} s "
                    "without a heartbeat")
            log.warning("output %s: taking over the lease of a run that is gone (%s)",
                        self.url, holder.describe(now))
            self._remove(holder)
        raise JobError(f"output {self.url}: other runs keep taking its lease; retry later")

    def release(self) -> None:
        """Stop renewing and remove the lease (when still ours). Idempotent."""
        if self._finalizer is not None:
            self._finalizer()

    def _create(self) -> bool:
        """Exclusive create of our record, read back: False when another holds it."""
        record = _record(_this_process(self.owner, time.time()))
        try:
            with self.fs.open(self.path, "xb") as f:
                f.write(record)
        except FileExistsError:
            return False
        except (NotImplementedError, ValueError):  # no exclusive create on this store
            if read_holder(self.fs, self.path) is not None:
                return False
            self.fs.pipe_file(self.path, record)
        holder = read_holder(self.fs, self.path)
        return holder is not None and holder.owner == self.owner

    def _hold(self) -> None:
        stop = threading.Event()
        _held[self.owner] = (weakref.ref(self), threading.get_ident())
        self._finalizer = weakref.finalize(self, _release, self.fs, self.path, self.owner,
                                           stop)
        # The thread holds a weak reference only: a Lease nobody uses any more is
        # collected, which stops its heartbeat and removes its record.
        threading.Thread(target=_beat, args=(weakref.ref(self), stop), daemon=True,
                         name=f"fusegen-lease-{self.owner[:8]}").start()

    def _renew(self) -> bool:
        """Rewrite our record with a new heartbeat; False when the lease is no longer ours."""
        holder = read_holder(self.fs, self.path)
        if holder is None or holder.owner != self.owner:
            log.error("output %s: this run lost its lease to another run (%s); it stops "
                      "before committing anything more", self.url,
                      holder.describe(time.time()) if holder else "none")
            return False
        now = time.time()
        _write(self.fs, self.path, _record(Holder(**{**asdict(holder), "heartbeat": now})))
        return True

    def _remove(self, seen: Holder | None) -> None:
        """Remove a dead holder's lease, unless it changed since it was judged dead."""
        entry = _held.get(seen.owner) if seen is not None else None
        left = entry[0]() if entry is not None else None
        if left is not None:  # this process's, left by a run that is over: stop it
            left.release()
            return
        if read_holder(self.fs, self.path) == seen:
            try:
                self.fs.rm_file(self.path)
            except FileNotFoundError:
                pass


def check_holder(fs, output_path: str, owner: str, url: str) -> None:
    """Raise JobError unless `owner` holds the output's lease (before each commit)."""
    holder = read_holder(fs, f"{output_path}/{LEASE}")
    if holder is None or holder.owner != owner:
        who = holder.describe(time.time()) if holder else "nobody holds it now"
        raise JobError(f"output {url}: this run no longer holds the output ({who}); it "
                       "stopped without committing more parts. Rerun it once the other "
                       "run is done")


def read_holder(fs, path: str) -> Holder | None:
    """The lease's holder; None without a lease or for one that cannot be read."""
    try:
        return Holder(**json.loads(fs.cat_file(path)))
    except FileNotFoundError:
        return None
    except (TypeError, ValueError):  # a torn or foreign file: nobody's lease
        return None


def _record(holder: Holder) -> bytes:
    return json.dumps(asdict(holder), sort_keys=True).encode()


def _write(fs, path: str, data: bytes) -> None:
    """Replace the file whole: readers see the old record or the new one."""
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)  # one PUT: atomic on object stores
        return
    tmp = f"{path}.{uuid.uuid4().hex}"
    fs.pipe_file(tmp, data)
    move(fs, tmp, path)


def _beat(ref, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_SECONDS):
        lease = ref()
        if lease is None:
            return
        try:
            if not lease._renew():
                return
        except Exception as exc:  # noqa: BLE001 - a missed beat is retried at the next
            log.warning("output %s: could not renew the lease: %s", lease.url, exc)
        del lease


def _release(fs, path: str, owner: str, stop: threading.Event) -> None:
    stop.set()
    _held.pop(owner, None)
    try:
        holder = read_holder(fs, path)
        if holder is not None and holder.owner == owner:
            fs.rm_file(path)
    except Exception as exc:  # noqa: BLE001 - it goes stale and is taken over
        log.warning("could not remove the lease %s: %s", path, exc)


def _this_process(owner: str, now: float) -> Holder:
    return Holder(owner=owner, host=socket.gethostname(), pid_ns=_pid_namespace(),
                  pid=os.getpid(), pid_started=_started(os.getpid()), acquired=now,
                  heartbeat=now)


def _alive(holder: Holder) -> bool:
    """Whether the holder's run goes on, for a holder on this machine."""
    if (holder.pid, holder.pid_started) != (os.getpid(), _started(os.getpid())):
        return _process_alive(holder.pid, holder.pid_started)
    entry = _held.get(holder.owner)
    if entry is None or entry[0]() is None:  # released, or its run is over
        return False
    ident = entry[1]
    return ident != threading.get_ident() and any(t.ident == ident for t in threading.enumerate())


def _process_alive(pid: int, started: float) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # cannot tell: assume it runs
        return True


@functools.cache
def _started(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc: one namespace per host
        return ""
