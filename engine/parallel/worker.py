"""A rank of a device group: `python -m fusegen.engine.parallel RANK`, started by
group.py with the controller's socket address and key in its environment.

It builds its slice of the model (`ShardRunner`), then serves steps in order: the
controller sends each step's inputs once; the first stage embeds, each stage runs its
layers and sends (x, residual) to the next stage's rank of the same tensor rank, the last
stage runs the head. Plain greedy steps return token ids; the others return the sampled
rows' fp32 logits through shared memory, and the controller samples (request state —
seeds, penalties, grammars — lives there). A stage starts the next step as soon as it has
sent this one on, so with P batches in flight every stage is busy (EnergonAI's
non-blocking pipeline).
"""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import functools
import os
import signal
import sys
import time
import traceback
from collections import Counter
from multiprocessing import resource_tracker
from multiprocessing.connection import Client
from multiprocessing.shared_memory import SharedMemory

import torch
import torch.distributed as dist

from fusegen.engine.parallel.layers import (RowParallelLinear, TPGroup, VocabParallelHead,
                                            parallelize)
from fusegen.engine.memory.offload import PeerPart, Stream
from fusegen.engine.parallel.peer import PeerChannel, served
from fusegen.engine.parallel.plan import RankInfo
from fusegen.engine.parallel.shard import (rank_model_config, shard_fixed_sources,
                                           shard_kept, shard_layer_sources, vocab_range)
from fusegen.engine.model_runner import ModelRunner
from fusegen.engine.runner_api import LOGITS_CHUNK
from fusegen.engine.step_inputs import StepInputs
from fusegen.engine.weights.packed import pack_linear
from fusegen.engine.weights.quantized import split_kept
from fusegen.kernels.argmax import argmax

ADDRESS_ENV, AUTHKEY_ENV = "FUSEGEN_GROUP_ADDRESS", "FUSEGEN_GROUP_AUTHKEY"


