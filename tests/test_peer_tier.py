"""The peer tier of the memory pool (engine/parallel/peer.py): a device group's ranks hold
the layers their peers' budgets cannot, and serve them into the peers' staging slots.
The policy (tiers per layer, holders per layer, the budget checks) over made-up sizes;
the engine token-exact against one process holding everything, on CPU ranks over gloo."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from checkpoints import make_hf_checkpoint
from fusegen import LLM as _LLM
from fusegen import SamplingParams
from fusegen.engine.config import EngineConfig
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.placement import ModelSizes, format_bytes, plan_placement
from fusegen.engine.memory.plan import FreeMemory, ModelShape, plan_engine
from fusegen.engine.options import EngineOptions
from fusegen.engine.parallel.peer import assign_holders, group_holders, served
from fusegen.engine.parallel.plan import rank_infos

LLM = functools.partial(_LLM, device="cpu")
MiB = 2**20
SIZES = ModelSizes(layer_bytes=10 * MiB, num_layers=8, fixed_bytes=20 * MiB,
                   kv_block_bytes=1 * MiB, min_kv_blocks=4, activation_bytes=6 * MiB)


# -- placement: device -> peer -> host -> disk ----------------------------------------

def test_streamed_layers_go_to_peers_before_host_and_disk():
    # 80 MiB: 20 fixed + 6 activations + 4 KV floor + 2 slots x 10 leave 30 MiB, of which
    # the KV share takes a quarter of 50: one layer stays on the device.
    plan = plan_placement(SIZES, 80 * MiB, host_budget=25 * MiB, peer_budget=35 * MiB,
                          peer_spare=40 * MiB)
    assert plan.layer_tiers == ["device"] + ["peer"] * 3 + ["host"] * 2 + ["disk"] * 2
    assert plan.peer_bytes == 30 * MiB and plan.host_bytes["weights"] == 20 * MiB
    # the peer tier takes nothing from the device's KV blocks nor the host's swap pool
    assert plan.num_device_kv_blocks == 24 and plan.num_host_kv_blocks == 5
    assert plan.table().splitlines()[2].split() == ["peer", "35.00", "MiB", "3", "layers",
                                                    "40.00", "MiB", "spare", "a", "rank"]


def test_peer_tier_alone_and_none():
    plan = plan_placement(SIZES, 80 * MiB, host_budget=0, peer_budget=70 * MiB,
                          peer_spare=70 * MiB)
    assert plan.layer_tiers == ["device"] + ["peer"] * 7
    alone = plan_placement(SIZES, 80 * MiB, host_budget=0)
    assert alone.layer_tiers == ["device"] + ["disk"] * 7 and alone.peer_bytes == 0
    assert "peer" not in alone.table()  # no group, no peer row
    fits = plan_placement(SIZES, 200 * MiB, host_budget=0, peer_budget=70 * MiB)
    assert fits.layer_tiers == ["device"] * 8 and fits.peer_bytes == 0


# -- which peer holds which layer ------------------------------------------------------

def test_holders_spread_over_the_peers_with_most_spare():
    # two ranks of a tensor-parallel stage: each holds the other's
    assert assign_holders({0: [(3, 10), (4, 10)], 1: [(3, 10), (4, 10)]}, {0: 100, 1: 100}) \
        == {0: {3: 1, 4: 1}, 1: {3: 0, 4: 0}}
    # four ranks: the most spare left first, ties to the nearest rank after the consumer
    holders = assign_holders({0: [(1, 10), (2, 10), (3, 10)], 1: [(5, 10)], 2: [], 3: []},
                             {0: 30, 1: 30, 2: 30, 3: 30})
    assert holders == {0: {1: 1, 2: 2, 3: 3}, 1: {5: 0}, 2: {}, 3: {}}
    assert served(holders, 0) == [(1, 5)] and served(holders, 2) == [(0, 2)]
    # a peer without room for a layer is skipped
    assert assign_holders({0: [(1, 10)]}, {0: 50, 1: 9, 2: 10}) == {0: {1: 2}}


def test_no_peer_with_room_is_refused_with_the_numbers():
    with pytest.raises(EngineConfigError) as info:
        assign_holders({0: [(1, 10 * MiB), (2, 10 * MiB)], 1: []}, {0: 0, 1: 15 * MiB})
    assert str(info.value) == (
        "peer_memory: no peer of rank 0 can hold its layer 2 (10.00 MiB); spare memory left "
        "(rank 1: 5.00 MiB); lower peer_memory or device_memory")


def test_group_holders_follow_each_ranks_stage():
    tiers = ["device", "peer", "peer", "host"]  # the plan: by position in a stage
    tp2 = rank_infos(2, 1, [range(0, 4)], ["cpu"] * 2, 2)
    assert group_holders(tp2, tiers, 10, 100) == ((0, 1, 1), (0, 2, 1), (1, 1, 0), (1, 2, 0))
    pp2 = rank_infos(1, 2, [range(0, 4), range(4, 6)], ["cpu"] * 2, 2)
    assert group_holders(pp2, tiers, 10, 100) == ((0, 1, 1), (0, 2, 1), (1, 5, 0))
    infos = [dataclasses.replace(i, peer_holders=group_holders(pp2, tiers, 10, 100))
             for i in pp2]
    assert infos[0].own_peer_layers == {1: 1, 2: 1} and infos[0].peer_consumers == {1}
    assert infos[1].own_peer_layers == {5: 0} and infos[1].peer_consumers == {0}


# -- budgets, checked before anything loads -------------------------------------------

SHAPE = ModelShape(num_layers=8, layer_params=MiB, fixed_params=2 * MiB, kv_width=64,
                   activation_width=1000, vocab_size=1000, max_position_embeddings=256,
                   dtype_bytes=4)  # 4 MiB layers
FREE = FreeMemory(device=100 * MiB, host=100 * MiB, on_gpu=False)  # per rank


def test_peer_budget_plans_per_rank():
    options = EngineOptions(tensor_parallel_size=2, device_memory="40MiB", host_memory=0,
                            peer_memory="12MiB", max_num_seqs=4, max_num_batched_tokens=64)
    plan = plan_engine(options, SHAPE, FREE).placement
    assert plan.peer_budget == 12 * MiB and plan.peer_spare == 60 * MiB
    assert plan.layer_tiers.count("peer") == 3 and plan.layer_tiers[-1] == "disk"
    fraction = dataclasses.replace(options, peer_memory=0.5)
    assert plan_engine(fraction, SHAPE, FREE).placement.peer_budget == 50 * MiB


def test_bad_peer_budgets_are_refused():
    with pytest.raises(EngineConfigError) as info:
        EngineOptions(peer_memory="1GiB")
    assert str(info.value) == (
        "peer_memory '1GiB' needs a device group: peers are the other ranks of one, and "
        "tensor_parallel_size x pipeline_parallel_size is 1 x 1; set one of them above 1, "
        "or use host_memory")
    with pytest.raises(EngineConfigError, match="peer_memory: cannot read 'lots'"):
        EngineOptions(peer_memory="lots", pipeline_parallel_size=2)
    options = EngineOptions(pipeline_parallel_size=2, device_memory="40MiB",
                            peer_memory="61MiB")
    with pytest.raises(EngineConfigError) as info:
        plan_engine(options, SHAPE, FREE)
    assert str(info.value) == (
        "peer_memory 61.00 MiB is larger than the peers' free memory: each of the group's 2 "
        "ranks has 100.00 MiB free and plans 40.00 MiB for itself (device_memory), leaving "
        "60.00 MiB to hold its peers' layers; each rank lends as much as it borrows, so "
        "peer_memory may be at most 60.00 MiB: lower peer_memory or device_memory")


def test_job_file_and_flags_take_the_peer_budget(tmp_path):
    from fusegen.jobs.errors import JobError
    from fusegen.jobs.flags import engine_flags
    from fusegen.jobs.spec import JobSpec

    where = dict(model=str(tmp_path), input=str(tmp_path / "in"), output=str(tmp_path / "out"))
    spec = JobSpec(**where, peer_memory="2GiB", pipeline_parallel_size=2)
    assert spec.engine.peer_memory == "2GiB"
    with pytest.raises(JobError, match="peer_memory '2GiB' needs a device group"):
        JobSpec(**where, peer_memory="2GiB")
    assert any("--peer-memory" in flag(lambda: None).__click_params__[0].opts
               for flag in engine_flags(("peer_memory",)))


# -- the engine: token-exact against one process ---------------------------------------

PROMPTS = [list(range(5, 14)), [20, 21, 22], list(range(30, 70)), [7] * 17]
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)


def _tokens(llm) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """An 8-layer checkpoint and its single-process tokens."""
    path = str(make_hf_checkpoint(tmp_path_factory.mktemp("peer"), "llama", seed=11,
                                  num_hidden_layers=8))
    with LLM(path, **OPTIONS) as llm:
        return path, _tokens(llm)


def _budget(path: str, split: dict) -> tuple[int, int]:
    """A rank's device budget that keeps one layer of its stage on the device, and a
    rank's layer bytes (planned only: no rank starts)."""
    from test_offload import budget_for

    sizes = EngineConfig.build(path, EngineOptions(device="cpu", **split, **OPTIONS)
                               ).placement.sizes
    return budget_for(sizes, resident=1), sizes.layer_bytes


