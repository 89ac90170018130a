"""Paths the cluster's workers can reach, settled on the driver before anything is written.

A relative local path is made absolute here: each worker would otherwise resolve it against
its own working directory. An external cluster (`--scheduler` at another machine) cannot
see this machine's local disk, so a local path there must lie on a network filesystem
(NFS, Lustre...) that the workers mount too; memory:// files no other process sees at all.
"""
from __future__ import annotations

import os
import socket

from fusegen.jobs.errors import JobError
from fusegen.jobs.redact import redact_url
from fusegen.jobs.storage import filesystem, is_local, is_process_local

# Filesystem types (/proc/mounts) that other machines mount too.
SHARED_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
    "9p", "afs", "orangefs", "pvfs2", "wekafs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs",
    "fuse.gcsfuse", "fuse.juicefs", "fuse.ceph", "fuse.rclone", "fuse.mountpoint-s3",
    "fuse.goofys", "fuse.alluxio-fuse"})
_MOUNTS = "/proc/mounts"


def absolute_url(url: str, storage_options: dict) -> str:
    """A local path as the absolute path it names here; any other URL as given."""
    if "::" in url:  # a chained URL (simplecache::s3://...): its own protocols resolve it
        return url
    fs, path = filesystem(url, storage_options)
    return path if is_local(fs) and not os.path.isabs(url) else url


def check_shared_storage(input_url: str, output_url: str, storage_options: dict,
                         scheduler: str | None, workers: int) -> None:
    """Refuse, naming the path, an input or output that the job's workers cannot reach:
    memory:// files outside one in-process worker, and a local path on this machine's own
    disk when the scheduler is on another machine."""
    if workers == 1 and not scheduler:
        return
    flag = f"--scheduler {redact_url(scheduler)}" if scheduler else f"--workers {workers}"
    remote = scheduler is not None and scheduler_is_remote(scheduler)
    for what, url in (("input", input_url), ("output", output_url)):
        fs, path = filesystem(url, storage_options)
        if is_process_local(fs):
            raise JobError(f"{what} {redact_url(url)} is in this process's memory, which the "
                           f"worker processes of {flag} cannot reach; use a shared filesystem "
                           "or object store, or one in-process worker (--workers 1, no "
                           "--scheduler)")
        if remote and is_local(fs) and is_shared_path(path) is False:
            raise JobError(f"{what} {path} is on this machine's local disk, which the workers "
                           f"of {flag} (another machine) cannot reach; put it on a shared "
                           "filesystem that every worker mounts at the same path (NFS, "
                           "Lustre...) or in an object store (s3://, gs://...)")


def scheduler_is_remote(address: str) -> bool:
    """Whether a scheduler address names another machine (not a loopback address nor one
    of this machine's own); a name that does not resolve counts as remote."""
    from distributed.comm import get_address_host

    if address.startswith("inproc://"):
        return False
    host = get_address_host(address if "://" in address else f"tcp://{address}")
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return True
    return not all(ip.startswith("127.") or ip in ("::1", "0.0.0.0", "::") or
                   ip in _own_addresses() for ip in ips)


def _own_addresses() -> set[str]:
    import psutil

    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
            for a in addrs}


def is_shared_path(path: str, mounts: str | None = None) -> bool | None:
    """Whether a local path lies on a network filesystem (`SHARED_FS_TYPES`): the type of
    the mount that holds it (or its nearest existing parent) in `mounts` (/proc/mounts'
    text). None where the mount table cannot be read (not Linux)."""
    if mounts is None:
        try:
            with open(_MOUNTS) as f:
                mounts = f.read()
        except OSError:
            return None
    path = os.path.realpath(path)
    best, fstype = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype in SHARED_FS_TYPES
