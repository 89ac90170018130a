"""A device_memory fraction (vLLM's gpu_memory_utilization) on a CPU bounds the pool and
does not fill it: the KV pool holds the blocks the workload can use (max_num_seqs
requests at max_model_len) within the share a CPU takes with no budget, and no host
swap pool is set aside unasked. On a GPU a fraction still fills the device."""
import pytest

from fusegen.engine.memory.placement import is_fraction
from fusegen.engine.memory.plan import FreeMemory, ModelShape, plan_engine
from fusegen.engine.options import EngineOptions

MiB = 2**20
# 8 layers of 1 Mi fp32 parameters (4 MiB each), 8 MiB fixed; a KV block is
# 8 layers x 16 tokens x 64 values x 4 bytes = 32 KiB.
SHAPE = ModelShape(num_layers=8, layer_params=MiB, fixed_params=2 * MiB, kv_width=64,
                   activation_width=1000, vocab_size=1000, max_position_embeddings=256,
                   dtype_bytes=4)
KV_BLOCK = 32 * 1024
# A small machine: 256 MiB available. With no budget a CPU's KV pool takes 30% of it,
# 0.3 * 256 MiB // 32 KiB = 2457 blocks, under the workload's ceiling of
# 256 requests x 256 tokens / 16 = 4096 blocks.
CPU = FreeMemory(device=256 * MiB, host=256 * MiB, on_gpu=False)


def _blocks(options: EngineOptions, free: FreeMemory = CPU) -> tuple[int, int]:
    placement = plan_engine(options, SHAPE, free).placement
    assert placement.sizes.kv_block_bytes == KV_BLOCK
    return placement.num_device_kv_blocks, placement.num_host_kv_blocks


@pytest.mark.parametrize("fraction", [0.9, "0.9", 1.0])
def test_a_large_fraction_on_a_cpu_plans_the_pool_the_default_plans(fraction):
    # Before: 0.9 * 256 MiB less weights and activations filled with 4096 blocks (the
    # ceiling), and a host swap pool as large again, zero-filled at start-up.
    assert _blocks(EngineOptions()) == (2457, 0)
    assert _blocks(EngineOptions(device_memory=fraction)) == (2457, 0)
    vllm = EngineOptions.from_kwargs({"gpu_memory_utilization": float(fraction)})
    assert _blocks(vllm) == (2457, 0)


def test_a_fraction_on_a_cpu_holds_no_more_than_the_workload_can_use():
    # 4 requests x 128 tokens = 4 x 8 blocks of 16 tokens, however much memory is free.
    options = EngineOptions(device_memory=0.9, max_num_seqs=4, max_model_len=128)
    assert _blocks(options) == (32, 0)
    huge = FreeMemory(device=1 << 40, host=1 << 40, on_gpu=False)
    assert _blocks(options, huge) == (32, 0)
    assert _blocks(EngineOptions(device_memory=0.9), huge) == (4096, 0)  # the ceiling


def test_a_small_fraction_on_a_cpu_gives_kv_what_is_left_of_it():
    # 0.25 * 256 MiB = 64 MiB, less 8 MiB fixed, 8 x 4 MiB layers and 19,456,000 bytes of
    # activations (4096 tokens x 1000 x 4 + 256 sampled rows x 1000 x 12): 174 blocks.
    placement = plan_engine(EngineOptions(device_memory=0.25), SHAPE, CPU).placement
    assert placement.layer_tiers == ["device"] * 8
    assert placement.sizes.activation_bytes == 19_456_000
    assert (64 * MiB - 8 * MiB - 32 * MiB - 19_456_000) // KV_BLOCK == 174
    assert (placement.num_device_kv_blocks, placement.num_host_kv_blocks) == (174, 0)


def test_what_the_user_sizes_on_a_cpu_is_kept():
    # kv_cache_memory is the pool's size, num_kv_blocks its exact count; a host budget or
    # host block count asks for a swap pool.
    assert _blocks(EngineOptions(device_memory=0.9, kv_cache_memory="8MiB")) == (256, 0)
    assert _blocks(EngineOptions(device_memory=0.9, num_kv_blocks=3000)) == (3000, 0)
    assert _blocks(EngineOptions(device_memory=0.9, host_memory="16MiB")) == (2457, 512)
    assert _blocks(EngineOptions(device_memory=0.9, num_host_kv_blocks=100)) == (2457, 100)
    # A size is a budget, not a fraction: the KV pool fills it up to the ceiling, and the
    # swap pool is as large as the device pool (within half the free host memory).
    assert _blocks(EngineOptions(device_memory="200MiB")) == (4096, 4096)


def test_a_fraction_on_a_gpu_still_fills_the_device():
    gpu = FreeMemory(device=256 * MiB, host=256 * MiB, on_gpu=True)
    # 0.9 * 256 MiB = 241,591,910 bytes, less 40 MiB of weights and the activations of
    # 8192 tokens and 256 sampled rows (32,768,000 + 3,072,000): 4999 blocks, capped at
    # the ceiling of 4096; the swap pool as large, within half the free host memory.
    room = int(0.9 * 256 * MiB) - 40 * MiB - 8192 * 4000 - 256 * 12000
    assert room // KV_BLOCK == 4999
    assert _blocks(EngineOptions(device_memory=0.9), gpu) == (4096, 4096)
    # 512 requests: a ceiling of 8192 blocks; the same activations (the head takes 256
    # sampled rows at a time), so the room's 4999 blocks.
    assert _blocks(EngineOptions(device_memory=0.9, max_num_seqs=512), gpu) == (4999, 4096)


@pytest.mark.parametrize("value, fraction", [(0.9, True), ("0.9", True), (1.0, True),
                                             ("1.0", True), (1, False), ("1", False),
                                             ("1GiB", False), (2**30, False), (0, False),
                                             (None, False), ("x", False)])
def test_is_fraction(value, fraction):
    assert is_fraction(value) is fraction
