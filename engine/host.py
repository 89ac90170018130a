"""The host process fusegen runs in: allocator settings for CPU inference.

A CPU step allocates its activations afresh: a 2048-token step of a small model asks
for tens of [2048, 3072] fp32 buffers (25 MB each). glibc serves requests that large
with mmap and returns them to the kernel on free, so every step page-faults each of
them in again and the kernel zeroes every page first: 44,000 faults per step on the
cpu-prefill benchmark, about a tenth of the step. Raising glibc's mmap threshold to its
maximum (32 MiB) and its trim threshold keeps freed buffers in the heap, to be reused by
the next step (the same reason vLLM's CPU engine preloads tcmalloc). The cost is that
the heap keeps the step's peak activation memory, which the memory plan reserves anyway.

The KV cache is read in blocks scattered over gigabytes: on 4 KiB pages every block
costs TLB misses, and decode attention reads about a tenth slower than on 2 MiB pages.
Linux gives a mapping transparent huge pages when asked (`madvise`), which
`zeros_huge` does for the cache, but only where huge pages are cheap to fault in: the
pool is touched for the first time while the engine runs (each prefill writes fresh
blocks), and where the kernel compacts memory to find a free 2 MiB frame (Linux's
default `defrag=madvise` does that for advised mappings), a huge page's first touch can
cost ten times what 512 small pages do. Measured on a 2-core cloud VM: 4.4 ms against
0.4 ms a 2 MiB, 35 ms of a 2,048-token prefill step's 220. `huge_pages_pay` measures it
once per process and the cache follows the measurement.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import sys
import time

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


def zeros_huge(shape, dtype: torch.dtype, huge: bool | None = None) -> torch.Tensor:
    """A zeroed CPU tensor, backed by transparent huge pages where Linux grants them and
    `huge` asks (None: where `huge_pages_pay()`). On Linux it is an anonymous mapping of
    its own: the kernel hands out zeroed pages as they are first touched, so a KV pool of
    gigabytes costs neither a zero-fill at start nor memory for blocks never used; asked
    for huge pages before any touch."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not sys.platform.startswith("linux") or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    tensor = _anonymous(nbytes).view(dtype)[:math.prod(shape)].view(shape)
    if huge if huge is not None else huge_pages_pay():
        advise_huge_pages(tensor)
    return tensor


def _anonymous(nbytes: int) -> torch.Tensor:
    """Bytes of an anonymous private mapping of their own (shared anonymous memory would
    be shmem, outside THP); the tensor keeps the mapping alive."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8)


# A huge page is taken when its first touch costs at most this many times what the same
# 2 MiB costs on small pages: its gain (fewer TLB misses in attention) is ~10%, and a
# pool's every byte is touched once.
HUGE_FAULT_RATIO = 3.0


@functools.cache
def huge_pages_pay() -> bool:
    """Whether the KV pool goes on huge pages here: the first touch of 16 MiB timed on
    huge pages and on small pages (a few ms to a few tens, once per process). Eight huge
    pages, not one: some come from free 2 MiB frames at once, the rest only after the
    kernel compacts memory, and the pool's gigabytes take both."""
    if not sys.platform.startswith("linux"):
        return False

    def first_touch(huge: bool) -> float | None:
        region = _anonymous(_PROBE_PAGES * HUGE_PAGE + HUGE_PAGE)  # room to align
        offset = -region.data_ptr() % HUGE_PAGE
        pages = region[offset:offset + _PROBE_PAGES * HUGE_PAGE]
        if huge and not advise_huge_pages(pages):
            return None
        start = time.perf_counter()
        pages.fill_(1)
        return time.perf_counter() - start

    small, huge = first_touch(False), first_touch(True)
    if huge is None:
        return False
    pays = huge <= HUGE_FAULT_RATIO * small
    log.info("fusegen: the KV cache %s huge pages (first touch of %d MiB: %.2f ms on huge "
             "pages, %.2f ms on small pages)", "on" if pays else "off",
             _PROBE_PAGES * HUGE_PAGE >> 20, huge * 1e3, small * 1e3)
    return pays


_PROBE_PAGES = 8


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
