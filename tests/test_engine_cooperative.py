"""Cooperative KV placement end to end: requests keep their first blocks on the device and
the rest in the host pool, attention merged from both, and greedy fp32 tokens are exactly
those of the engine with every block on the device."""
import pytest
import torch

from checkpoints import make_hf_checkpoint
from fusegen.engine import LLM, EngineConfigError, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog, then again and again.",
           "Hello", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
           "Bonjour, comment allez-vous ? Tres bien, merci, et vous ?",
           "In the beginning the universe was created.", "a b c d e f g h i j k l m n o p"]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# on the CPU, whose C kernels and automatic placement these tests pin down (a GPU machine
# would run them on CUDA); test_token_exact_on_cuda names its device
OPTIONS = dict(dtype="float32", max_model_len=128, block_size=4, max_num_seqs=8, device="cpu")
ON_CUDA = OPTIONS | dict(device="cuda")
# 32 device blocks (the least that holds one request of max_model_len) for 8 requests:
# 4 each (16 tokens), the rest in the host pool
COOPERATIVE = dict(kv_placement="cooperative", num_kv_blocks=32, num_host_kv_blocks=400,
                   host_memory="256MiB")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("coop"), "llama", "bpe", seed=5,
                              max_position_embeddings=128)


@pytest.fixture(scope="module")
def reference(model_dir):
    with LLM(str(model_dir), kv_placement="device", **OPTIONS) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("batched_tokens", [512, 16])  # whole prompts; chunks of 16 tokens
def test_token_exact_mixed_batches(model_dir, reference, batched_tokens):
    with LLM(str(model_dir), max_num_batched_tokens=batched_tokens, enable_prefix_caching=False,
             **COOPERATIVE, **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        report = llm.memory_report()
        quota = llm.engine.block_manager.device_quota
    assert [o.token_ids for o in outs] == reference
    assert report["kv_placement"] == "cooperative"
    assert report["kv_blocks"] == {"device": 32, "host": 400}
    assert quota == 4
    # most requests reach past their 16 device tokens
    assert sum(len(o.prompt_token_ids) + 12 > 16 for o in outs) >= 4


def test_token_exact_with_prefix_caching(model_dir, reference):
    # the second round finds the first's blocks cached, device and host ones alike
    with LLM(str(model_dir), max_num_batched_tokens=32, **COOPERATIVE, **OPTIONS) as llm:
        first = llm.generate(PROMPTS, PARAMS)
        second = llm.generate(PROMPTS, PARAMS)
        cached = sum(o.num_cached_tokens for o in second)
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in second] == reference
    assert cached >= 4 * 4 * len(PROMPTS) // 2  # host blocks among the hits


def test_token_exact_under_preemption(model_dir, reference):
    # 16 host blocks cannot hold six requests' tails at once: the newest are recomputed
    options = COOPERATIVE | dict(num_host_kv_blocks=16)
    with LLM(str(model_dir), max_num_batched_tokens=64, **options, **OPTIONS) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        stats = llm.stats()
    assert [o.token_ids for o in outs] == reference
    assert stats["num_preemptions"] > 0 and stats["num_swapped_blocks"] == 0


def test_deterministic_alone_and_batched(model_dir):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(str(model_dir), deterministic=True, max_num_batched_tokens=16, **COOPERATIVE,
             **OPTIONS) as llm:
        batched = llm.generate(PROMPTS, params)
        alone = [llm.generate([p], params)[0] for p in PROMPTS[:3]]
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit for bit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batched_tokens", [512, 16])
def test_token_exact_on_cuda(model_dir, batched_tokens):
    # the device part through the Triton kernel, the host part on the CPU's cores beside it
    with LLM(str(model_dir), kv_placement="device", **ON_CUDA) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    with LLM(str(model_dir), max_num_batched_tokens=batched_tokens,
             enable_prefix_caching=False, **COOPERATIVE, **ON_CUDA) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert llm.memory_report()["kv_placement"] == "cooperative"
    assert [o.token_ids for o in outs] == reference


def test_auto_picks_cooperative_when_the_batch_does_not_fit(model_dir):
    with LLM(str(model_dir), num_kv_blocks=32, num_host_kv_blocks=400, host_memory="256MiB",
             **OPTIONS) as llm:
        assert llm.memory_report()["kv_placement"] == "cooperative"
    with LLM(str(model_dir), num_kv_blocks=400, num_host_kv_blocks=400, host_memory="256MiB",
             **OPTIONS) as llm:
        assert llm.memory_report()["kv_placement"] == "device"


def test_cooperative_without_host_blocks_names_the_numbers(model_dir):
    with pytest.raises(EngineConfigError, match=r"kv_placement='cooperative' keeps part of "
                       r"each request's KV in the host pool, but the plan has 0 host KV "
                       r"blocks \(the device holds 32 blocks of 4 tokens; 8 requests of 128 "
                       r"tokens need 256\)"):
        LLM(str(model_dir), kv_placement="cooperative", num_kv_blocks=32, **OPTIONS)
    with pytest.raises(EngineConfigError, match="kv_placement must be one of auto, device, "
                       "cooperative; got 'host'"):
        LLM(str(model_dir), kv_placement="host", **OPTIONS)
