"""Kernels: one file per operation, each with a Triton kernel, a torch reference and a
dispatcher: Triton on CUDA (`use_triton`); on CPUs the C kernel where the operation has
one (`csrc/`, built by `native.py` on first use: `use_native`), else the reference.

FUSEGEN_KERNELS overrides the choice: `reference` everywhere (the C kernels skipped
too), or `triton` everywhere, which with TRITON_INTERPRET=1 runs the engine's whole
Triton path on CPU tensors (how the test suite checks the GPU path's logic on a machine
without a GPU)."""
import functools
import os

import torch


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# FUSEGEN_KERNELS is read on every kernel call (a decode step makes a few hundred), and a
# test may change it between two calls. os.environ.get costs a couple of microseconds a
# call (it encodes the key and decodes the value). `os.environ` keeps its contents in its
# `_data` dict under encoded keys, which every change made through os.environ updates
# (monkeypatch.setenv's too), so one lookup there by a key encoded once gives
# os.environ.get's answer.
_ENVIRON = getattr(os.environ, "_data", None)
try:
    _MODE_KEY = os.environ.encodekey("FUSEGEN_KERNELS")
    _MODES = {os.environ.encodevalue(m): m for m in ("auto", "reference", "triton")}
except AttributeError:  # an os.environ without the mapping: read it the ordinary way
    _ENVIRON = None


def kernels_mode() -> str:
    """FUSEGEN_KERNELS as it is now: "auto" (unset), "reference", "triton", or whatever
    else it holds (which no dispatcher takes as a choice)."""
    if _ENVIRON is None:
        return os.environ.get("FUSEGEN_KERNELS", "auto")
    raw = _ENVIRON.get(_MODE_KEY)
    if raw is None:
        return "auto"
    mode = _MODES.get(raw)
    return mode if mode is not None else os.environ.decodevalue(raw)


def use_triton(tensor) -> bool:
    mode = kernels_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        return True
    return tensor.is_cuda and _triton_available()


_native = None  # the module kernels.native, imported on first use


def use_native(tensor) -> bool:
    """The C kernels serve CPU tensors unless FUSEGEN_KERNELS says otherwise or they
    cannot be built here."""
    global _native
    if not tensor.is_cpu or kernels_mode() != "auto":
        return False
    if _native is None:
        from fusegen.kernels import native as _native
    return _native.library() is not None


# Values an elementwise C kernel's pass must cover before it runs on several threads: a
# parallel region's start and join (waking the other threads, tens of microseconds
# where they have been descheduled) cost more than a decode step's norm or SiLU over a
# few rows, which one thread does in a few microseconds.
PARALLEL_FROM = 32768


def elementwise_threads(num_values: int) -> int:
    """Threads for an elementwise C kernel's pass over `num_values` values (each row's
    result is the same on any number)."""
    return torch.get_num_threads() if num_values >= PARALLEL_FROM else 1


def as_rows(tensor, width: int):
    """`tensor` [..., width] as rows [N, width]: itself when already 2-D (a decode step
    calls the row-wise kernels about 40 times, and a reshape and a view back cost more
    than some of those kernels' work), else reshaped (a copy where no view exists)."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, width)
