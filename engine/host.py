"""The host process fusegen runs in: allocator settings for CPU inference.

A CPU step allocates its activations afresh: a 2048-token step of a small model asks
for tens of [2048, 3072] fp32 buffers (25 MB each). glibc serves requests that large
with mmap and returns them to the kernel on free, so every step page-faults each of
them in again and the kernel zeroes every page first (tens of thousands of faults, a
sizeable share of a prefill step). Raising glibc's mmap threshold to its
maximum (32 MiB) and its trim threshold keeps freed buffers in the heap, to be reused by
the next step (the same reason vLLM's CPU engine preloads tcmalloc). The cost is that
the heap keeps the step's peak activation memory, which the memory plan reserves anyway.

Threads share glibc's main arena (M_ARENA_MAX 1, set as `import fusegen` starts, before
torch or numpy start threads: a thread that already holds an arena keeps it, and later
threads would be handed the arenas there are in turn). A thread of its own, the
engine's, would get an arena of 64 MiB heaps, which a 2,048-token step's activations
outgrow, and its buffers would land on fresh pages step after step
(docs/performance.md has the fault counts). fusegen's threads seldom allocate at the
same moment, so they do not queue on the arena's lock.

The KV cache stays on 4 KiB pages. It is read in blocks scattered over gigabytes, and
on huge pages (`madvise`, `zeros_lazy(huge=True)`) decode attention reads a few percent
faster, but the pool is touched for the first time while the engine runs (each prefill
writes fresh blocks), and where the kernel has to compact memory to find free 2 MiB
frames (Linux's default `defrag=madvise` does that for advised mappings) a huge page's
first touch can cost ten times what 512 small pages do, a large share of a prefill step
(docs/performance.md). A probe of a few pages cannot tell: the first few frames are
often free, the next thousand are not.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys

import torch

log = logging.getLogger("fusegen.engine")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # the largest int: freed heap memory stays mapped


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: tell glibc's malloc to keep freed buffers for reuse. False
    where the C library is not glibc (musl, macOS) or refuses."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not done:
        log.info("malloc refused the thresholds; CPU steps page-fault their buffers anew")
    return done


_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE = 2 * 2**20


def zeros_lazy(shape, dtype: torch.dtype, huge: bool = False) -> torch.Tensor:
    """A zeroed CPU tensor. On Linux it is an anonymous mapping of its own: the kernel
    hands out zeroed pages as they are first touched, so a KV pool of gigabytes costs
    neither a zero-fill at start nor memory for blocks never used. `huge`: asked for
    transparent huge pages before any touch (see the module's note on what they cost)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not sys.platform.startswith("linux") or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    tensor = _anonymous(nbytes).view(dtype)[:math.prod(shape)].view(shape)
    if huge:
        advise_huge_pages(tensor)
    return tensor


def _anonymous(nbytes: int) -> torch.Tensor:
    """Bytes of an anonymous private mapping of their own (shared anonymous memory would
    be shmem, outside THP); the tensor keeps the mapping alive."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8)


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under the 2 MiB-aligned part of `tensor`'s memory. False where
    that is not possible (not Linux, too small, madvise refused); the tensor works
    either way."""
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if not sys.platform.startswith("linux") or end <= start:
        return False
    libc = _libc()
    if libc is None:
        return False
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def on_a_passing_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs), run on a thread of its own that ends with it; its result, or
    its exception raised here. For torch work a process does besides its engines
    (measuring, building checkpoints): the OpenMP team a thread gets with its first
    parallel region lives as long as the thread, and one left on the main thread would
    be a second team beside each engine's (see `fusegen.engine.llm`), which makes the
    engine's OpenMP threads sleep between its parallel regions."""
    import threading

    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="fusegen-passing")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
