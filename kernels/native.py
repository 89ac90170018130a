"""CPU kernels in C, compiled on first use for the machine they run on.

Some operations have no fast form in torch on a CPU: decode attention over a paged
cache would have to gather every sequence's blocks into a dense copy first, and
RMSNorm, SiLU-mul and rotary take several passes and temporaries each. Those are
written in C (`kernels/csrc/`), compiled once per machine with the system C compiler
(`-O3 -march=native -fopenmp`) and called through ctypes, which releases the GIL for
the call. The shared object is cached under $FUSEGEN_CACHE_DIR (default
~/.cache/fusegen)/kernels, named by a hash of the source, the flags, the compiler and
the CPU's instruction-set flags, so a cluster of different machines sharing a home
directory never loads a build made for another CPU.

Without a compiler (or when the build fails) fusegen falls back to the torch
reference and says so once in the log; FUSEGEN_KERNELS=reference skips the build.

Every entry point of the loaded library is a `Kernel`: it calls the ctypes function
and, while `recording` is active in the calling thread, notes the call (function,
arguments, result), which is how a CPU graph (engine/cpu_graphs.py) learns a decode
step's kernel calls. A name the table below does not declare is wrapped too the first
time it is read, so no call site can reach an unwrapped function through the library.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("fusegen.kernels")

_SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))
_HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))  # in the build's key too
# -ffast-math lets reductions reassociate into vector lanes and expf vectorise (glibc's
# libmvec); the kernels never rely on inf/NaN arithmetic. It is a compile flag only:
# linking with it adds crtfastmath.o, whose constructor would switch the loading thread
# to flush-to-zero, changing torch's own results on subnormal values in that thread.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=gnu11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


class Strides(ctypes.Structure):
    # Mirrors strides_t in csrc/paged_decode.c (element strides).
    _fields_ = [(name, ctypes.c_int64) for name in
                ("q_t", "q_h", "o_t", "o_h", "k_b", "k_s", "k_h", "v_b", "v_s", "v_h", "bt")]


_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    # csrc/paged_decode.c
    **{name: [_P] * 8 + [_I] * 6 + [_F, ctypes.POINTER(Strides), _I]
       for name in ("paged_decode_f32", "paged_decode_bf16", "paged_decode_f16",
                    "paged_prefill_f32", "paged_prefill_bf16")},  # and csrc/paged_prefill.c
    # csrc/elementwise.c
    **{f"rms_norm_{t}": [_P] * 5 + [_L, _I, _F] + [_L] * 4 + [_I, _I] for t in ("f32", "bf16")},
    **{f"silu_mul_{t}": [_P, _P, _L, _I, _L, _L, _I] for t in ("f32", "bf16")},
    **{f"rotary_{t}": [_P] * 5 + [_L, _I, _I, _I] + [_L] * 5 + [_I] for t in ("f32", "bf16")},
    **{f"rotary_cache_{t}": [_P] * 9 + [_L, _I, _I, _I, _I, _P, _L, _L, _I, _I]
       for t in ("f32", "bf16", "f16")},
    # csrc/gemm.c
    "gemm_pack_f32": [_P, _P, _L, _L, _I],
    "gemm_f32": [_P, _L, _L, _P, _L, _L, _P, _P, _L, _I],
    "gemm_argmax_f32": [_P, _L, _L, _P, _L, _L, _P, _P, _I],
    # csrc/gemm_tiles.c
    "gemm_tiles_available": [],
    **{f"gemm_tiles_{t}": [_P, _L, _L, _P, _L, _L, _L, _P, _P, _L, _I] for t in ("bf16", "f32")},
    # csrc/argmax.c
    **{f"argmax_{t}": [_P, _P, _L, _I, _L, _I] for t in ("f32", "bf16")},
    # csrc/quant_gguf.c
    "quant_gguf_available": [_I],
    **{f"quant_gguf_{t}": [_I, _P, _L, _L, _P, _L, _L, _P, _L, _I, _I] for t in ("f32", "bf16")},
    "quant_gguf_dequantize_f32": [_I, _P, _L, _L, _P, _I, _I],
    # csrc/quant_vnni.c
    "quant_gguf_q8_available": [_I],
    "quant_gguf_q8_bf16": [_I, _P, _L, _L, _P, _L, _L, _P, _L, _I],
    "quant_gguf_q8_quantize_bf16": [_P, _L, _L, _L, _P, _P],
    "quant_gguf_q8_packed_available": [_I],
    "quant_gguf_q8_packed_bf16": [_I, _P, _L, _L, _P, _L, _L, _P, _L, _I],
    "quant_gguf_q8_repack": [_I, _P, _L, _L, _I],
    "quant_gguf_q8_packed_rows": [_I, _P, _L, _L, _P, _L, _P],
    # csrc/quant_group.c
    "quant_group_available": [_I],
    **{f"quant_group_{t}": [_I, _I, _P, _L, _L, _P, _P, _P, _L, _L, _P, _L, _I, _I]
       for t in ("f32", "bf16")},
    "quant_group_dequantize_f32": [_I, _I, _P, _P, _P, _L, _L, _P, _I, _I],
    # csrc/quant_group_vnni.c
    "quant_group_q8_available": [_I],
    "quant_group_q8_bf16": [_I, _I, _P, _L, _L, _P, _P, _P, _L, _L, _P, _L, _I],
    # csrc/sparse_tiles.c
    "sparse_tiles_available": [],
    "sparse_tiles": [_P, _I, _L, _L, _P, _I, _L, _P, _L, _I, _I],
}


_recording = 0  # recorders active in any thread: the calls' only check when it is 0
_recorders = threading.local()  # .calls: the list this thread's calls go to, or None
_recording_lock = threading.Lock()


class Kernel:
    """A C entry point as call sites hold it: `fn` is the ctypes function; `argtypes`
    and `restype` are its own (set through the wrapper)."""
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        result = self.fn(*args)
        if _recording:  # one global read a call when nothing records
            calls = getattr(_recorders, "calls", None)
            if calls is not None:
                calls.append((self.fn, args, result))
        return result

    @property
    def argtypes(self):
        return self.fn.argtypes

    @argtypes.setter
    def argtypes(self, value):
        self.fn.argtypes = value

    @property
    def restype(self):
        return self.fn.restype

    @restype.setter
    def restype(self, value):
        self.fn.restype = value

    @property
    def __name__(self):
        return self.fn.__name__


@contextmanager
def recording(calls: list):
    """Every kernel call this thread makes inside the block is appended to `calls` as
    (ctypes function, args tuple, return value), in order. Not reentrant."""
    global _recording
    if getattr(_recorders, "calls", None) is not None:
        raise RuntimeError("this thread is recording kernel calls already")
    _recorders.calls = calls
    with _recording_lock:
        _recording += 1
    try:
        yield calls
    finally:
        _recorders.calls = None
        with _recording_lock:
            _recording -= 1


class _Kernels(ctypes.CDLL):
    """The shared object, whose functions read as attributes are `Kernel`s."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        kernel = Kernel(self[name])  # AttributeError where the build lacks it
        setattr(self, name, kernel)
        return kernel


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.machine() + platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("FUSEGEN_CACHE_DIR") or Path.home() / ".cache" / "fusegen"
    return Path(root) / "kernels"


