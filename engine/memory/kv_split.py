"""Where a running batch's KV blocks live: all on the device, or split per request between
the device and the host KV pool (cooperative placement, engine/split_blocks.py). Plain
arithmetic over the plan's block counts; config.py calls it once the plan is made, before
anything loads."""
from __future__ import annotations

from dataclasses import dataclass

from fusegen.engine.errors import EngineConfigError


@dataclass(frozen=True, slots=True)
class KVSplit:
    placement: str  # "device" or "cooperative"
    # cooperative: the device blocks each request keeps (its first ones; the rest are in
    # the host pool), the same for every request so its split never depends on the batch
    device_quota: int = 0

    @property
    def cooperative(self) -> bool:
        return self.placement == "cooperative"


DEVICE = KVSplit("device")


def plan_kv_split(option: str, num_device_blocks: int, num_host_blocks: int,
                  max_num_seqs: int, max_model_len: int, block_size: int, *,
                  deterministic: bool = False, unsupported: str | None = None,
                  on_gpu: bool = False) -> KVSplit:
    """`option`: EngineOptions.kv_placement. `unsupported`: why this model or engine cannot
    split its KV (None: it can). auto is cooperative when max_num_seqs requests at
    max_model_len need more blocks than the device holds and the host pool has blocks;
    never in deterministic mode (whose reduction order it would change), nor on GPUs
    until it is measured there against swapping (jobs/bench/cooperative_kv.py): ask for
    it by name."""
    per_request = -(-max_model_len // block_size)
    need = max_num_seqs * per_request
    if option == "auto":
        if deterministic or unsupported or on_gpu or num_host_blocks == 0 \
                or need <= num_device_blocks:
            return DEVICE
    elif option != "cooperative":
        return DEVICE
    if unsupported:
        raise EngineConfigError(f"kv_placement='cooperative' is not available here: "
                                f"{unsupported}; use kv_placement='device'")
    if num_host_blocks == 0:
        raise EngineConfigError(
            f"kv_placement='cooperative' keeps part of each request's KV in the host pool, "
            f"but the plan has 0 host KV blocks (the device holds {num_device_blocks} blocks "
            f"of {block_size} tokens; {max_num_seqs} requests of {max_model_len} tokens need "
            f"{need}); give the pool host memory (num_host_kv_blocks=N or host_memory=SIZE) "
            "or use kv_placement='device'")
    quota = max(1, min(per_request, num_device_blocks // max_num_seqs))
    return KVSplit("cooperative", quota)
