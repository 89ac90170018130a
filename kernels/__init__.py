"""Kernels: one file per operation, each with a Triton kernel, a torch reference and a
dispatcher that picks Triton on CUDA and the reference elsewhere.

FUSEGEN_KERNELS overrides the choice: `reference` everywhere, or `triton` everywhere,
which with TRITON_INTERPRET=1 runs the engine's whole Triton path on CPU tensors (how
the test suite checks the GPU path's logic on a machine without a GPU)."""
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


def use_triton(tensor) -> bool:
    mode = os.environ.get("FUSEGEN_KERNELS", "auto")
    if mode == "reference":
        return False
    if mode == "triton":
        return True
    return tensor.is_cuda and _triton_available()
