"""Where each rank of a device group sits and what it runs: pure policy over integers.

A group of tensor_parallel_size T and pipeline_parallel_size P has W = T * P ranks;
rank r is tensor rank r % T of stage r // T. Stages take contiguous runs of layers,
balanced by the layers' bytes as loaded (`layer_stages`); the ranks of a stage split
every layer of it (shard.py): 1-D, or as a Tesseract grid of q x q x d ranks
(tensor_parallel_mode 2d / 2.5d, `check_grid`; tesseract_layers.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fusegen.engine.errors import EngineConfigError


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    tp_rank: int
    pp_rank: int
    tp_size: int
    pp_size: int
    layers: range  # its stage's layers
    device: str  # "cpu" or "cuda:i"
    num_threads: int  # torch threads (on CPUs its share of the cores)
    # the group's peer tier, the same on every rank: (consumer rank, layer, holder rank)
    # for each layer a rank fetches from a peer's memory (peer.assign_holders)
    peer_holders: tuple[tuple[int, int, int], ...] = ()
    # tensor_parallel_mode 2d / 2.5d: the Tesseract grid's depth d (its ranks are
    # the stage's tp_size = q x q x d); 0 in 1-D mode
    grid_depth: int = 0
    # the group's process-group backend (`group_backend`): nccl where every rank has a
    # GPU of its own, gloo on CPUs or where ranks share a GPU
    backend: str = "gloo"
    # the ranks on its device (`ranks_per_device`; 1 on a GPU of its own)
    device_ranks: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def tp_ranks(self) -> list[int]:
        """The global ranks of its stage's tensor-parallel group."""
        first = self.pp_rank * self.tp_size
        return list(range(first, first + self.tp_size))

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.rank - self.tp_size

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.rank + self.tp_size

    @property
    def own_peer_layers(self) -> dict[int, int]:
        """Its layers in the peer tier: layer -> the rank that holds it."""
        return {layer: holder for consumer, layer, holder in self.peer_holders
                if consumer == self.rank}

    @property
    def peer_consumers(self) -> set[int]:
        """The ranks it holds peer-tier layers for."""
        return {consumer for consumer, _, holder in self.peer_holders if holder == self.rank}

    @property
    def replies(self) -> bool:
        """The rank whose results go back to the controller: the last stage's first."""
        return self.is_last_stage and self.tp_rank == 0


def check_parallel(cfg, tp: int, pp: int) -> None:
    """Refuse, before any process starts, a split the model cannot take."""
    for name, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EngineConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if cfg.num_heads % tp:
        raise EngineConfigError(
            f"tensor_parallel_size {tp} does not divide the model's {cfg.num_heads} attention "
            f"heads; use one of {_divisors(cfg.num_heads)}")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise EngineConfigError(
            f"tensor_parallel_size {tp} and the model's {kv} KV heads: one must divide the "
            f"other (KV heads are split, or replicated when there are fewer than ranks); use "
            f"one of {[d for d in _divisors(cfg.num_heads) if kv % d == 0 or d % kv == 0]}")
    sizes = [("intermediate size", cfg.intermediate_size)]
    if cfg.num_experts:
        sizes = [("expert intermediate size", cfg.moe_intermediate_size)]
    for what, size in sizes:
        if size % tp:
            raise EngineConfigError(f"tensor_parallel_size {tp} does not divide the model's "
                                    f"{what} {size}; use one of {_divisors(size)[:8]}")
    if pp > cfg.num_layers:
        raise EngineConfigError(f"pipeline_parallel_size {pp} exceeds the model's "
                                f"{cfg.num_layers} layers; every stage needs at least one")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_layers(layer_bytes: list[int], pp: int, tail: int = 0) -> list[range]:
    """Contiguous stages of at least one layer each, the largest stage's bytes as small
    as possible (a pipeline runs at its slowest stage's pace), counting `tail` bytes on
    the last stage (the LM head it runs); among equal splits, the earlier stages take
    fewer layers."""
    n = len(layer_bytes)
    if not 1 <= pp <= n:
        raise EngineConfigError(f"pipeline_parallel_size {pp}: the model has {n} layers")
    lo, hi = max(max(layer_bytes), tail + layer_bytes[-1]), sum(layer_bytes) + tail
    while lo < hi:  # the least capacity a fill from the back splits into pp stages
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _num_stages(layer_bytes, mid, tail) <= pp else (mid + 1, hi)
    # Fill from the back up to the capacity, keeping a layer for each stage still ahead.
    bounds, end, load = [], n, tail
    for stage in range(pp - 1, 0, -1):
        start = end - 1
        load += layer_bytes[start]
        while start - 1 >= stage and load + layer_bytes[start - 1] <= lo:
            start -= 1
            load += layer_bytes[start]
        bounds.append(range(start, end))
        end, load = start, 0
    bounds.append(range(0, end))
    return bounds[::-1]


def _num_stages(layer_bytes: list[int], capacity: int, tail: int) -> int:
    stages, load, count = 1, tail, 0
    for b in reversed(layer_bytes):
        if load + b > capacity and count:
            stages, load, count = stages + 1, 0, 0
        load += b
        count += 1
    return stages


