"""Streaming decoder layers that do not stay on the device.

A ring of `num_slots` device staging slots, each the size of one layer, serves the
streamed layers in order: load k (of an endless sequence over the streamed layers,
step after step) fills slot k % num_slots. Loads run ahead of compute by up to
`num_slots - 1` layers and cross step boundaries, so the first streamed layers of
the next step load while the current step finishes. A slot is refilled only after
the layer computed from it has finished.

A layer of a quantized model streams as its compressed components, each in its own
dtype (uint8 codes, fp16 scales), beside its dense tensors in the run's dtype: a slot
is one byte buffer of the largest streamed layer's bytes, which each layer reads
through views of its own shapes, and its compressed linears are pointed at those
views each step (`CompressedLinear.set_weight`).

A layer in a device group's peer tier arrives the same way: its parts are `PeerPart`s,
received from the rank that holds them straight into the slot.

Copies run on a background thread, which keeps them off the compute thread: on CPU
the copy itself overlaps compute on the other cores; on CUDA the thread issues
non-blocking copies on a separate stream and records an event that the compute
stream waits on, so the host never blocks on a transfer. The slots are allocated
once; per step only a disk-tier part that is not a plain view of the file (a GGUF
weight whose rows are reordered, a weight quantized on load) is read into a temporary
on the copy thread.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Stream:
    """One tensor of a streamed layer, by its name in the layer ("qkv.weight", or a
    compressed linear's component "qkv.blocks", "qkv.scales"): `parts` stacked along
    dim 0 give it, in `dtype` (a dense weight: the run's dtype, converted while copied;
    a compressed component: its own, uint8 codes or fp16 scales). A part is a tensor
    (host memory, a memory map) or a `DiskPart`, read afresh at every copy."""
    parts: list
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class DiskPart:
    """A part read only when copied: `read()` gives its tensor (a compressed weight's
    component from the file's memory map), `shape` known without reading."""
    shape: tuple[int, ...]
    read: object  # () -> torch.Tensor


@dataclass(frozen=True, slots=True)
class PeerPart:
    """A part held in another rank's memory (a device group's peer tier,
    engine/parallel/peer.py): `fill(target)` starts receiving it straight into the
    staging slot and returns the wait for it; `shape` known without fetching."""
    shape: tuple[int, ...]
    fill: object  # (target: torch.Tensor) -> (() -> None)


def slot_layout(streams: dict[str, Stream]) -> dict[str, tuple[int, Stream]]:
    """Where each of a layer's tensors lies in a staging slot's bytes: name -> (byte
    offset, stream). Wider elements first, so every offset is a multiple of its
    tensor's element size with no padding (sizes are powers of two): a slot of the
    layer's exact bytes holds it."""
    order = sorted(streams, key=lambda name: -streams[name].dtype.itemsize)  # stable
    layout, offset = {}, 0
    for name in order:
        layout[name] = (offset, streams[name])
        offset += streams[name].nbytes
    return layout


class WeightStreamer:
    def __init__(self, layers, sources: dict[int, dict[str, Stream]], num_slots: int,
                 device: torch.device):
        # sources: streamed layer index -> its tensors by name (pinned host or
        # memory-mapped disk parts). A slot is one byte buffer of the largest streamed
        # layer's bytes (allocated once); each layer reads it through its own views, so
        # layers whose compressed types differ (a GGUF mix) share the slots.
        self.layers = layers
        self.sources = sources
        self.order = sorted(sources)  # streamed layer indices, in compute order
        self.position = {layer: i for i, layer in enumerate(self.order)}
        self.device = device
        self.num_slots = num_slots
        self.layer_bytes = {i: sum(s.nbytes for s in sources[i].values()) for i in self.order}
        self.buffers = [torch.empty(max(self.layer_bytes.values()), dtype=torch.uint8,
                                    device=device) for _ in range(num_slots)]
        # per slot, per streamed layer: its tensors as views of the slot's bytes
        self.views = [{i: _views(buffer, slot_layout(sources[i])) for i in self.order}
                      for buffer in self.buffers]
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="fusegen-weights")
        self.bytes_copied = 0
        self.num_loads = 0
        # Seconds compute spent waiting for a copy to finish (CPU: the copies that were
        # not hidden; on CUDA the host never waits on one, so this stays ~0 there).
        self.stall_seconds = 0.0
        self.layer_stall: dict[int, float] = {i: 0.0 for i in self.order}  # its share
        self.layer_loads: dict[int, int] = {i: 0 for i in self.order}
        self.reset()

    def reset(self) -> None:
        """Start the ring afresh (at start-up, and after a step failed midway)."""
        for future in getattr(self, "pending", {}).values():
            future.result()
        self.pending: dict[int, Future] = {}  # load number -> its copy
        self.compute_done: list = [None] * self.num_slots  # CUDA events: slots' last use
        self.next_load = 0  # the next load number to issue
        self.current = 0  # the load number the next acquire() consumes
        for _ in range(self.num_slots):
            self._issue()

    def replace_sources(self, sources: dict[int, dict[str, Stream]]) -> None:
        """New sources for some streamed layers, of the same names, dtypes and shapes
        (their slot views stay): the loads under way finish from the old ones, then the
        ring restarts."""
        for future in self.pending.values():
            future.result()
        self.sources |= sources
        self.reset()

    @property
    def slot_bytes(self) -> int:
        """One staging slot's bytes: the largest streamed layer's (compressed
        components at their own widths)."""
        return self.buffers[0].numel()

    @property
    def step_bytes(self) -> int:
        """What one pass over the streamed layers copies."""
        return sum(self.layer_bytes.values())

    def _issue(self) -> None:
        k = self.next_load
        self.next_load += 1
        layer = self.order[k % len(self.order)]
        self.pending[k] = self.executor.submit(self._load, layer, k % self.num_slots,
                                               self.compute_done[k % self.num_slots])

    def _load(self, layer: int, slot: int, after):
        target = self.views[slot][layer]
        if self.is_cuda:
            with torch.cuda.stream(self.copy_stream):
                if after is not None:
                    self.copy_stream.wait_event(after)
                self._copy(layer, target)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            return done
        self._copy(layer, target)
        return None

    def _copy(self, layer: int, target: dict[str, torch.Tensor]) -> None:
        receiving = []  # a peer layer's parts: all asked for, then waited on
        for name, stream in self.sources[layer].items():
            offset = 0
            for part in stream.parts:
                rows = part.shape[0]
                if isinstance(part, PeerPart):
                    receiving.append(part.fill(target[name][offset:offset + rows]))
                    offset += rows
                    continue
                source = part.read() if isinstance(part, DiskPart) else part
                target[name][offset:offset + rows].copy_(source, non_blocking=self.is_cuda)
                offset += rows
        for wait in receiving:
            wait()
        self.bytes_copied += self.layer_bytes[layer]
        self.num_loads += 1
        self.layer_loads[layer] += 1

    def acquire(self, layer: int) -> None:
        """Block until `layer`'s weights are in its slot; point the layer at them."""
        if layer not in self.position:
            return
        k = self.current
        expected = self.order[k % len(self.order)]
        assert expected == layer, f"streamed layer {layer} out of order (expected {expected})"
        future = self.pending.pop(k)
        if not future.done():
            start = time.perf_counter()
            future.result()
            self.stall_seconds += time.perf_counter() - start
            self.layer_stall[layer] += time.perf_counter() - start
        done = future.result()
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        self.layers[layer].set_weights(self.views[k % self.num_slots][layer])

    def release(self, layer: int) -> None:
        """The layer's compute is issued: its slot may be refilled once it finishes."""
        if layer not in self.position:
            return
        slot = self.current % self.num_slots
        if self.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.compute_done[slot] = event
        self.current += 1
        self._issue()

    def measure_bandwidth(self, repeats: int = 3) -> float:
        """Bytes per second of one layer's copy into a staging slot, measured alone
        (between steps): the transfer rate the decode steps are bound by."""
        for future in self.pending.values():
            future.result()
        layer = max(self.order, key=self.layer_bytes.get)  # the ring restarts afterwards
        scratch, nbytes = self.views[0][layer], self.layer_bytes[layer]
        self._copy(layer, scratch)  # warm: page cache, pinned buffers
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(repeats):
            self._copy(layer, scratch)
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        rate = repeats * nbytes / (time.perf_counter() - start)
        self.num_loads -= repeats + 1
        self.layer_loads[layer] -= repeats + 1
        self.bytes_copied -= (repeats + 1) * nbytes
        self.reset()
        return rate

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def _views(buffer: torch.Tensor, layout: dict[str, tuple[int, Stream]]) -> dict[str, torch.Tensor]:
    """A layer's tensors as views of a slot's bytes (no copy, no allocation per step)."""
    return {name: buffer[offset:offset + stream.nbytes].view(stream.dtype).view(stream.shape)
            for name, (offset, stream) in layout.items()}
