"""Where the weights and the KV cache live: a plan over sizes, made before the first
step. Plain Python over byte counts, so every decision is unit-tested without tensors.

Tiers, fastest first: `device` (the GPU; the CPU itself on a CPU-only machine),
`peer` (a device group's other ranks' spare memory: engine/parallel/peer.py), `host`
(pinned host memory), `disk` (the checkpoint's safetensors, memory-mapped).

The device budget is spent in this order:
1. what every step needs: the embedding, the final norm and the LM head, and a
   reserve for activations;
2. the KV floor: enough blocks for one request at full context (`min_kv_blocks`), so
   any single request can always run; with cooperative KV placement only the device's
   share of one request (`device_kv_floor`: its smallest quota, one block), the rest of
   it lying in the host pool (engine/memory/kv_split.py);
3. decoder layers, first to last, while they fit; once one does not, the rest are
   streamed, and `prefetch_depth + 1` staging slots of one layer each are reserved
   so that copies run ahead of compute;
4. when layers stream, `kv_reserve` bytes (the engine's `kv_cache_memory`), or by
   default `kv_spill_fraction` of the room left after steps 1-2, are kept for KV
   blocks before layers are placed: every step pays the streamed weights' transfer,
   so a large running batch (many KV blocks) is what makes it worth it;
5. whatever is left becomes more KV blocks.
Streamed layers live in peers' memory while the peer budget allows (a device group's
ranks lend each other what their own budgets leave free), then in host memory while the
host budget allows, then on disk. The host budget left after weights holds the host KV
pool that preempted requests swap to.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, available: int | None = None, name: str = "memory") -> int:
    """Bytes from an int, a string like "24GiB" / "512MB", or a fraction in (0, 1]
    of `available` (free memory)."""
    value = _number(value, name)
    if isinstance(value, float) and 0 < value <= 1:
        if available is None:
            raise ValueError(f"{name}: a fraction needs the free memory to be known")
        return int(value * available)
    if isinstance(value, (int, float)) and (value >= 1 or value == 0):
        return int(value)  # 0: no memory in this tier
    raise ValueError(f"{name}: must be bytes (0 or more), a size like '24GiB' or a fraction "
                     f"in (0, 1]; got {value!r}")


def is_fraction(value) -> bool:
    """Whether a budget (in parse_bytes' forms) is a fraction of the free memory rather
    than a size: 0.9 and "0.9" are, 1, "1" and "1GiB" are not."""
    try:
        number = _number(value, "memory")
    except ValueError:
        return False
    return isinstance(number, float) and 0 < number <= 1


def _number(value, name: str):
    """`value` with a string read: its bytes (an int), or a fraction as a float."""
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected bytes, a size like '24GiB' or a fraction, got {value!r}")
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace(" ", "")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"{name}: cannot read {value!r}; write bytes, a size like "
                         "'24GiB' or '512MB', or a fraction like 0.8")
    number, unit = float(match.group(1)), match.group(2)
    if unit == "" and "." in text:
        if number > 1:
            raise ValueError(f"{name}: {value!r} is neither whole bytes nor a fraction "
                             "in (0, 1]; add a unit, like '1.5GiB'")
        return number  # "0.8" is a fraction of what is free
    return int(number * _UNITS[unit])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass(slots=True)
class ModelSizes:
    layer_bytes: int  # one decoder layer's weights (all layers have the same shape)
    num_layers: int
    fixed_bytes: int  # embedding + final norm + LM head: needed by every step
    kv_block_bytes: int  # one KV block across all layers
    min_kv_blocks: int  # one request at full context
    activation_bytes: int  # reserve for one step's activations and logits
    # a compressed model's (quantized linears kept as their codes: layer_bytes counts
    # those) layer as dense weights would be, for the table; None when not compressed
    dense_layer_bytes: int | None = None
    # the device KV blocks one request needs when they are not min_kv_blocks: with
    # cooperative placement its device quota, whose smallest is one block
    device_kv_floor: int | None = None

    @property
    def kv_floor_blocks(self) -> int:
        """The device KV blocks the plan keeps whatever else it places."""
        return self.min_kv_blocks if self.device_kv_floor is None else self.device_kv_floor

    def kv_floor_text(self) -> str:
        what = ("one request's device quota (cooperative KV placement)"
                if self.device_kv_floor is not None else "one full-context request")
        return f"{self.kv_floor_blocks} KV blocks for {what}"


@dataclass(slots=True)
class PlacementPlan:
    layer_tiers: list[str]  # per layer: "device", "peer", "host" or "disk"
    num_staging_slots: int  # device buffers of one layer each, for streamed layers
    num_device_kv_blocks: int
    num_host_kv_blocks: int
    device_budget: int
    host_budget: int
    sizes: ModelSizes
    device_bytes: dict[str, int] = field(default_factory=dict)  # planned, by use
    host_bytes: dict[str, int] = field(default_factory=dict)
    peer_budget: int = 0  # bytes of this rank's layers its peers may hold
    # bytes each rank may hold for its peers: its free memory less its own budget
    # (0 alone, where there is no peer)
    peer_spare: int = 0

    @property
    def peer_bytes(self) -> int:
        """This rank's layers placed in its peers' memory."""
        return self.layer_tiers.count("peer") * self.sizes.layer_bytes

    @property
    def streamed_layers(self) -> list[int]:
        return [i for i, tier in enumerate(self.layer_tiers) if tier != "device"]

    @property
    def offload_fraction(self) -> float:
        return len(self.streamed_layers) / max(len(self.layer_tiers), 1)

    def table(self) -> str:
        """The short start-up table `fusegen run` prints."""
        counts = {t: self.layer_tiers.count(t) for t in ("device", "peer", "host", "disk")}
        s = self.sizes
        rows = [
            ("tier", "budget", "weights", "KV cache", "other"),
            ("device", format_bytes(self.device_budget),
             f"{counts['device']} layers + embed/head",
             f"{self.num_device_kv_blocks} blocks",
             f"{self.num_staging_slots} staging slots"),
            ("peer", format_bytes(self.peer_budget), f"{counts['peer']} layers", "",
             f"{format_bytes(self.peer_spare)} spare a rank"),
            ("host", format_bytes(self.host_budget), f"{counts['host']} layers",
             f"{self.num_host_kv_blocks} blocks (swap)", ""),
            ("disk", "-", f"{counts['disk']} layers (mmap)", "", ""),
        ]
        if not (self.peer_budget or self.peer_spare):  # alone: no peer to lend memory
            rows.pop(2)
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        compressed = ("" if s.dense_layer_bytes is None else
                      f", compressed ({format_bytes(s.dense_layer_bytes)} a layer dense)")
        lines.append(f"layer {format_bytes(s.layer_bytes)}, KV block "
                     f"{format_bytes(s.kv_block_bytes)}, streamed "
                     f"{len(self.streamed_layers)}/{s.num_layers} layers{compressed}")
        return "\n".join(lines)


class BudgetTooSmall(ValueError):
    pass


def minimum_device_budget(sizes: ModelSizes, prefetch_depth: int = 1) -> int:
    """The smallest device budget that runs: every layer streamed through the
    staging slots, and the KV floor."""
    return (sizes.fixed_bytes + sizes.activation_bytes
            + sizes.kv_floor_blocks * sizes.kv_block_bytes
            + min(prefetch_depth + 1, sizes.num_layers) * sizes.layer_bytes)


def plan_placement(sizes: ModelSizes, device_budget: int, host_budget: int,
                   prefetch_depth: int = 1, kv_spill_fraction: float = 0.25,
                   kv_reserve: int | None = None, max_kv_blocks: int | None = None,
                   max_host_kv_blocks: int | None = None, peer_budget: int = 0,
                   peer_spare: int = 0) -> PlacementPlan:
    """`peer_budget`: bytes of streamed layers the peers may hold (a device group's; 0
    alone); `peer_spare`: what each rank may hold for its peers (recorded for the
    table and the holders' assignment, `engine/parallel/peer.py`)."""
    s = sizes
    floor = minimum_device_budget(sizes, prefetch_depth)
    if device_budget < floor:
        raise BudgetTooSmall(
            f"device_memory {format_bytes(device_budget)} is too small to run this model: the "
            f"smallest budget that works is {format_bytes(floor)} (embeddings and head "
            f"{format_bytes(s.fixed_bytes)}, activations {format_bytes(s.activation_bytes)}, "
            f"{s.kv_floor_text()} {format_bytes(s.kv_floor_blocks * s.kv_block_bytes)}, and "
            f"{min(prefetch_depth + 1, s.num_layers)} streamed layers of "
            f"{format_bytes(s.layer_bytes)})")
    kv_floor = s.kv_floor_blocks * s.kv_block_bytes
    free = device_budget - s.fixed_bytes - s.activation_bytes - kv_floor
    # An asked-for KV share comes first; by default layers do, and KV gets the rest.
    kv_asked = 0 if kv_reserve is None else max(0, min(
        -(-kv_reserve // s.kv_block_bytes) * s.kv_block_bytes - kv_floor, free))  # whole blocks
    if s.num_layers * s.layer_bytes + kv_asked <= free:
        num_resident, slots = s.num_layers, 0
    else:
        slots = min(prefetch_depth + 1, s.num_layers)
        kv_share = int(kv_spill_fraction * free) if kv_reserve is None else kv_asked
        room = free - slots * s.layer_bytes - kv_share
        num_resident = max(0, min(s.num_layers - 1, room // s.layer_bytes))
    tiers = ["device"] * num_resident
    host_left, peer_left = host_budget, peer_budget
    for _ in range(s.num_layers - num_resident):
        if peer_left >= s.layer_bytes:
            tiers.append("peer")
            peer_left -= s.layer_bytes
        elif host_left >= s.layer_bytes:
            tiers.append("host")
            host_left -= s.layer_bytes
        else:
            tiers.append("disk")
    used = (s.fixed_bytes + s.activation_bytes + num_resident * s.layer_bytes
            + slots * s.layer_bytes)
    kv_blocks = (device_budget - used) // s.kv_block_bytes
    host_kv_blocks = host_left // s.kv_block_bytes
    if max_kv_blocks is not None:
        kv_blocks = max(s.kv_floor_blocks, min(kv_blocks, max_kv_blocks))
    host_cap = max_kv_blocks if max_host_kv_blocks is None else max_host_kv_blocks
    if host_cap is not None:
        host_kv_blocks = min(host_kv_blocks, host_cap)
    plan = PlacementPlan(tiers, slots, kv_blocks, host_kv_blocks, device_budget, host_budget, s,
                         peer_budget=peer_budget, peer_spare=peer_spare)
    plan.device_bytes = {
        "weights": s.fixed_bytes + num_resident * s.layer_bytes,
        "staging": slots * s.layer_bytes,
        "kv_cache": kv_blocks * s.kv_block_bytes,
        "activations": s.activation_bytes,
    }
    plan.host_bytes = {
        "weights": tiers.count("host") * s.layer_bytes,
        "kv_cache": host_kv_blocks * s.kv_block_bytes,
    }
    return plan


def budget_for_resident_layers(sizes: ModelSizes, num_resident: int, prefetch_depth: int = 1,
                               **plan_options) -> int:
    """The smallest device budget whose plan streams layers and keeps `num_resident`
    on the device (benchmarks and tests state budgets this way: "a quarter of the
    layers"). Among streaming plans the resident count grows with the budget; when
    even the largest streaming budget keeps fewer (the KV share takes the room), that
    budget is returned."""
    s = sizes
    # An asked-for KV share beyond the floor raises both ends: the smallest budget
    # that runs with it, and one byte less than holding every layer beside it (the
    # largest budget that still streams).
    kv_extra = max(0, (plan_options.get("kv_reserve") or 0) - s.kv_floor_blocks * s.kv_block_bytes)
    low = minimum_device_budget(sizes, prefetch_depth) + kv_extra
    high = s.fixed_bytes + s.activation_bytes + s.kv_floor_blocks * s.kv_block_bytes \
        + kv_extra + s.num_layers * s.layer_bytes - 1

    def resident(budget: int) -> int:
        plan = plan_placement(sizes, budget, 0, prefetch_depth, **plan_options)
        return plan.layer_tiers.count("device")

    if high < low or resident(high) < num_resident:
        return max(low, high)
    while low < high:
        mid = (low + high) // 2
        if resident(mid) >= num_resident:
            high = mid
        else:
            low = mid + 1
    return low