class ShardRunner(ModelRunner):
    """One rank's share: its stage's layers, its tensor slice of each, KV blocks of its
    KV heads for its layers, the embedding and head slices of its vocabulary. With a
    peer tier (`peer`), its peer-tier layers stream from the ranks that hold them, and it
    holds and serves other ranks' slices of theirs."""

    def __init__(self, config, info: RankInfo, group: TPGroup, peer: PeerChannel | None = None):
        self.info, self.group, self.peer = info, group, peer
        super().__init__(config)

    @property
    def layer_range(self) -> range:
        return self.info.layers

    def _records_decode_steps(self) -> bool:
        return False  # a rank's layers meet the group's collectives between kernels

    def _model_config(self):
        return rank_model_config(self.config.model_config, self.info.tp_size)

    def _build_model(self, cfg):
        model = self.arch.build_model(cfg)
        full = self.config.model_config
        parallelize(model, self.group, vocab_range(full.vocab_size, self.info.tp_size,
                                                   self.info.tp_rank),
                    self.config.options.tp_overlap_chunks)
        return model

    def _fixed_sources(self, state) -> dict:
        full = self.config.model_config
        return shard_fixed_sources(full, self.arch.fixed_sources(state, full),
                                   self.info.tp_rank, self.info.tp_size)

    def _layer_sources(self, state, index: int) -> dict:
        full = self.config.model_config
        return shard_layer_sources(full, self.arch.layer_sources(state, index, full),
                                   self.info.tp_rank, self.info.tp_size)

    def _layer_parts(self, state, index: int, tp_rank: int | None = None) -> tuple[dict, dict]:
        # which parameters stay compressed is decided over the whole weights (as the
        # plan decided), then both halves are narrowed to the rank's slice (or to
        # `tp_rank`'s: a peer's slice this rank holds)
        full, tp = self.config.model_config, self.info.tp_size
        rank = self.info.tp_rank if tp_rank is None else tp_rank
        sources = self.arch.layer_sources(state, index, full)
        kept, dense = split_kept(sources, self.config.device) if self._keeps_blocks \
            else ({}, sources)
        return (shard_kept(full, kept, rank, tp, index),
                shard_layer_sources(full, dense, rank, tp))

    # -- the peer tier -------------------------------------------------------------

    def _place_layers(self, state) -> None:
        """The rank's layers in their tiers (a peer-tier layer first gets lazy streams
        of its shapes: nothing read), then the peers' slices it holds, served from now
        on, then its own peer-tier layers pointed at their holders."""
        self.memory["peer"] = Counter()
        super()._place_layers(state)
        if self.peer is None:
            return
        for consumer, layer in served(_holders(self.info), self.info.rank):
            kept, dense = self._layer_parts(state, layer, consumer % self.info.tp_size)
            streams = self._streams(dense, kept, "host")  # this runner's own copies
            self.peer.held[(consumer, layer)] = [_whole(streams[name])
                                                 for name in sorted(streams)]
        self.peer.start()
        streamer, own = self.model.streamer, self.info.own_peer_layers
        if own:
            streamer.replace_sources({i: self._peer_streams(i, streamer.sources[i])
                                      for i in own})

    def _peer_streams(self, layer: int, lazy: dict[str, Stream]) -> dict[str, Stream]:
        """Layer `layer`'s streams as parts its holder sends: tensor k of the sorted
        names is request k (the holder keeps them in that order)."""
        return {name: Stream([PeerPart(lazy[name].shape,
                                       functools.partial(self.peer.fetch, layer, k))],
                             lazy[name].dtype)
                for k, name in enumerate(sorted(lazy))}

    def _rank_tiers(self) -> list[str]:
        return [tier for _, tier in zip(self.layer_range, self.plan.layer_tiers)]

    def memory_report(self) -> dict:
        report = super().memory_report()
        if self.info.device_ranks > 1:  # a shared GPU: its budget is this rank's share
            report["device"]["ranks_on_gpu"] = self.info.device_ranks
        if self.peer is not None or self.plan.peer_budget:
            report["layers"]["peer"] = self._rank_tiers().count("peer")
            report["peer"] = {"budget": self.plan.peer_budget,
                              "weights": self.memory["peer"]["weights"],
                              "spare": self.plan.peer_spare,
                              "held": 0 if self.peer is None else self.peer.held_bytes}
        return report

    def stream_stats(self) -> dict[str, dict]:
        """Per tier its streamed layers came from ("peer", "host", "disk"): layers,
        loads, bytes copied and the seconds compute waited for them."""
        streamer, out = self.model.streamer, {}
        if streamer is None:
            return out
        for i, tier in zip(self.layer_range, self.plan.layer_tiers):
            if i in streamer.position:
                row = out.setdefault(tier, {"layers": 0, "loads": 0, "bytes": 0,
                                            "stall_seconds": 0.0})
                row["layers"] += 1
                row["loads"] += streamer.layer_loads[i]
                row["bytes"] += streamer.layer_loads[i] * streamer.layer_bytes[i]
                row["stall_seconds"] += streamer.layer_stall[i]
        return out

    def close(self) -> None:
        super().close()  # the ring's last fetches end first
        if self.peer is not None:
            self.peer.close()

    def _keep_compressed(self, layer, kept: dict, device) -> dict[str, torch.Tensor]:
        # o and down are row-parallel wrappers: their inner Linear is the one kept
        # compressed, under the wrapper's names ("o.blocks" -> layer.o.inner.blocks)
        inner = {p: parts for p, parts in kept.items()
                 if isinstance(layer.get_submodule(p.rpartition(".")[0]), RowParallelLinear)}
        out = super()._keep_compressed(layer, {p: kept[p] for p in kept if p not in inner},
                                       device)
        for param, parts in inner.items():
            owner = param.rpartition(".")[0]
            tensors = super()._keep_compressed(layer.get_submodule(owner),
                                               {"inner.weight": parts}, device)
            out |= {f"{owner}.{name.removeprefix('inner.')}": t for name, t in tensors.items()}
        return out

    def _pack_head(self) -> None:
        head = self.model.lm_head
        if isinstance(head, VocabParallelHead):
            head.inner = pack_linear(head.inner, LOGITS_CHUNK)
        else:
            super()._pack_head()

    @torch.inference_mode()
    def head(self, x, residual, rows: list[int], greedy: bool) -> torch.Tensor | None:
        """The last stage's products for the sampled rows: greedy token ids [N], or the
        fp32 logits [N, V] (on the replying rank; None on the others)."""
        parts = []
        # every rank joins the logits' gather where the head gives no tokens
        for _, tokens, logits in self.head_chunks(x, residual, rows, lambda _: greedy):
            parts.append(tokens if tokens is not None else argmax(logits) if greedy else logits)
        return torch.cat(parts) if parts else None


