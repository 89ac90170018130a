"""Options -> the engine's batch limits and memory placement, in one pure function.

`plan_engine(options, shape, free)` is plain arithmetic over the user's options, the
model's sizes (`ModelShape`, made by shape.py) and the memory the machine has free
(`FreeMemory`, measured by device.py); the engine freezes what comes back (config.py
gathers the inputs). Both input types are declared here as plain data: the plan is
unit-tested over made-up sizes without a model or a machine. Nothing is set twice:
a plan that streams layers and leaves the batch limits to fusegen is planned again with
larger limits, and the result is whichever of the two fits.
"""
from __future__ import annotations

from dataclasses import dataclass

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.placement import (BudgetTooSmall, ModelSizes, PlacementPlan,
                                             format_bytes, is_fraction, parse_bytes,
                                             plan_placement)
from fusegen.engine.runner_api import LOGITS_CHUNK

_CPU_KV_FRACTION = 0.3  # of available host memory for KV, when no budget is given
_GPU_FREE_FRACTION = 0.9  # of free device memory, when no device budget is given
_HOST_FRACTION = 0.5  # of available host memory for the host tier, when not given


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the plan needs of a model, counted in parameters (no tensors)."""
    num_layers: int
    layer_params: int  # one decoder layer's weights (every layer has the same shape)
    fixed_params: int  # embedding, final norm, LM head: needed by every step
    kv_width: int  # keys + values per token per layer: 2 * kv_heads * head_dim
    activation_width: int  # fp32 values per token alive at once inside a layer
    vocab_size: int
    max_position_embeddings: int
    dtype_bytes: int  # of the run's dtype
    # one layer's weight bytes when they are not layer_params * dtype_bytes: linears
    # kept compressed (GGUF blocks, int8 / int4 groups: their components; the largest
    # layer's, where types differ between layers; a tensor-parallel rank's slice)
    layer_bytes: int | None = None
    # the embedding, final norm and head's bytes when they are not fixed_params *
    # dtype_bytes: a GGUF file's embedding / head kept as its blocks on CPUs
    fixed_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class FreeMemory:
    device: int  # bytes free on the device tier (the CPU's available memory on CPUs)
    host: int  # bytes of available host memory
    on_gpu: bool
    # ranks of a device group that share one GPU (the most on any of its GPUs): `device`
    # is then one rank's share of the GPU's free memory, and a device_memory in bytes
    # (the GPU's budget) is split among them
    shared_by: int = 1


@dataclass(frozen=True, slots=True)
class EnginePlan:
    placement: PlacementPlan
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


def plan_engine(options, shape: ModelShape, free: FreeMemory) -> EnginePlan:
    """`options`: an EngineOptions. Raises EngineConfigError naming the broken limit."""
    max_model_len = options.max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise EngineConfigError(f"max_model_len {max_model_len} exceeds the model's "
                                f"max_position_embeddings {shape.max_position_embeddings}")
    limits = batch_limits(options, free.on_gpu, streaming=False)
    try:
        placement = _place(options, shape, free, limits, max_model_len)
    except BudgetTooSmall as exc:
        raise EngineConfigError(str(exc)) from None
    if placement.streamed_layers and None in (options.max_num_seqs,
                                              options.max_num_batched_tokens):
        # Streaming: every step pays the streamed weights' transfer, so larger default
        # batches amortise it (FlexGen's lesson). Their activation reserve is larger
        # too; keep the first plan when the second no longer fits.
        larger = batch_limits(options, free.on_gpu, streaming=True)
        try:
            placement, limits = _place(options, shape, free, larger, max_model_len), larger
        except BudgetTooSmall:
            pass
    _check_fits(options, placement, free)
    return EnginePlan(placement, *limits, max_model_len)


def batch_limits(options, on_gpu: bool, streaming: bool) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): the user's, or the defaults."""
    scale = 4 if streaming else 1
    max_num_seqs = options.max_num_seqs or 256 * scale
    # A CPU is compute-bound from a few hundred tokens per step on, so a bigger step
    # buys no speed of its own; but 4096 tokens (vLLM's CPU default too) take a batch's
    # prompts in half the steps of 2048, so its longest requests start decoding sooner
    # and the last steps, with few rows left, are fewer: about 2% off cpu-small through
    # `LLM.generate` (docs/performance.md). It also holds a decode step of every running
    # request.
    tokens = options.max_num_batched_tokens or (
        8192 * scale if on_gpu else max(4096, max_num_seqs))
    return max_num_seqs, tokens


