"""Sizes and files fusegen must refuse clearly, before anything loads or is written: KV
pools and batch limits past the memory there is, sparse or sharded checkpoints missing a
part, and the checkpoint writers' output, signals and leftover staging folders."""
import pytest

from fusegen import LLM
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory import device


def _refusal(model, **options) -> str:
    with pytest.raises(EngineConfigError) as info:
        LLM(str(model), device="cpu", **options)
    return str(info.value)


# -- the memory plan: sizes past the memory there is ----------------------------------

@pytest.mark.parametrize("option, value, what", [
    ("num_kv_blocks", 10**9, "KV cache"),
    ("num_host_kv_blocks", 10**8, "host KV cache"),
    ("max_num_seqs", 10**9, "activations"),
    ("max_num_batched_tokens", 10**12, "activations"),
])
def test_sizes_past_memory_are_refused_naming_the_option(llama_dir, option, value, what):
    """Each is below the int32 limits but beyond what memory holds: refused by the plan,
    naming the option, its bytes and the bytes available, not an allocator or oneDNN
    error naming nothing."""
    message = _refusal(llama_dir, **{option: value})
    available = device.free_memory("cpu").device
    assert message.startswith(f"{option} {value} asks for "), message
    assert what in message and f"lower {option}" in message, message
    shown = int(message.split(" bytes) is available")[0].rsplit("(", 1)[1])
    assert abs(shown - available) < 2**30  # the machine's available memory, not a guess


def test_a_group_is_refused_before_any_rank_starts(llama_dir, monkeypatch):
    """tensor_parallel_size 2 x pipeline_parallel_size 2 with a huge num_kv_blocks: the
    plan (each rank's share of the memory) refuses it in the caller, not a failed group."""
    from fusegen.engine.parallel import group
    monkeypatch.setattr(group.DeviceGroup, "__init__", lambda *a, **k: pytest.fail(
        "a rank was started"))
    message = _refusal(llama_dir, num_kv_blocks=10**9, tensor_parallel_size=2,
                       pipeline_parallel_size=2)
    assert message.startswith("num_kv_blocks 1000000000 asks for "), message
    assert "(each rank's share)" in message, message


def test_sizes_that_fit_still_run(llama_dir):
    """The check refuses only what does not fit: asked-for sizes within memory run."""
    with LLM(str(llama_dir), device="cpu", num_kv_blocks=64, num_host_kv_blocks=16,
             max_num_seqs=8, max_num_batched_tokens=512) as llm:
        assert llm.engine.config.placement.num_device_kv_blocks == 64
