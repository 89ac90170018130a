"""Recorded decode steps on CPUs: the sibling of CUDA graphs (engine/graphs.py).

A decode step at small batch on a CPU is bound by Python: each of a step's few hundred
C kernel calls costs microseconds of Python (shapes, strides, checks, ctypes' argument
conversion) around a few microseconds of C. `record(forward)` runs `forward()` once,
eagerly, noting in order every fusegen C kernel call (kernels/native.py's `recording`:
the ctypes function, its arguments, its return value) and every torch op that computes
(a `TorchDispatchMode`); `CpuGraph.replay()` makes the same calls again with the same
arguments, in a Python loop with nothing else in it.

What a replay repeats and what it does not:
- C calls: the same function on the same pointers and sizes. Their arguments are
  converted to ctypes values once, at recording, so a replay skips the conversion. A call
  whose return value (a status) differs from the recorded one raises `ReplayMismatch`.
- torch ops: an in-place or out= op runs as it is; an out-of-place op's fresh result is
  copied into the tensor it returned at recording, which the later calls read.
- views, ops that returned an alias of an input (`to` its own dtype), allocations
  (their tensors are the recording's, kept) and host reads
  (`item`: a bounds check's Python-side effect is not replayed; the caller checks the
  step's inputs before each replay instead) are not repeated, nor are ops whose results
  only host reads consumed.
- Every tensor an op made during the recording stays alive as long as the graph does:
  the C calls hold raw pointers into them.

So a replay is only right where `forward` makes the same calls whatever the values in
its input buffers: no Python-side decision on those values (`tolist`, which dispatches
no op, would go unseen). The engine records only steps whose every kernel takes the
C path (engine/graphs.py: `CpuDecodeGraphs`).
"""
from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fusegen.kernels import native

aten = torch.ops.aten
# ops that only allocate: the recording's tensors are kept, so nothing to redo
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
                aten.new_empty.default, aten.new_empty_strided.default, aten.lift_fresh.default}
# host reads: the value went to Python, which a replay does not rerun
_HOST_READS = {aten._local_scalar_dense.default, aten.item.default, aten.equal.default,
               aten.is_nonzero.default}


class ReplayMismatch(RuntimeError):
    """A replayed kernel returned another status than at recording."""


@dataclass(eq=False)
class CpuGraph:
    """One recorded step: `steps` (callable, args, expected result) in order; `keep`
    the tensors and ctypes values the calls point into; `nbytes` the bytes of the
    storages the recording allocated (what keeping the graph costs)."""
    steps: list[tuple]
    keep: list = field(repr=False)
    nbytes: int
    num_calls: int  # C kernel calls
    num_ops: int  # torch ops

    def replay(self) -> None:
        for call, args, expected in self.steps:
            got = call(*args)
            if got != expected:
                raise ReplayMismatch(
                    f"replayed kernel {getattr(call, '__name__', call)} returned {got!r}, "
                    f"{expected!r} at recording")