@pytest.mark.parametrize("split, peer, host, tiers", [
    (dict(tensor_parallel_size=2), 7, 0, ["device"] + ["peer"] * 7),
    (dict(tensor_parallel_size=2), 3, 2, ["device"] + ["peer"] * 3 + ["host"] * 2
     + ["disk"] * 2),
    # stages of 4 layers each: the plan is a stage's
    (dict(pipeline_parallel_size=2), 3, 0, ["device"] + ["peer"] * 3),
    (dict(pipeline_parallel_size=2), 1, 1, ["device", "peer", "host", "disk"]),
])
def test_layers_in_peers_memory_give_single_process_tokens(model, split, peer, host, tiers):
    path, expected = model
    budget, layer_bytes = _budget(path, split)
    with LLM(path, device_memory=budget, peer_memory=peer * layer_bytes,
             host_memory=host * layer_bytes, **split, **OPTIONS) as llm:
        assert llm.placement.layer_tiers == tiers
        assert _tokens(llm) == expected
        report = llm.memory_report()
        streams = llm.engine.runner.stream_stats()
    stages = [range(*s) for s in report["group"]["stages"]]
    for rank, r in report["ranks"].items():
        stage = stages[rank // split.get("tensor_parallel_size", 1)]
        own = [t for _, t in zip(stage, tiers)]
        assert r["layers"]["peer"] == own.count("peer")
        assert r["peer"]["weights"] == own.count("peer") * layer_bytes
        steps, by_tier = streams[rank]["steps"], streams[rank]["tiers"]
        # every step fetches each of the rank's peer layers once (the ring runs ahead
        # by its staging slots at most)
        fetched = by_tier["peer"]
        assert fetched["layers"] == own.count("peer")
        assert steps * own.count("peer") <= fetched["loads"] <= (steps + 2) * own.count("peer")
        assert fetched["bytes"] == fetched["loads"] * layer_bytes
    # each rank holds for its peers what they borrow from it
    held = sum(r["peer"]["held"] for r in report["ranks"].values())
    assert held == sum(r["peer"]["weights"] for r in report["ranks"].values())


def test_a_peer_budget_beyond_the_group_is_refused_before_any_rank_starts(model):
    path, _ = model
    budget, _ = _budget(path, dict(tensor_parallel_size=2))
    with pytest.raises(EngineConfigError, match=r"^peer_memory .* is larger than the peers' "
                       r"free memory: each of the group's 2 ranks has .* free and plans "
                       + format_bytes(budget).replace(".", r"\.")):
        LLM(path, device_memory=budget, peer_memory=2**50, tensor_parallel_size=2, **OPTIONS)


def test_compressed_layers_travel_as_their_components(tmp_path):
    """An int4 checkpoint's layers in the peer tier: the holder sends the borrower's
    slice of each linear as its codes, scales and zero points (their own dtypes)."""
    from fusegen.engine.weights.quantize import QuantizeSpec, quantize_checkpoint

    deep = make_hf_checkpoint(tmp_path / "deep", "llama", seed=5, num_hidden_layers=4)
    quantize_checkpoint(deep, tmp_path / "int4", QuantizeSpec(bits=4, group_size=32,
                                                              symmetric=False))
    path = str(tmp_path / "int4")
    with LLM(path, **OPTIONS) as llm:
        expected = _tokens(llm)
    split = dict(tensor_parallel_size=2)
    budget, layer_bytes = _budget(path, split)
    with LLM(path, device_memory=budget, peer_memory=2 * layer_bytes,
             host_memory=layer_bytes, **split, **OPTIONS) as llm:
        assert llm.placement.layer_tiers == ["device", "peer", "peer", "host"]
        assert llm.placement.sizes.dense_layer_bytes > layer_bytes  # kept compressed
        assert _tokens(llm) == expected
        ranks = llm.memory_report()["ranks"]
    assert [r["peer"]["held"] for r in ranks.values()] == [2 * layer_bytes] * 2
