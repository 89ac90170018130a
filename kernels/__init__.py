"""Kernels: one file per operation, each with a Triton kernel, a torch reference and a
dispatcher that picks Triton on CUDA and the reference elsewhere."""
import functools
import os


@functools.cache
def _triton_available() -> bool:
    if os.environ.get("FUSEGEN_DISABLE_TRITON"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