class _Ops(TorchDispatchMode):
    """Notes every op of the recording thread into `log` beside the kernel calls."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.log.append((_OP, func, args, kwargs, out))
        return out


_OP = object()  # marks a torch op's entry in the recording's log


def record(forward) -> tuple[CpuGraph, object]:
    """(the graph of `forward`'s kernel calls and ops, what `forward()` returned): the
    call runs once, now, eagerly; its output tensors are the ones a replay writes."""
    log: list = []
    with native.recording(log), _Ops(log):
        out = forward()
    return _build(log, out), out


def _build(log: list, out) -> CpuGraph:
    outputs = {id(t) for t in _tensors(out)}
    keep, fresh, live, pointers = [], {}, _consumed(log, outputs), _pointers(log)
    steps, num_calls, num_ops = [], 0, 0
    for entry in log:
        if entry[0] is not _OP:
            fn, args, result = entry
            steps.append(_c_call(fn, args, result, keep))
            num_calls += 1
            continue
        _, func, args, kwargs, result = entry
        tensors = _tensors(result)
        keep.append(result)
        if func in _ALLOCATIONS:
            fresh.update(_storages(tensors))
            continue
        if func in _HOST_READS or not tensors:
            continue
        if func._schema.is_mutable:  # in place or out=: replays as it is
            keep.append((args, kwargs))
            steps.append((_run_in_place, (func, args, kwargs), None))
            num_ops += 1
            continue
        inputs = _storages(_tensors((args, kwargs)))
        made = {k: v for k, v in _storages(tensors).items() if k not in inputs}
        # a view, or an op that may alias and did (`to` its own dtype, `reshape` of
        # contiguous memory): nothing computed. Else a fresh result, unless nothing
        # replayed reads it (a later op, a kernel by pointer, `forward`'s caller)
        if made and any(id(t) in live or _holds(t, pointers) for t in tensors):
            fresh.update(made)
            keep.append((args, kwargs))
            steps.append((_run_into, (func, args, kwargs, result), None))
            num_ops += 1
    return CpuGraph(steps, keep, sum(fresh.values()), num_calls, num_ops)


def _consumed(log: list, outputs: set[int]) -> set[int]:
    """ids of the tensors a later op other than a host read takes, and `forward`'s
    outputs."""
    live = set(outputs)
    for entry in log:
        if entry[0] is _OP and entry[1] not in _HOST_READS:
            live.update(id(t) for t in _tensors((entry[2], entry[3])))
    return live


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result (nested tuples, lists, dicts), in
    order: what tree_flatten finds there, without its cost per node (a recording
    flattens every op's arguments and result, the allocations' among them)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _pointers(log: list) -> list[int]:
    """The kernel calls' integer arguments (their pointers among them), sorted."""
    return sorted({a for entry in log if entry[0] is not _OP for a in entry[1]
                   if isinstance(a, int) and not isinstance(a, bool)})


def _holds(t: torch.Tensor, pointers: list[int]) -> bool:
    """Whether a kernel call took a pointer into `t`'s storage."""
    storage = t.untyped_storage()
    start = storage.data_ptr()
    i = bisect.bisect_left(pointers, start)
    return i < len(pointers) and pointers[i] < start + storage.nbytes()


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _run_in_place(func, args, kwargs) -> None:
    func(*args, **kwargs)


def _run_into(func, args, kwargs, captured) -> None:
    """An out-of-place op again, its result copied into the tensor(s) it returned at
    recording, which later calls read."""
    result = func(*args, **kwargs)
    if isinstance(captured, torch.Tensor):
        if result is not captured:
            captured.copy_(result)
        return
    for dst, src in zip(_tensors(captured), _tensors(result)):
        if src is not dst:
            dst.copy_(src)


def _c_call(fn, args: tuple, result, keep: list) -> tuple:
    """(a callable, its arguments, the recorded result) that repeats `fn(*args)`: a
    second function object at the same address without argtypes, given the arguments
    already converted to ctypes values (each converted as `fn`'s argtypes would)."""
    argtypes = fn.argtypes
    if not argtypes:
        return fn, args, result
    bare = type(fn)(ctypes.cast(fn, ctypes.c_void_p).value)
    bare.restype = fn.restype
    converted = tuple(_convert(t, a) for t, a in zip(argtypes, args))
    keep.append((args, converted))
    bare.__name__ = getattr(fn, "__name__", "kernel")
    return bare, converted, result


def _convert(argtype, value):
    if value is None or isinstance(value, argtype):
        return value  # None: a NULL pointer either way
    if isinstance(value, ctypes.Structure) and hasattr(argtype, "_type_"):
        return ctypes.byref(value)  # a POINTER(struct) argument given the struct
    if isinstance(value, (int, float)) and issubclass(argtype, ctypes._SimpleCData):
        return argtype(value)
    return argtype.from_param(value)  # an array or a ctypes object: what ctypes passes
