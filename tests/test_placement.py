"""The placement plan: pure arithmetic over sizes, no tensors."""
import pytest

from fusegen.engine.memory.placement import (BudgetTooSmall, ModelSizes, format_bytes, minimum_device_budget,
                              parse_bytes, plan_placement)

MiB = 2**20
SIZES = ModelSizes(layer_bytes=10 * MiB, num_layers=8, fixed_bytes=20 * MiB,
                   kv_block_bytes=1 * MiB, min_kv_blocks=4, activation_bytes=6 * MiB)


@pytest.mark.parametrize("value, expected", [
    (1024, 1024), ("24GiB", 24 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536),
    (0.5, 500), ("0.25", 250), ("100", 100), (0, 0), ("0", 0),
])
def test_parse_bytes(value, expected):
    assert parse_bytes(value, available=1000) == expected


@pytest.mark.parametrize("value", ["lots", "12XB", -5, True, "1.5"])
def test_parse_bytes_rejects(value):
    with pytest.raises(ValueError, match="device_memory"):
        parse_bytes(value, available=1000, name="device_memory")


def test_everything_fits():
    plan = plan_placement(SIZES, device_budget=200 * MiB, host_budget=0)
    assert plan.layer_tiers == ["device"] * 8 and plan.num_staging_slots == 0
    # 200 - 20 fixed - 6 activations - 80 layers = 94 MiB of KV blocks
    assert plan.num_device_kv_blocks == 94 and plan.streamed_layers == []
    assert sum(plan.device_bytes.values()) == 200 * MiB


def test_streaming_reserves_staging_and_kv_share():
    # 100 MiB: free after fixed, activations, KV floor = 70; staging 2 x 10 = 20;
    # KV share 25% of 70 = 17.5 -> 32.5 MiB of room -> 3 layers.
    plan = plan_placement(SIZES, device_budget=100 * MiB, host_budget=35 * MiB)
    assert plan.layer_tiers == ["device"] * 3 + ["host"] * 3 + ["disk"] * 2
    assert plan.num_staging_slots == 2 and plan.streamed_layers == [3, 4, 5, 6, 7]
    assert plan.num_device_kv_blocks == 100 - 20 - 6 - 30 - 20  # 24
    assert plan.num_host_kv_blocks == 5  # host left after 3 layers
    assert sum(plan.device_bytes.values()) <= 100 * MiB
    assert plan.offload_fraction == 0.625


def test_prefetch_depth_sets_slots():
    plan = plan_placement(SIZES, device_budget=100 * MiB, host_budget=10**12, prefetch_depth=3)
    assert plan.num_staging_slots == 4
    assert all(t in ("device", "host") for t in plan.layer_tiers)


def test_minimum_budget_runs_with_every_layer_streamed():
    low = minimum_device_budget(SIZES)
    assert low == (20 + 6 + 4 + 20) * MiB
    plan = plan_placement(SIZES, device_budget=low, host_budget=0)
    assert plan.layer_tiers == ["disk"] * 8 and plan.num_device_kv_blocks == 4
    with pytest.raises(BudgetTooSmall, match=r"smallest budget that works is 50.00 MiB"):
        plan_placement(SIZES, device_budget=low - 1, host_budget=0)


def test_kv_cap_and_table():
    plan = plan_placement(SIZES, device_budget=200 * MiB, host_budget=50 * MiB, max_kv_blocks=10)
    assert plan.num_device_kv_blocks == 10 and plan.num_host_kv_blocks == 10
    table = plan.table()
    assert "device" in table and "8 layers + embed/head" in table and "10 blocks" in table
    assert format_bytes(3 * MiB) == "3.00 MiB"


def test_budget_for_resident_layers():
    from fusegen.engine.memory.placement import budget_for_resident_layers

    # The largest budget that still streams keeps 4 layers here (the KV share takes
    # the rest of the room); up to that, budgets are exact and smallest.
    for k in range(8):
        budget = budget_for_resident_layers(SIZES, k)
        assert plan_placement(SIZES, budget, 0).layer_tiers.count("device") == min(k, 4)
        if k <= 4 and budget > minimum_device_budget(SIZES):
            assert plan_placement(SIZES, budget - 1, 0).layer_tiers.count("device") < k


def test_kv_reserve_comes_before_layers():
    # 200 MiB: free = 200 - 20 fixed - 6 activations - 4 floor = 170 holds the 80 of
    # layers and the 56 of KV asked beyond the floor: everything stays resident.
    plan = plan_placement(SIZES, device_budget=200 * MiB, host_budget=0, kv_reserve=60 * MiB)
    assert plan.streamed_layers == [] and plan.num_device_kv_blocks == 94
    # 150 MiB: free 120 < 80 + 56, so layers stream: room 120 - 20 staging - 56 = 44
    # -> 4 layers; KV gets the rest: 150 - 20 - 6 - 40 - 20 = 64 blocks (>= 60 asked).
    plan = plan_placement(SIZES, device_budget=150 * MiB, host_budget=0, kv_reserve=60 * MiB)
    assert plan.layer_tiers == ["device"] * 4 + ["disk"] * 4
    assert plan.num_device_kv_blocks == 64
    # Without the ask, layers come first: all 8 fit, and KV gets the 44 MiB left.
    plan = plan_placement(SIZES, device_budget=150 * MiB, host_budget=0)
    assert plan.streamed_layers == [] and plan.num_device_kv_blocks == 44


def test_budget_for_resident_layers_with_a_kv_reserve():
    from fusegen.engine.memory.placement import budget_for_resident_layers

    # Streaming keeps at most 5 of 8 layers here: 5 resident + 2 staging slots + 1 more
    # layer would be the budget that holds all 8.
    for k in range(6):
        budget = budget_for_resident_layers(SIZES, k, kv_reserve=60 * MiB)
        plan = plan_placement(SIZES, budget, 0, kv_reserve=60 * MiB)
        assert plan.layer_tiers.count("device") == k
        assert plan.num_device_kv_blocks >= 60
        smaller = plan_placement(SIZES, budget - 1, 0, kv_reserve=60 * MiB)
        assert smaller.layer_tiers.count("device") < k or smaller.num_device_kv_blocks < 60
