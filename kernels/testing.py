"""Running a kernel launcher under Triton's interpreter from any process.

`triton.jit` chooses interpreter or compiler once, when a function is decorated, and
`triton.language`'s own helpers (`tl.zeros`, `tl.sum`, ...) are decorated when triton is
first imported. So TRITON_INTERPRET=1 must be set before triton is imported, which a test
cannot ensure inside a pytest run that imported the engine first (and should not: the
CUDA tests in the same run want the compiler). `interpreted(fn)` instead returns a
stand-in for `fn` that runs it in one long-lived child process started with
TRITON_INTERPRET=1, on CPU tensors, and copies the child's tensor arguments back into the
caller's, so in-place launchers (the KV cache write, rotary) behave as if run here.
"""
from __future__ import annotations

import atexit
import functools
import io
import os
import subprocess
import sys

import torch


def backport_interpreter_fixes() -> None:
    """Triton <= 3.6's interpreter (TRITON_INTERPRET=1) keeps a scalar as a 1-element
    array and hands it to range() through int(array), which NumPy >= 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars", triton-lang/triton#9171):
    a key loop whose bounds are loaded values (`_paged_attention_kernel`) fails there.
    Later Triton squeezes the array first; so does this, in an interpreter that lacks
    that fix. Called by the interpreter's child below and by tests that run the engine
    under the interpreter; compiled kernels never see it."""
    import inspect

    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        broken = "int(self.handle.data))" in inspect.getsource(patch_tensor)
    except (TypeError, OSError):
        return
    if not broken or list(inspect.signature(patch_tensor).parameters) != ["tensor", "scope"]:
        return

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = _patch_lang_tensor


# The child: frames are an 8-byte length and a torch.save payload, on a private copy of
# stdout (stray prints go to stderr).
_CHILD = r"""
import importlib, io, os, sys, traceback
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
torch.set_num_threads(1)
from fusegen.kernels.testing import backport_interpreter_fixes
backport_interpreter_fixes()

# The interpreter keeps bfloat16 as raw uint16 and its tl.dot multiplies the bit patterns
# (triton-lang/triton#11584: not supported yet); do what the GPU does, exact bf16
# products accumulated in fp32.
_create_dot = interpreter.interpreter_builder.create_dot
def _widen(x):
    if x.dtype != tl.bfloat16:
        return x
    return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
interpreter.interpreter_builder.create_dot = (
    lambda a, b, *rest: _create_dot(_widen(a), _widen(b), *rest))

# Its fp32 -> bfloat16 cast truncates; the GPU's `.to(tl.bfloat16)` rounds to nearest
# even, as torch does.
_cast_impl = interpreter.interpreter_builder.cast_impl
def _cast_rne(src, dst_type):
    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
        return _cast_impl(src, dst_type)
    rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
    return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
interpreter.interpreter_builder.cast_impl = _cast_rne

while header := sys.stdin.buffer.read(8):
    module, name, args, kwargs = torch.load(
        io.BytesIO(sys.stdin.buffer.read(int.from_bytes(header, "little"))), weights_only=False)
    try:
        result = getattr(importlib.import_module(module), name)(*args, **kwargs)
        reply = ("ok", result, args, kwargs)
    except Exception as exc:
        reply = ("error", exc, traceback.format_exc(), None)
    buf = io.BytesIO()
    torch.save(reply, buf)
    out.write(len(buf.getvalue()).to_bytes(8, "little") + buf.getvalue())
    out.flush()
"""


class InterpreterError(RuntimeError):
    """The child's traceback, chained under the exception it raised."""


def triton_on(device: str, fn):
    """The launcher `fn` itself on CUDA; on the CPU, `interpreted(fn)`."""
    return fn if torch.device(device).type == "cuda" else interpreted(fn)


def interpreted(fn):
    """`fn` (a module-level function) run under TRITON_INTERPRET=1 in the child process.
    Tensor arguments must be on the CPU."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        status, result, new_args, new_kwargs = _exchange(
            (fn.__module__, fn.__name__, args, kwargs))
        if status == "error":
            raise result from InterpreterError(new_args)
        for mine, theirs in [*zip(args, new_args),
                             *((kwargs[k], new_kwargs[k]) for k in kwargs)]:
            if isinstance(mine, torch.Tensor):
                mine.copy_(theirs)
        return result
    return call


def _exchange(message):
    child = _child()
    buf = io.BytesIO()
    torch.save(message, buf)
    child.stdin.write(len(buf.getvalue()).to_bytes(8, "little") + buf.getvalue())
    child.stdin.flush()
    header = child.stdout.read(8)
    if len(header) < 8:
        raise InterpreterError(f"the interpreter child exited with code {child.wait()}")
    payload = child.stdout.read(int.from_bytes(header, "little"))
    return torch.load(io.BytesIO(payload), weights_only=False)


@functools.cache
def _child() -> subprocess.Popen:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env)
    atexit.register(_stop, child)
    return child


def _stop(child: subprocess.Popen) -> None:
    child.stdin.close()
    child.wait(timeout=30)
