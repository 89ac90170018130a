"""The plan's choice of KV placement (engine/memory/kv_split.py), over plain numbers."""
import pytest

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.kv_split import KVSplit, plan_kv_split
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