class Worker:
    def __init__(self, conn, info: RankInfo, runner: ShardRunner, logits: SharedMemory | None,
                 num_slots: int):
        self.conn, self.info, self.runner = conn, info, runner
        self.logits, self.num_slots = logits, num_slots
        self.trace: list[tuple[int, float, float, float]] = []
        self.pipeline_bytes = 0
        self._sending = None  # the last isend to the next stage, waited before the next
        # gloo sends host tensors only: CUDA activations between stages go through the
        # host where the group runs over gloo (ranks sharing a GPU, plan.group_backend)
        self._staged = info.backend == "gloo" and info.device.startswith("cuda")

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except EOFError:  # the controller is gone
                return
            kind = message[0]
            if kind == "stop":
                return
            if kind == "step":
                self.step(*message[1:])
            elif kind == "stats":
                self.conn.send(("stats", self.info.rank, self.trace, self.runner.group.bytes_sent,
                                self.pipeline_bytes))
            elif kind == "overlap":
                self.conn.send(("overlap", self.info.rank, self.runner.group.overlap_stats()))
            elif kind == "grid":
                self.conn.send(("grid", self.info.rank, self.runner.layer_bytes()))
            elif kind == "streams":
                self.conn.send(("streams", self.info.rank, self.runner.stream_stats(),
                                len(self.trace)))

    @torch.inference_mode()
    def step(self, index: int, inputs: StepInputs, greedy: bool,
             groups: list[int] | None = None) -> None:
        runner, info = self.runner, self.info
        if groups is not None:  # a Tesseract grid: each rank its sequence group's share
            start = time.monotonic()
            runner.swap(inputs.swap_out, to_host=True)
            runner.swap(inputs.swap_in, to_host=False)
            out = runner.step(inputs, groups, greedy)
            self.trace.append((index, start, start, time.monotonic()))
            if info.replies:
                self._reply(index, out, greedy)
            return
        if runner.peer is not None and runner.peer.error is not None:
            raise RuntimeError("this rank's peer-tier server failed") from runner.peer.error
        waiting = time.monotonic()
        runner.swap(inputs.swap_out, to_host=True)
        runner.swap(inputs.swap_in, to_host=False)
        hidden = None
        if not info.is_first_stage:
            shape = (2, len(inputs.input_ids), runner.config.model_config.hidden_size)
            received = torch.empty(shape, dtype=runner.dtype,
                                   device="cpu" if self._staged else runner.device)
            dist.recv(received, src=info.prev_rank)
            received = received.to(runner.device)
            hidden = (received[0], received[1])
        start = time.monotonic()
        x, residual = runner.forward(inputs, hidden)
        if not info.is_last_stage:
            if self._sending is not None:
                self._sending.wait()
            payload = torch.stack([x, residual])
            if self._staged:
                payload = payload.cpu()
            self._sending = dist.isend(payload, dst=info.next_rank)
            self._sent = payload  # alive until the send is waited
            self.pipeline_bytes += payload.numel() * payload.element_size()
            self.trace.append((index, waiting, start, time.monotonic()))
        else:
            out = runner.head(x, residual, inputs.sample_rows, greedy)
            # the step ends before its reply: once replied, the next step may start on
            # stage 0 before a later timestamp here
            self.trace.append((index, waiting, start, time.monotonic()))
            if info.replies:
                self._reply(index, out, greedy)

    def _reply(self, index: int, out: torch.Tensor | None, greedy: bool) -> None:
        if out is None:
            self.conn.send(("tokens", index, []))
        elif greedy:
            self.conn.send(("tokens", index, out.tolist()))
        else:  # the slot of this step: the controller reads it before reusing it
            rows, vocab = out.shape
            slot = shared_logits(self.logits, self.num_slots, vocab)[index % self.num_slots]
            slot[:rows].copy_(out)
            self.conn.send(("logits", index, rows))


