"""The caller's OpenMP team, released so that it does not slow the engine's down.

libgomp gives every thread that opens a parallel region a pool of worker threads of its
own, kept for as long as that thread lives. An engine's thread has one (the C kernels'
regions and torch's). A caller's thread that has ever run a parallel torch op (one
512 x 512 matmul is enough) has a second, idle one; with it libgomp counts more
threads than cores, lets waiting workers spin only ~100 times before they sleep, and
every parallel region of every step then pays a futex wake-up: decode on CPUs runs up
to twice as slow (docs/performance.md).

`release_thread_team()` frees the calling thread's pool through OpenMP 5.0's
`omp_pause_resource_all`, which libgomp implements as freeing the calling thread's pool
(its workers exit); the next parallel region that thread opens builds a new one. The
symbol is looked up through the loaded C kernels' own handle, so it is the runtime the
kernels run on (torch's, loaded first: `native.library`), never a second one loaded here.
`LLM` calls it wherever a caller hands work to its engine.

This makes the count honest, and the engine's team spins at libgomp's full count: the
fastest on cores of its own, but on cores that other busy processes share, a spinning
worker can take the time slice its team's master needs (docs/performance.md has both).
"""
from __future__ import annotations

import ctypes
import functools
import threading

from fusegen.kernels import kernels_mode

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
_thread = threading.local()  # .engine: the thread steps an engine


def mark_engine_thread() -> None:
    """The calling thread steps an engine: its team is the one to keep, and
    `release_thread_team` leaves it alone there."""
    _thread.engine = True


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP pool. True when the runtime did (or the thread
    had none); False, changing nothing, where it cannot or must not: the C kernels are
    not in use (FUSEGEN_KERNELS other than auto, not loaded in this process, or not
    buildable here: the engine's parallel regions are then torch's own business), the
    runtime has no `omp_pause_resource_all`, the caller is an engine's own thread, or
    it is inside a parallel region (the runtime refuses). A thread without a pool
    costs well under a microsecond, so it is called on every hand-off."""
    if getattr(_thread, "engine", False) or kernels_mode() != "auto":
        return False
    pause = _pause_function()
    return pause is not None and pause(_OMP_PAUSE_HARD) == 0


def _pause_function():
    """`omp_pause_resource_all` of the runtime the loaded C kernels use, or None. The
    kernels are not built for this: a process that has not loaded them has no engine
    running them."""
    from fusegen.kernels import native

    if native.library.cache_info().currsize == 0:
        return None
    return _pause_in(native.library())


@functools.cache
def _pause_in(lib: ctypes.CDLL | None):
    """dlsym through `lib`'s handle: `lib` and the libraries it was linked against,
    which is the OpenMP runtime its parallel regions run on. The plain ctypes function
    (`lib[name]`), not an attribute of the kernels' library, which wraps its entry
    points for recording."""
    if lib is None:
        return None
    try:
        fn = lib["omp_pause_resource_all"]
    except AttributeError:  # a runtime before OpenMP 5.0, or a library without OpenMP
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
