"""The peer tier of a device group (EnergonAI's peer memory pool): layers a rank cannot
hold in its own budget live in another rank's spare memory and are fetched into the
rank's staging slots ahead of use, like host-streamed layers.

Policy, plain Python over integers: `assign_holders` picks, for every rank's peer-tier
layer, the rank that holds it. Mechanism: `PeerChannel`, one per rank over a gloo process
group of its own (apart from the tensor- and pipeline-parallel traffic). A consumer's
staging ring (engine/memory/offload.py) fetches each tensor of a peer layer with a small
request and a receive posted into the slot; a holder answers requests on a helper thread,
so serving never blocks its own compute. The ring issues loads one layer (or
`prefetch_depth` layers) ahead, so a fetch overlaps the compute of the layer before.

CUDA device groups (one machine, NCCL): the holder keeps the layers in its GPU's spare
memory and the payload travels GPU to GPU (NCCL picks NVLink or PCIe peer-to-peer), into
the consumer's staging slot on the ring's copy stream. NCCL has neither tags nor
receives from any rank, and a communicator must not be driven by two threads at once; so
requests still go over the gloo group, and each (holder, consumer) pair of the group's
peer tier gets a payload communicator of its own, used only by the holder's serving
thread (sends) and the consumer's copy thread (receives). NCCL matches a pair's
messages in order, which holds: a consumer's fetches from one holder are issued in order
on one thread and its requests, arriving in that order, are answered in it.
"""
from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.placement import format_bytes

REQUEST_TAG = 1  # requests: [layer, tensor index, reply tag]; replies use tags from 2 on
_DONE = -1  # a request's layer when its consumer has no more fetches
# A holder waits for requests as long as the engine lives (an idle engine sends none):
# a rank that dies is found by the controller, which stops the group.
_IDLE_TIMEOUT = datetime.timedelta(days=365)


def assign_holders(demand: dict[int, list[tuple[int, int]]],
                   spare: dict[int, int]) -> dict[int, dict[int, int]]:
    """Which rank holds each peer-tier layer. `demand`: per rank, its peer-tier layers as
    (layer, bytes) in compute order; `spare`: per rank, the bytes it may hold for the
    others. Returns per rank {layer: holder}. Each layer goes to the other rank with the
    most spare bytes left (ties: the nearest rank after it, wrapping), so the ranks' loads
    stay even; ranks are served in order. EngineConfigError, naming the rank, the layer
    and every peer's spare left, when no peer can hold a layer."""
    left = dict(spare)
    world = len(spare)
    holders: dict[int, dict[int, int]] = {}
    for rank in sorted(demand):
        holders[rank] = {}
        for layer, nbytes in demand[rank]:
            peers = [h for h in left if h != rank and left[h] >= nbytes]
            if not peers:
                others = ", ".join(f"rank {h}: {format_bytes(left[h])}"
                                   for h in sorted(left) if h != rank)
                raise EngineConfigError(
                    f"peer_memory: no peer of rank {rank} can hold its layer {layer} "
                    f"({format_bytes(nbytes)}); spare memory left ({others}); lower "
                    "peer_memory or device_memory")
            holder = max(peers, key=lambda h: (left[h], -((h - rank) % world)))
            holders[rank][layer] = holder
            left[holder] -= nbytes
    return holders


def group_holders(infos, layer_tiers: list[str], layer_bytes: int,
                  spare: int) -> tuple[tuple[int, int, int], ...]:
    """A group's peer tier as (consumer rank, layer, holder rank) triples: each rank's
    stage layers whose planned tier (by position in the stage, as the rank places
    them) is "peer", each `layer_bytes`, held by peers of `spare` bytes each."""
    demand = {info.rank: [(layer, layer_bytes) for layer, tier in zip(info.layers, layer_tiers)
                          if tier == "peer"] for info in infos}
    holders = assign_holders(demand, {info.rank: spare for info in infos})
    return tuple((consumer, layer, holder) for consumer in sorted(holders)
                 for layer, holder in holders[consumer].items())


