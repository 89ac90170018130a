"""Streaming decoder layers that do not stay on the device.

A ring of `num_slots` device staging slots, each the size of one layer, serves the
streamed layers in order: load k (of an endless sequence over the streamed layers,
step after step) fills slot k % num_slots. Loads run ahead of compute by up to
`num_slots - 1` layers and cross step boundaries, so the first streamed layers of
the next step load while the current step finishes. A slot is refilled only after
the layer computed from it has finished.

Copies run on a background thread, which keeps them off the compute thread: on CPU
the copy itself overlaps compute on the other cores; on CUDA the thread issues
non-blocking copies on a separate stream and records an event that the compute
stream waits on, so the host never blocks on a transfer. Nothing is allocated per
step: the slots are allocated once.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class WeightStreamer:
    def __init__(self, layers, sources: dict[int, dict[str, list[torch.Tensor]]],
                 num_slots: int, device: torch.device, dtype: torch.dtype):
        # sources: layer index -> parameter name ("qkv.weight", as in the architecture's
        # weight map) -> tensors stacked along dim 0 (pinned host or memory-mapped disk).
        self.layers = layers
        self.sources = sources
        self.order = sorted(sources)  # streamed layer indices, in compute order
        self.position = {layer: i for i, layer in enumerate(self.order)}
        self.device = device
        self.num_slots = num_slots
        template = sources[self.order[0]]
        self.slots = [{name: torch.empty((sum(t.shape[0] for t in parts), *parts[0].shape[1:]),
                                         dtype=dtype, device=device)
                       for name, parts in template.items()} for _ in range(num_slots)]
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="fusegen-weights")
        self.bytes_copied = 0
        self.num_loads = 0
        # Seconds compute spent waiting for a copy to finish (CPU: the copies that were
        # not hidden; on CUDA the host never waits on one, so this stays ~0 there).
        self.stall_seconds = 0.0
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

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots[0].values())

    def _issue(self) -> None:
        k = self.next_load
        self.next_load += 1
        layer = self.order[k % len(self.order)]
        self.pending[k] = self.executor.submit(self._load, layer, k % self.num_slots,
                                               self.compute_done[k % self.num_slots])

    def _load(self, layer: int, slot: int, after):
        target = self.slots[slot]
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
        for name, parts in self.sources[layer].items():
            offset = 0
            for part in parts:
                rows = part.shape[0]
                target[name][offset:offset + rows].copy_(part, non_blocking=self.is_cuda)
                offset += rows
        self.bytes_copied += self.slot_bytes
        self.num_loads += 1

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
        done = future.result()
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        self.layers[layer].set_weights(self.slots[k % self.num_slots])

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
        layer, scratch = self.order[0], self.slots[0]  # the ring restarts afterwards
        self._copy(layer, scratch)  # warm: page cache, pinned buffers
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(repeats):
            self._copy(layer, scratch)
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
        rate = repeats * self.slot_bytes / (time.perf_counter() - start)
        self.num_loads -= repeats + 1
        self.bytes_copied -= (repeats + 1) * self.slot_bytes
        self.reset()
        return rate

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
