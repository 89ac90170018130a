"""The plan's choice of KV placement (engine/memory/kv_split.py), over plain numbers."""
import dataclasses

import pytest

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.kv_split import KVSplit, plan_kv_split
from fusegen.engine.memory.plan import FreeMemory, ModelShape, model_sizes, plan_engine
from fusegen.engine.options import EngineOptions

# 8 requests of 256 tokens in blocks of 16: 128 blocks
BATCH = dict(max_num_seqs=8, max_model_len=256, block_size=16)


@pytest.mark.parametrize("device, host, extra, expected", [
    (100, 50, {}, KVSplit("cooperative", 12)),  # 100 // 8 blocks each
    (128, 50, {}, KVSplit("device")),  # the batch fits the device
    (100, 0, {}, KVSplit("device")),  # no host pool to split into
    (100, 50, {"deterministic": True}, KVSplit("device")),
    (100, 50, {"on_gpu": True}, KVSplit("device")),
    (100, 50, {"unsupported": "a device group"}, KVSplit("device")),
])
def test_auto(device, host, extra, expected):
    assert plan_kv_split("auto", device, host, **BATCH, **extra) == expected


def test_asked_for():
    assert plan_kv_split("device", 10, 50, **BATCH) == KVSplit("device")
    # asked for, it splits even where the batch fits, and on GPUs and in deterministic mode
    assert plan_kv_split("cooperative", 400, 50, **BATCH, deterministic=True,
                         on_gpu=True) == KVSplit("cooperative", 16)  # one request's blocks
    assert plan_kv_split("cooperative", 4, 50, **BATCH) == KVSplit("cooperative", 1)


def test_errors_name_the_numbers():
    with pytest.raises(EngineConfigError, match=r"the plan has 0 host KV blocks \(the device "
                       r"holds 100 blocks of 16 tokens; 8 requests of 256 tokens need 128\)"):
        plan_kv_split("cooperative", 100, 0, **BATCH)
    with pytest.raises(EngineConfigError, match="not available here: a device group keeps"):
        plan_kv_split("cooperative", 100, 50, **BATCH,
                      unsupported="a device group keeps each rank's KV on its device")
    with pytest.raises(EngineConfigError, match="kv_placement must be one of auto, device, "
                       "cooperative; got 'split'"):
        EngineOptions(kv_placement="split")


# The device floor under a device budget (engine/memory/plan.py, placement.py): 8 layers
# of 4 MiB, 8 MiB fixed, KV blocks of 8 layers x 16 tokens x 64 values x 4 bytes = 32 KiB.
MiB = 2**20
SHAPE = ModelShape(num_layers=8, layer_params=MiB, fixed_params=2 * MiB, kv_width=64,
                   activation_width=10, vocab_size=100, max_position_embeddings=256,
                   dtype_bytes=4)
GPU = FreeMemory(device=10**12, host=10**12, on_gpu=True)
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
KV_BLOCK = 32 * 1024


def _floor_budget(placement: str) -> int:
    """fixed + activations + the device KV floor + 2 staging slots (every layer streamed)."""
    sizes = model_sizes(EngineOptions(kv_placement=placement, **LIMITS), SHAPE, (4, 64), 256)
    assert sizes.kv_block_bytes == KV_BLOCK
    return sizes.fixed_bytes + sizes.activation_bytes + sizes.kv_floor_blocks * KV_BLOCK \
        + 2 * 4 * MiB


def test_cooperative_device_floor_is_one_block_not_one_request():
    assert _floor_budget("device") - _floor_budget("cooperative") == 15 * KV_BLOCK
    budget = _floor_budget("cooperative")
    options = EngineOptions(device_memory=budget, host_memory=64 * MiB,
                            kv_placement="cooperative", **LIMITS)
    placement = plan_engine(options, SHAPE, GPU).placement
    assert placement.layer_tiers == ["host"] * 8  # 32 MiB of the 64 MiB host budget
    assert placement.num_staging_slots == 2
    assert placement.num_device_kv_blocks == 1
    # the other 32 MiB hold 1024 blocks, capped at the batch's 4 x 16
    assert placement.num_host_kv_blocks == 64
    assert placement.device_bytes["kv_cache"] == KV_BLOCK
    assert plan_kv_split("cooperative", 1, 64, 4, 256, 16) == KVSplit("cooperative", 1)
    # device placement needs one whole request (16 blocks) on the device
    with pytest.raises(EngineConfigError, match=r"16 KV blocks for one full-context request"):
        plan_engine(dataclasses.replace(options, kv_placement="device"), SHAPE, GPU)
    with pytest.raises(EngineConfigError, match=r"1 KV blocks for one request's device quota"):
        plan_engine(dataclasses.replace(options, device_memory=budget - 1), SHAPE, GPU)
    # one block more for the device: two device blocks, still one quota each of 4 requests
    more = plan_engine(dataclasses.replace(options, device_memory=budget + KV_BLOCK), SHAPE, GPU)
    assert more.placement.num_device_kv_blocks == 2


def test_cooperative_host_pool_is_not_capped_at_the_device_pool():
    # Unasked-for host KV is swap space as large as the device pool; cooperative
    # placement's host pool holds the batch's KV instead: up to 4 requests x 16 blocks.
    budget = _floor_budget("cooperative") + 3 * KV_BLOCK
    for placement, host_blocks in (("cooperative", 64), ("device", None)):
        options = EngineOptions(device_memory=budget + (15 * KV_BLOCK if placement == "device"
                                                        else 0),
                                kv_placement=placement, **LIMITS)
        plan = plan_engine(options, SHAPE, GPU).placement
        assert plan.num_device_kv_blocks == (4 if placement == "cooperative" else 19)
        assert plan.num_host_kv_blocks == (host_blocks or plan.num_device_kv_blocks)