def model_sizes(options, shape: ModelShape, limits: tuple[int, int],
                max_model_len: int) -> ModelSizes:
    """The byte sizes the placement works over, for these batch limits."""
    elem = shape.dtype_bytes
    max_num_seqs, max_num_batched_tokens = limits
    return ModelSizes(
        layer_bytes=(shape.layer_params * elem if shape.layer_bytes is None
                     else shape.layer_bytes), num_layers=shape.num_layers,
        fixed_bytes=(shape.fixed_params * elem if shape.fixed_bytes is None
                     else shape.fixed_bytes),
        kv_block_bytes=shape.num_layers * options.block_size * shape.kv_width * elem,
        min_kv_blocks=-(-max_model_len // options.block_size),
        activation_bytes=activation_bytes(shape, max_num_batched_tokens, max_num_seqs),
        dense_layer_bytes=None if shape.layer_bytes is None else shape.layer_params * elem,
        # asked-for cooperative placement keeps of a request only its quota on the
        # device (at least one block); the rest is the host pool's (kv_split.py)
        device_kv_floor=1 if options.kv_placement == "cooperative" else None)


def activation_bytes(shape: ModelShape, num_tokens: int, num_sampled: int) -> int:
    """A step's transient tensors: per token the activation width (fp32 at most), and
    per sampled row (at most the runner's LOGITS_CHUNK at a time) the logits and the
    sampler's two working copies."""
    return (num_tokens * shape.activation_width * 4
            + min(num_sampled, LOGITS_CHUNK) * shape.vocab_size * 4 * 3)


def _place(options, shape: ModelShape, free: FreeMemory, limits: tuple[int, int],
           max_model_len: int) -> PlacementPlan:
    sizes = model_sizes(options, shape, limits, max_model_len)
    if options.device_memory is not None:
        # a GPU's budget: the ranks sharing it take 1/n each (a fraction is of the
        # whole GPU's free memory, so the same fraction of each rank's share)
        whole = None if free.device is None else free.device * free.shared_by
        budget = _bytes(options.device_memory, whole, "device_memory") // free.shared_by
    else:
        # No limit: all weights on the device; KV gets its own budget.
        weights = sizes.fixed_bytes + sizes.num_layers * sizes.layer_bytes
        if options.kv_cache_memory is not None:
            kv = options.kv_cache_memory
        elif options.num_kv_blocks is not None:
            kv = options.num_kv_blocks * sizes.kv_block_bytes
        elif free.on_gpu:
            kv = int(free.device * _GPU_FREE_FRACTION) - weights - sizes.activation_bytes
        else:
            kv = int(free.device * _CPU_KV_FRACTION)
        kv = max(kv, sizes.kv_floor_blocks * sizes.kv_block_bytes)
        budget = weights + sizes.activation_bytes + kv
    if options.host_memory is not None:
        host = _bytes(options.host_memory, free.host, "host_memory")
    elif free.on_gpu or options.device_memory is not None:
        host = int(free.host * _HOST_FRACTION)
    else:
        # CPU with no device limit: nothing to spill to unasked, and the host KV blocks
        # asked for (num_host_kv_blocks) exactly: every layer stays on the device
        host = (options.num_host_kv_blocks or 0) * sizes.kv_block_bytes
    ceiling = limits[0] * sizes.min_kv_blocks  # every request at max_model_len
    max_kv_blocks = options.num_kv_blocks or ceiling
    # A fraction of a CPU's memory bounds the pool; it is not a share to fill (below).
    cpu_fraction = not free.on_gpu and is_fraction(options.device_memory)
    if cpu_fraction and options.num_kv_blocks is None:
        max_kv_blocks = min(ceiling, _cpu_kv_bytes(options, free) // sizes.kv_block_bytes)
    host_cap = ceiling if options.num_host_kv_blocks is None else options.num_host_kv_blocks
    if cpu_fraction and options.host_memory is None and options.num_host_kv_blocks is None:
        host_cap = 0
    # Under a device budget, kv_cache_memory is the KV share kept before layers are
    # placed (the plan's default share otherwise).
    kv_reserve = options.kv_cache_memory if options.device_memory is not None else None
    peer, spare = _peer_budget(options, free, budget)
    plan = plan_placement(sizes, budget, host, options.prefetch_depth, kv_reserve=kv_reserve,
                          max_kv_blocks=max_kv_blocks, max_host_kv_blocks=host_cap,
                          peer_budget=peer, peer_spare=spare)
    if options.host_memory is None and options.num_host_kv_blocks is None \
            and options.kv_placement != "cooperative":
        # Unasked-for swap space: as much as the device pool, no more (pinned memory is
        # slow to allocate and taken from everyone else). Cooperative placement's host
        # pool is no swap space but the running batch's KV: its cap is the batch's.
        plan.num_host_kv_blocks = min(plan.num_host_kv_blocks, plan.num_device_kv_blocks)
        plan.host_bytes["kv_cache"] = plan.num_host_kv_blocks * sizes.kv_block_bytes
    return plan


def _peer_budget(options, free: FreeMemory, device_budget: int) -> tuple[int, int]:
    """(the peer tier's budget, what each rank may hold for its peers). A rank's spare
    memory is what its device has free beyond its own budget; every rank of a group
    runs the same plan, so each lends as much as it borrows, and a peer budget above one
    rank's spare cannot be held."""
    world = options.tensor_parallel_size * options.pipeline_parallel_size
    if world == 1:
        return 0, 0  # EngineOptions refuses a peer budget alone
    spare = max(free.device - device_budget, 0)
    if options.peer_memory is None:
        return 0, spare
    peer = _bytes(options.peer_memory, free.device, "peer_memory")
    if peer > spare:
        raise EngineConfigError(
            f"peer_memory {format_bytes(peer)} is larger than the peers' free memory: each "
            f"of the group's {world} ranks has {format_bytes(free.device)} free and plans "
            f"{format_bytes(device_budget)} for itself (device_memory), leaving "
            f"{format_bytes(spare)} to hold its peers' layers; each rank lends as much as it "
            f"borrows, so peer_memory may be at most {format_bytes(spare)}: lower "
            "peer_memory or device_memory")
    return peer, spare


def _check_fits(options, plan: PlacementPlan, free: FreeMemory) -> None:
    """Refuse a plan whose asked-for sizes (KV blocks, batch limits) need more memory than
    the tier has, naming the option, its bytes and the bytes there are: nothing has been
    allocated yet, and a device group has started no rank. Without this the allocator
    (or oneDNN, for a step's activations) fails later with a message naming no option.
    A plan over the limit through no option's doing (a model larger than memory, which
    mmap'ed weights may still run) is left as it was."""
    device = sum(plan.device_bytes.values())
    host = sum(plan.host_bytes.values())
    # On a CPU the device tier and the host tier are the same memory.
    tiers = ([("the GPU", device, free.device), ("host memory", host, free.host)]
             if free.on_gpu else [("memory", device + host, free.device)])
    for tier, needed, available in tiers:
        if needed <= available:
            continue
        asked = _asked_sizes(options, plan, tier)
        if not asked:
            continue
        name, value, nbytes, what = max(asked, key=lambda a: a[2])
        rank = ("" if options.tensor_parallel_size * options.pipeline_parallel_size == 1
                else " (each rank's share)")
        most = _most_that_fits(name, plan, needed - nbytes, available)
        raise EngineConfigError(
            f"{name} {value} asks for {format_bytes(nbytes)} ({nbytes} bytes) of {what}; "
            f"with the rest of the plan this run needs {format_bytes(needed)} ({needed} "
            f"bytes) of {tier}, but {format_bytes(available)} ({available} bytes) is "
            f"available{rank}: lower {name}{most}")


def _most_that_fits(name: str, plan: PlacementPlan, rest: int, available: int) -> str:
    """' to at most N' for a count of KV blocks (`rest`: the plan's other bytes)."""
    if name not in ("num_kv_blocks", "num_host_kv_blocks"):
        return ""
    return f" to at most {max(available - rest, 0) // plan.sizes.kv_block_bytes}"


def _asked_sizes(options, plan: PlacementPlan, tier: str) -> list[tuple[str, int, int, str]]:
    """(option, its value, the bytes it puts on `tier`, what they hold) for each size the
    user asked for."""
    s = plan.sizes
    asked = []
    # Under a device_memory budget the device's share is the budget's (the plan fits its
    # KV and activations in it), so no other option is to blame for it.
    if tier != "host memory" and options.device_memory is None:
        kv = plan.device_bytes["kv_cache"]
        if options.num_kv_blocks is not None:
            asked.append(("num_kv_blocks", options.num_kv_blocks, kv,
                          f"KV cache ({s.kv_block_bytes} bytes a block)"))
        elif options.kv_cache_memory is not None:
            asked.append(("kv_cache_memory", options.kv_cache_memory, kv, "KV cache"))
        activations = plan.device_bytes["activations"]
        if options.max_num_batched_tokens is not None:
            asked.append(("max_num_batched_tokens", options.max_num_batched_tokens,
                          activations, "a step's activations"))
        elif options.max_num_seqs is not None:
            asked.append(("max_num_seqs", options.max_num_seqs, activations,
                          "a step's activations (its default max_num_batched_tokens "
                          "follows max_num_seqs)"))
    if tier != "the GPU" and options.num_host_kv_blocks is not None:
        asked.append(("num_host_kv_blocks", options.num_host_kv_blocks,
                      plan.host_bytes["kv_cache"],
                      f"host KV cache ({s.kv_block_bytes} bytes a block)"))
    return asked


def _cpu_kv_bytes(options, free: FreeMemory) -> int:
    """The most a CPU's KV pool takes under a device_memory fraction: what it takes with
    no budget at all (kv_cache_memory, or _CPU_KV_FRACTION of the available memory).
    On a CPU the "device" is the machine's own memory, which everything else on it
    shares, so a fraction such as vLLM's gpu_memory_utilization=0.9 is read as a cap:
    the pool holds the blocks the workload can use (max_num_seqs requests at
    max_model_len) within this share, never nine tenths of the machine, and no host
    swap pool is set aside unasked (it would be a second copy in the same memory,
    zero-filled at start-up)."""
    if options.kv_cache_memory is not None:
        return options.kv_cache_memory
    return int(free.device * _CPU_KV_FRACTION)


def _bytes(value, free: int, name: str) -> int:
    try:
        return parse_bytes(value, free, name)
    except ValueError as exc:
        raise EngineConfigError(str(exc)) from None