def payload_pairs(every: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The group's (holder, consumer) pairs from each rank's own (what every rank
    gathered), sorted: the order every rank creates their communicators in."""
    return sorted({tuple(pair) for pairs in every for pair in pairs})


def served(holders: dict[int, dict[int, int]], rank: int) -> list[tuple[int, int]]:
    """The (consumer rank, layer) pairs `rank` holds, in consumer and layer order."""
    return [(consumer, layer) for consumer in sorted(holders)
            for layer, holder in sorted(holders[consumer].items()) if holder == rank]


class PeerChannel:
    """One rank's end of the peer tier: it fetches its own peer layers' tensors from
    their holders (`fetch`, called on the staging ring's copy thread) and serves the
    tensors it holds for others (`serve`, on a helper thread)."""

    def __init__(self, group, holders: dict[int, int], consumers: set[int],
                 payload_groups: dict[tuple[int, int], object] | None = None,
                 device: torch.device | None = None):
        self.group = group
        self.holders = holders  # own peer layer -> its holder's rank
        self.consumers = consumers  # ranks this one holds layers for
        # (holder, consumer) -> the pair's payload communicator (None: payloads go over
        # `group` with a tag per fetch)
        self.payload_groups = payload_groups or {}
        self.device = device  # where held tensors live (None: host memory)
        # (consumer, layer) -> the tensors held for it, by the index of their names
        self.held: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.bytes_fetched = 0
        self.bytes_served = 0
        self._tag = 1
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @classmethod
    def join(cls, world: int, holders: dict[int, int], consumers: set[int],
             payload_backend: str | None = None) -> "PeerChannel":
        """Every rank calls this at the same point (dist.new_group is collective).
        `payload_backend`: the pairs' payload communicators' ("nccl", or "gloo" to test
        the same logic on CPUs); by default "nccl" in a group whose default backend is
        NCCL (a CUDA device group), else none."""
        group = dist.new_group(list(range(world)), backend="gloo", timeout=_IDLE_TIMEOUT)
        if payload_backend is None and dist.get_backend() == "nccl":
            payload_backend = "nccl"
        if payload_backend is None:
            return cls(group, holders, consumers)
        rank = dist.get_rank()
        mine = sorted({(holder, rank) for holder in holders.values()})
        every: list = [None] * world
        dist.all_gather_object(every, mine, group=group)
        payload = {}
        for holder, consumer in payload_pairs(every):  # the same order on every rank
            pair_group = dist.new_group(sorted((holder, consumer)), backend=payload_backend,
                                        timeout=_IDLE_TIMEOUT)
            if rank in (holder, consumer):
                payload[(holder, consumer)] = pair_group
        device = (torch.device("cuda", torch.cuda.current_device())
                  if payload_backend == "nccl" else None)
        return cls(group, holders, consumers, payload, device)

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.held.values() for t in ts)

    def fetch(self, layer: int, index: int, target: torch.Tensor):
        """Start filling `target` (contiguous) with tensor `index` of this rank's `layer`
        from its holder: a request, and a receive straight into the staging slot. Returns
        the wait for it, so a layer's tensors are all asked for before any is waited on."""
        holder = self.holders[layer]
        self._tag = self._tag % (1 << 30) + 1
        tag = self._tag + 1  # never REQUEST_TAG
        request = torch.tensor([layer, index, tag], dtype=torch.int64)
        sending = dist.isend(request, holder, group=self.group, tag=REQUEST_TAG)
        pair = self.payload_groups.get((holder, dist.get_rank()))
        receiving = dist.irecv(target.view(torch.uint8).view(-1), holder,
                               **({"group": self.group, "tag": tag} if pair is None
                                  else {"group": pair}))
        return lambda: self._finish(sending, receiving, target)

    def _finish(self, sending, receiving, target: torch.Tensor) -> None:
        sending.wait()
        receiving.wait()
        self.bytes_fetched += target.numel() * target.element_size()

    def start(self) -> None:
        """Serve the held tensors on a helper thread until every consumer is done (from
        the device's memory where the payloads travel device to device)."""
        if self.device is not None:
            self.held = {key: [t.to(self.device) for t in tensors]
                         for key, tensors in self.held.items()}
        if self.consumers:
            self._thread = threading.Thread(target=self._serve, name="fusegen-peer",
                                            daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        done = set()
        if self.device is not None:
            torch.cuda.set_device(self.device)
        rank = dist.get_rank()
        try:
            while done != self.consumers:
                request = torch.empty(3, dtype=torch.int64)
                source = dist.recv(request, group=self.group, tag=REQUEST_TAG)  # any rank
                layer, index, tag = request.tolist()
                if layer == _DONE:
                    done.add(source)
                    continue
                tensor = self.held[(source, layer)][index]
                pair = self.payload_groups.get((rank, source))
                dist.isend(tensor.view(torch.uint8).view(-1), source,
                           **({"group": self.group, "tag": tag} if pair is None
                              else {"group": pair})).wait()
                self.bytes_served += tensor.numel() * tensor.element_size()
        except BaseException as exc:  # noqa: BLE001 - the rank's next step reports it
            self.error = exc

    def close(self, timeout: float = 30.0) -> None:
        """After this rank's last fetch: tell its holders, and wait until its own
        consumers have told it the same."""
        for holder in sorted(set(self.holders.values())):
            dist.send(torch.tensor([_DONE, 0, 0], dtype=torch.int64), holder,
                      group=self.group, tag=REQUEST_TAG)
        if self._thread is not None:
            self._thread.join(timeout)
