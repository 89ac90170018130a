"""Options -> batch limits and placement: one pure function over the options, the model's
sizes and the free memory (no tensors, no model files)."""
import dataclasses

import pytest

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.plan import (FreeMemory, ModelShape, activation_bytes, batch_limits,
                                        model_sizes, plan_engine)
from fusegen.engine.options import NAMES, EngineOptions

MiB = 2**20
# 8 layers of 1 Mi parameters in fp32 (4 MiB each), 2 Mi fixed parameters (8 MiB).
SHAPE = ModelShape(num_layers=8, layer_params=MiB, fixed_params=2 * MiB, kv_width=64,
                   activation_width=1000, vocab_size=1000, max_position_embeddings=256,
                   dtype_bytes=4)
CPU = FreeMemory(device=8 * 2**30, host=8 * 2**30, on_gpu=False)


def test_defaults_on_a_cpu_keep_every_layer_and_size_kv_from_free_memory():
    plan = plan_engine(EngineOptions(), SHAPE, CPU)
    assert (plan.max_num_seqs, plan.max_num_batched_tokens, plan.max_model_len) == (256, 4096, 256)
    assert plan.placement.layer_tiers == ["device"] * 8
    kv_block = 8 * 16 * 64 * 4  # layers * block_size * kv_width * bytes
    assert plan.placement.sizes.kv_block_bytes == kv_block
    # 30% of free memory for KV, capped at max_num_seqs full-context requests.
    assert plan.placement.num_device_kv_blocks == min(int(0.3 * CPU.device) // kv_block,
                                                      256 * (256 // 16))
    assert plan.placement.num_host_kv_blocks == 0  # CPU with no device limit: no swap pool


def test_user_limits_are_kept_and_feed_the_activation_reserve():
    options = EngineOptions(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    plan = plan_engine(options, SHAPE, CPU)
    assert (plan.max_num_seqs, plan.max_num_batched_tokens, plan.max_model_len) == (8, 64, 128)
    assert plan.placement.sizes.activation_bytes == activation_bytes(SHAPE, 64, 8) \
        == 64 * 1000 * 4 + 8 * 1000 * 12
    assert plan.placement.sizes.min_kv_blocks == 8  # 128 tokens in blocks of 16


def test_streaming_plans_again_with_larger_default_limits():
    # Room for a few of 8 layers: they stream, so the default limits grow to 4x (on a
    # GPU: 1024 sequences, 4 x 8192 tokens), which still fit beside small activations.
    shape = dataclasses.replace(SHAPE, activation_width=10)
    gpu = FreeMemory(device=10**12, host=10**12, on_gpu=True)
    budget = 30 * MiB
    plan = plan_engine(EngineOptions(device_memory=budget, host_memory=0), shape, gpu)
    assert plan.placement.streamed_layers
    assert (plan.max_num_seqs, plan.max_num_batched_tokens) == batch_limits(
        EngineOptions(), on_gpu=True, streaming=True) == (1024, 32768)
    # What the user set stays as set.
    mine = plan_engine(EngineOptions(device_memory=budget, host_memory=0, max_num_seqs=4),
                       shape, gpu)
    assert (mine.max_num_seqs, mine.max_num_batched_tokens) == (4, 32768)


def test_streaming_keeps_the_first_plan_when_larger_limits_do_not_fit():
    small = batch_limits(EngineOptions(), on_gpu=True, streaming=False)
    sizes = model_sizes(EngineOptions(), SHAPE, small, 256)
    # Just enough for the small limits with every layer streamed: the larger activation
    # reserve of the streaming limits would not fit.
    floor = (sizes.fixed_bytes + sizes.activation_bytes + sizes.min_kv_blocks * sizes.kv_block_bytes
             + 2 * sizes.layer_bytes)
    gpu = FreeMemory(device=10**12, host=10**12, on_gpu=True)
    plan = plan_engine(EngineOptions(device_memory=floor, host_memory=0), SHAPE, gpu)
    assert plan.placement.layer_tiers == ["disk"] * 8
    assert (plan.max_num_seqs, plan.max_num_batched_tokens) == small == (256, 8192)


def test_errors_name_the_limit():
    with pytest.raises(EngineConfigError, match="max_model_len 512 exceeds the model's "
                                                "max_position_embeddings 256"):
        plan_engine(EngineOptions(max_model_len=512), SHAPE, CPU)
    with pytest.raises(EngineConfigError, match="too small to run this model"):
        plan_engine(EngineOptions(device_memory=MiB), SHAPE, CPU)
    with pytest.raises(EngineConfigError, match="device_memory: a fraction needs"):
        plan_engine(EngineOptions(device_memory=0.5), SHAPE,
                    FreeMemory(device=None, host=0, on_gpu=False))


@pytest.mark.parametrize("kw, fragment", [
    ({"dtype": "fp8"}, "dtype must be one of auto, float32, bfloat16, float16; got 'fp8'"),
    ({"device": "gpu"}, "device must be auto, cpu, cuda, cuda:N or cuda:N,M,...; got 'gpu'"),
    ({"block_size": 3}, "block_size must be a power of two up to 128; got 3"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1, got 0"),
    ({"num_host_kv_blocks": -1}, "num_host_kv_blocks must be an integer >= 0, got -1"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory: cannot read 'lots'"),
    ({"host_memory": "1.5"}, "host_memory: '1.5' is neither whole bytes nor a fraction"),
])
def test_options_refuse_bad_values(kw, fragment):
    with pytest.raises(EngineConfigError) as info:
        EngineOptions(**kw)
    assert fragment in str(info.value)


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(EngineConfigError, match="gpu_layers: fusegen does not support this "
                                                "engine option; the options are dtype, "
                                                "device, max_num_seqs"):
        EngineOptions.from_kwargs({"gpu_layers": 3})


def test_options_are_listed_once_for_every_surface():
    from fusegen.engine.llm import LLM
    from fusegen.jobs.run_cmd import run
    from fusegen.jobs.spec import FIELD_NAMES, JobSpec

    flags = {p.name for p in run.params}
    job_fields = set(JobSpec(model="m", input="i", output="o").values())  # its keys
    for f in dataclasses.fields(EngineOptions):
        assert f.name in job_fields and f.name in FIELD_NAMES
        assert f.name in flags  # the job's --seed stands for `seed`
        assert f.metadata["help"] in LLM.__init__.__doc__
    assert set(JobSpec(model="m", input="i", output="o").engine_kwargs()) == set(NAMES) - {"seed"}
