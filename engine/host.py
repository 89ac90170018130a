"""The host process fusegen runs in: allocator settings for CPU inference.

A CPU step allocates its activations afresh: a 2048-token step of a small model asks
for tens of [2048, 3072] fp32 buffers (25 MB each). glibc serves requests that large
with mmap and returns them to the kernel on free, so every step page-faults each of
them in again and the kernel zeroes every page first: 44,000 faults per step on the
cpu-prefill benchmark, about a tenth of the step. Raising glibc's mmap threshold to its
maximum (32 MiB) and its trim threshold keeps freed buffers in the heap, to be reused by
the next step (the same reason vLLM's CPU engine preloads tcmalloc). The cost is that
the heap keeps the step's peak activation memory, which the memory plan reserves anyway.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("fusegen.engine")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # the largest int: freed heap memory stays mapped


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: tell glibc's malloc to keep freed buffers for reuse. False
    where the C library is not glibc (musl, macOS) or refuses."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not done:
        log.info("malloc refused the thresholds; CPU steps page-fault their buffers anew")
    return done