def _holders(info: RankInfo) -> dict[int, dict[int, int]]:
    """The group's peer holders as assign_holders gives them: consumer -> layer -> holder."""
    out: dict[int, dict[int, int]] = {}
    for consumer, layer, holder in info.peer_holders:
        out.setdefault(consumer, {})[layer] = holder
    return out


def _whole(stream: Stream) -> torch.Tensor:
    """A stream's parts as one contiguous tensor (what one request sends)."""
    parts = [p.contiguous() for p in stream.parts]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def shared_logits(shm: SharedMemory, num_slots: int, vocab: int) -> torch.Tensor:
    """[slots, rows, V] fp32 over the shared buffer (controller and replying rank)."""
    flat = torch.frombuffer(shm.buf, dtype=torch.float32)
    rows = flat.numel() // (num_slots * vocab)
    return flat[:num_slots * rows * vocab].view(num_slots, rows, vocab)


def _attach(name: str) -> SharedMemory:
    shm = SharedMemory(name)
    # The controller made it and removes it; this process only borrows it (otherwise
    # Python's resource tracker would remove it when this rank exits).
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    return shm


def _die_with_parent() -> None:
    """The kernel kills this rank when the thread that started it ends (Linux): the
    controller's engine thread, which closes the group first; so a controller that dies
    leaves no rank behind."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _place(info: RankInfo) -> None:
    if info.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(info.device))
        return
    torch.set_num_threads(info.num_threads)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= info.num_threads * info.world_size:  # disjoint cores per rank
        os.sched_setaffinity(0, cores[info.rank * info.num_threads:
                                      (info.rank + 1) * info.num_threads])


def _join_group(info: RankInfo, port: int, timeout: int) -> tuple[TPGroup, object]:
    """The rank's tensor-parallel group (on a Tesseract grid: its depth layer's, which
    splits the vocabulary) and its grid's groups (None in 1-D mode)."""
    dist.init_process_group(info.backend, init_method=f"tcp://127.0.0.1:{port}",
                            world_size=info.world_size, rank=info.rank,
                            timeout=datetime.timedelta(seconds=timeout))
    mine = None
    for stage in range(info.pp_size):  # every rank creates every group, in one order
        ranks = list(range(stage * info.tp_size, (stage + 1) * info.tp_size))
        group = dist.new_group(ranks) if info.tp_size > 1 else None
        if stage == info.pp_rank:
            mine = group
    if not info.grid_depth:
        return TPGroup(mine, info.tp_size, info.tp_rank), None
    from fusegen.engine.parallel.tesseract import TesseractGroups

    grid = TesseractGroups(info.grid_depth)
    q = grid.grid.q
    return TPGroup(grid.layer, q * q, grid.i * q + grid.j), grid


def main(rank: int, grid_runner=None) -> None:
    """Serve as rank `rank`; `grid_runner`: the runner class of a Tesseract grid's ranks
    (tesseract_layers.GridShardRunner, passed in by __main__: it builds on ShardRunner)."""
    _die_with_parent()
    conn = Client(os.environ[ADDRESS_ENV], authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    conn.send(("hello", rank, os.getpid()))
    try:
        _, config, info, port, shm_name, num_slots, timeout = conn.recv()
        _place(info)
        group, grid = _join_group(info, port, timeout)
        peer = PeerChannel.join(info.world_size, info.own_peer_layers, info.peer_consumers) \
            if info.peer_holders else None
        config = dataclasses.replace(config, device=info.device)
        runner = ShardRunner(config, info, group, peer) if grid is None else \
            grid_runner(config, info, group, grid)
        shm = _attach(shm_name) if info.replies and shm_name else None
        conn.send(("ready", rank, runner.memory_report()))
        Worker(conn, info, runner, shm, num_slots).serve()
        runner.close()
    except Exception:  # noqa: BLE001 - the controller reports it; this process ends
        try:
            conn.send(("error", rank, traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

