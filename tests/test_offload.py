"""The memory pool end to end: outputs are token-identical whatever the budgets, and
the accounting holds in every step."""
import pytest

from checkpoints import make_hf_checkpoint
from fusegen.engine import LLM, EngineConfigError, SamplingParams
from fusegen.engine.memory.placement import minimum_device_budget, plan_placement

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "1 2 3 4 5 6 7 8 9",
           "Bonjour, comment allez-vous ?", "In the beginning the universe was created.",
           "a b c d e f g"]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    # Ten layers so that "about 90% streamed" means 9 of 10.
    return make_hf_checkpoint(tmp_path_factory.mktemp("deep"), "llama", "bpe", seed=11,
                              num_hidden_layers=10, max_position_embeddings=128)


@pytest.fixture(scope="module")
def reference(deep_dir):
    with LLM(str(deep_dir), **OPTIONS) as llm:
        outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        sizes = llm.placement.sizes
    return outs, sizes


def budget_for(sizes, resident: int) -> int:
    """The smallest device budget whose plan keeps `resident` layers on the device."""
    low, high = minimum_device_budget(sizes), 10**10
    while low < high:
        mid = (low + high) // 2
        if plan_placement(sizes, mid, 0).layer_tiers.count("device") >= resident:
            high = mid
        else:
            low = mid + 1
    return low


@pytest.mark.parametrize("resident, host", [(10, "1GiB"), (5, "1GiB"), (1, "1GiB"), (5, 0)])
def test_token_identical_under_budgets(deep_dir, reference, resident, host):
    want, sizes = reference
    budget = budget_for(sizes, resident)
    with LLM(str(deep_dir), device_memory=budget, host_memory=host, **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        report, stats = llm.memory_report(), llm.stats()
        tiers = llm.placement.layer_tiers
    assert [o.token_ids for o in outs] == want
    assert tiers.count("device") == resident
    assert tiers.count("host" if host else "disk") == 10 - resident
    # Accounting, from the tensors actually allocated, over every step.
    assert report["device"]["total"] <= budget and report["device"]["peak"] <= budget
    assert report["layers"]["device"] == resident
    if resident < 10:
        streamed = report["streamed"]
        assert streamed["layers"] == 10 - resident
        assert streamed["loads"] == 2 + stats["num_steps"] * (10 - resident)  # 2 slots ahead
        assert report["device"]["staging"] == 2 * sizes.layer_bytes
        assert report["device"]["weights"] == sizes.fixed_bytes + resident * sizes.layer_bytes
        if host:
            assert report["host"]["weights"] == (10 - resident) * sizes.layer_bytes
        else:
            assert report["disk"]["weights"] == (10 - resident) * sizes.layer_bytes


@pytest.mark.parametrize("host_blocks, swapped", [(64, True), (0, False)])
def test_kv_swapping_token_identical(deep_dir, reference, host_blocks, swapped):
    want, sizes = reference
    # 12 device blocks of 16 tokens cannot hold six requests at once: preemption,
    # by swapping to the host pool when it has room, by recompute when not.
    with LLM(str(deep_dir), device_memory=budget_for(sizes, 5), host_memory="1GiB",
             num_kv_blocks=12, num_host_kv_blocks=host_blocks, kv_placement="device",
             **OPTIONS) as llm:
        outs = llm.generate(PROMPTS * 2, PARAMS)
        stats = llm.stats()
        assert llm.memory_report()["kv_blocks"] == {"device": 12, "host": host_blocks}
    assert [o.token_ids for o in outs] == want * 2
    assert stats["num_preemptions"] > 0
    assert (stats["num_swapped_blocks"] > 0) is swapped


def test_kv_cache_memory_is_the_kv_share_under_a_budget(deep_dir, reference):
    # The budget that keeps 5 layers with the default KV share; asking for two more
    # layers' worth of KV than it gets moves layers off the device, tokens unchanged.
    want, sizes = reference
    budget = budget_for(sizes, 5)
    default = plan_placement(sizes, budget, 0)
    asked = default.num_device_kv_blocks * sizes.kv_block_bytes + 2 * sizes.layer_bytes
    with LLM(str(deep_dir), device_memory=budget, host_memory=0, kv_cache_memory=asked,
             **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        plan, report = llm.placement, llm.memory_report()
    expected = plan_placement(sizes, budget, 0, kv_reserve=asked)
    assert plan.layer_tiers == expected.layer_tiers
    assert plan.layer_tiers.count("device") < 5
    assert plan.num_device_kv_blocks * sizes.kv_block_bytes >= asked
    assert report["device"]["peak"] <= budget
    assert [o.token_ids for o in outs] == want


def test_budget_too_small_names_the_minimum(deep_dir, reference):
    _, sizes = reference
    smallest = minimum_device_budget(sizes)
    with pytest.raises(EngineConfigError, match=r"too small to run this model: the smallest "
                       r"budget that works is"):
        LLM(str(deep_dir), device_memory=smallest - 1, **OPTIONS)
    with LLM(str(deep_dir), device_memory=smallest, host_memory=0, **OPTIONS) as llm:
        assert llm.placement.layer_tiers == ["disk"] * 10
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], PARAMS)] == reference[0][:2]


def test_fraction_and_size_strings(deep_dir):
    with LLM(str(deep_dir), device_memory="64MiB", host_memory=0.01, **OPTIONS) as llm:
        assert llm.placement.device_budget == 64 * 2**20
        assert llm.placement.layer_tiers.count("device") == 10
    with pytest.raises(EngineConfigError, match="device_memory: cannot read 'lots'"):
        LLM(str(deep_dir), device_memory="lots", **OPTIONS)