def build(sources: list[Path] = _SOURCES) -> Path:
    """One shared object of `sources`, built unless a cached build matches. Raises
    RuntimeError with the compiler's message when the build fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError as exc:
        raise RuntimeError(f"the C compiler {cc} cannot run: {exc}") from exc
    key = hashlib.sha256("\0".join(
        [*(p.read_text() for p in [*sources, *_HEADERS]), " ".join(_FLAGS + _LINK_FLAGS),
         version, _cpu_flags()]
    ).encode()).hexdigest()[:16]
    target = _cache_dir() / f"fusegen-cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent builders (Dask workers starting
    # together) each write their own file and the last rename wins, never a torn file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=target.parent) as objects:
        try:
            outputs = []
            for source in sources:
                outputs.append(str(Path(objects) / f"{source.stem}.o"))
                _run(cc, [*_FLAGS, "-c", str(source), "-o", outputs[-1]], source.name)
            _run(cc, [*_LINK_FLAGS, "-o", tmp, *outputs, "-lm"], "the link")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def _run(cc: str, args: list[str], what: str) -> None:
    done = subprocess.run([cc, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{cc} failed on {what}:\n{done.stderr.strip()}")


@functools.cache
def library_with(symbol: str) -> ctypes.CDLL | None:
    """The loaded kernels where they export `symbol`, else None (no build here, or a
    build without that kernel)."""
    lib = library()
    return lib if lib is not None and hasattr(lib, symbol) else None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (logged once) when they cannot be built here.
    (FUSEGEN_KERNELS is the dispatchers' business: `kernels.use_native`.)"""
    try:
        import torch  # noqa: F401 - load torch's OpenMP runtime first, so the kernels share it

        lib = _Kernels(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("fusegen: CPU kernels unavailable, using the torch reference: %s", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int if name.startswith(
            ("paged_", "rotary_cache_", "gemm_argmax", "gemm_tiles", "quant_", "sparse_")) else None
    return lib