def layer_stages(layer_bytes: list[int], head_bytes: int, pp: int) -> list[range]:
    """A model's stages, balanced by the weight bytes each stage reads every step: its
    layers' as loaded (`layer_bytes`, one per layer: compressed components where kept,
    so a GGUF file whose layers mix types splits by its bytes, not its parameter counts)
    and, on the last stage, the LM head's. The head runs for the sampled rows only: as
    heavy as its weights in a decode step, light in a prefill step; it counts at half
    its weights (cpu-small's 8 layers and a head of five layers' weights split 5 + 3,
    not 4 + 4 (the last stage then idle-free and the first waiting 28% of the time,
    measured) nor 7 + 1)."""
    return stage_layers(list(layer_bytes), pp, tail=head_bytes // 2)


def model_stages(layer_params: int, num_layers: int, head_params: int,
                 pp: int) -> list[range]:
    """`layer_stages` of a model whose layers all weigh `layer_params` (dense weights,
    counted in parameters) and whose head weighs `head_params`."""
    return layer_stages([layer_params] * num_layers, head_params, pp)


def rank_devices(device: str, world: int, num_visible_gpus: int) -> list[str]:
    """Each rank's device. On CPUs every rank shares the machine (its cores are divided,
    `cpu_threads`); on GPUs "cuda" takes the first W, one per rank, and "cuda:a,b,..."
    names one per rank, a GPU named more than once shared by those ranks (they split its
    memory, `ranks_per_device`, and the group runs over gloo, `group_backend`)."""
    if device == "cpu":
        return ["cpu"] * world
    if device == "cuda":
        if world > num_visible_gpus:
            raise EngineConfigError(
                f"a device group of {world} ranks needs {world} GPUs; this machine shows "
                f"{num_visible_gpus}: lower tensor_parallel_size x pipeline_parallel_size, "
                f"or name a GPU once per rank to share it (\"cuda:{','.join(['0'] * world)}\")")
        return [f"cuda:{i}" for i in range(world)]
    indexes = device.removeprefix("cuda:").split(",")
    if len(indexes) != world:
        raise EngineConfigError(
            f"device {device!r} names {len(indexes)} GPU(s) for a device group of {world} "
            f"ranks; name one per rank (\"cuda:0,1\", or \"cuda:0,0\" for two ranks "
            f"sharing GPU 0) or pass \"cuda\"")
    ids = [int(i) for i in indexes]
    if max(ids) >= num_visible_gpus:
        raise EngineConfigError(f"device {device!r}: the GPUs must be below "
                                f"{num_visible_gpus}, the GPUs this machine shows")
    return [f"cuda:{i}" for i in ids]


def ranks_per_device(devices: list[str]) -> list[int]:
    """Per rank, the ranks on its device: a GPU named for n ranks is n-way shared (each
    plans with 1/n of its memory); CPU ranks count 1 (group_free_memory divides the
    machine's memory among all of them)."""
    counts = Counter(devices)
    return [1 if d == "cpu" else counts[d] for d in devices]


def group_backend(devices: list[str]) -> str:
    """The process-group backend of a group on `devices`: nccl where every rank has a GPU
    of its own; gloo on CPUs, and where ranks share a GPU (NCCL refuses two ranks of one
    communicator on one GPU). Gloo takes CUDA tensors in all-reduce, all-gather and
    broadcast; its point-to-point sends take host tensors only, so the pipeline's
    activations go through the host there (worker.py)."""
    if all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices):
        return "nccl"
    return "gloo"


def cpu_threads(num_cores: int, world: int) -> int:
    """Threads per CPU rank: the cores shared out, at least one each (more ranks than
    cores run oversubscribed, correct but slow)."""
    return max(num_cores // world, 1)


def rank_infos(tp: int, pp: int, stages: list[range], devices: list[str],
               num_cores: int, grid_depth: int = 0) -> list[RankInfo]:
    threads = cpu_threads(num_cores, tp * pp)
    backend, sharing = group_backend(devices), ranks_per_device(devices)
    return [RankInfo(rank=r, tp_rank=r % tp, pp_rank=r // tp, tp_size=tp, pp_size=pp,
                     layers=stages[r // tp], device=devices[r],
                     num_threads=threads if devices[r] == "cpu" else 1,
                     grid_depth=grid_depth, backend=backend, device_ranks=sharing[r])
            for r in range(tp * pp)]


def check_grid(cfg, options, quantization: str) -> int:
    """Refuse, before any process starts, a Tesseract grid (tensor_parallel_mode 2d /
    2.5d) that the ranks, the model or the other options cannot take, naming the
    numbers and the shapes that work; the split the memory plan counts a rank's KV
    heads by: q (its weights, exactly: memory/shape.py's grid_rank_shape). 1-D mode:
    tensor_parallel_size."""
    from fusegen.engine.parallel.tesseract import check_tesseract_shapes, tesseract_grid

    mode, tp = options.tensor_parallel_mode, options.tensor_parallel_size
    if mode == "1d":
        return tp
    what = f"tensor_parallel_mode {mode!r}"
    try:
        grid = tesseract_grid(tp, options.tesseract_depth)
        check_tesseract_shapes(grid, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                               hidden_size=cfg.hidden_size,
                               intermediate_size=None if cfg.num_experts
                               else cfg.intermediate_size,
                               moe_intermediate_size=cfg.moe_intermediate_size
                               if cfg.num_experts else None,
                               batch=options.max_num_seqs)
    except ValueError as exc:
        raise EngineConfigError(f"{what}: {exc}") from None
    refusals = [
        (options.pipeline_parallel_size > 1,
         f"runs with pipeline_parallel_size 1 (got {options.pipeline_parallel_size}): the "
         "grid splits every layer; use tensor_parallel_mode '1d' with stages"),
        (options.peer_memory is not None, "has no peer tier: leave peer_memory unset"),
        (quantization != "dequantize",
         f"runs dense weights only (quantization resolved to {quantization!r}): pass "
         "quantization='dequantize', or use tensor_parallel_mode '1d'"),
    ]
    for refused, why in refusals:
        if refused:
            raise EngineConfigError(f"{what} {why}")
    return grid.q
