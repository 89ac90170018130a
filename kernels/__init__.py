"""Kernels: one file per operation, each with a Triton kernel, a torch reference and a
dispatcher that picks Triton on CUDA and the reference elsewhere.

FUSEGEN_KERNELS overrides the choice: `reference` everywhere, or `triton` everywhere,
which with TRITON_INTERPRET=1 runs the engine's whole Triton path on CPU tensors (how
the test suite checks the GPU path's logic on a machine without a GPU).

On CPUs, operations that torch cannot do well have C kernels (`kernels/native.py`),
compiled on first use; `reference` skips them too."""
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


def use_native(tensor) -> bool:
    """The C kernels serve CPU tensors unless FUSEGEN_KERNELS says otherwise or they
    cannot be built here."""
    if tensor.device.type != "cpu" or os.environ.get("FUSEGEN_KERNELS", "auto") != "auto":
        return False
    from fusegen.kernels import native

    return native.library() is not None


def as_rows(tensor, width: int):
    """`tensor` [..., width] as rows [N, width]: itself when already 2-D (a decode step
    calls the row-wise kernels about 40 times, and a reshape and a view back cost more
    than some of those kernels' work), else reshaped (a copy where no view exists)."""
    return tensor if tensor.dim() == 2 else tensor.reshape(-1, width)
