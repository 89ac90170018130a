"""`fusegen bench`'s model FLOPs and bytes, pinned for every preset: the numbers a report
prints must not move when the way they are counted changes (the architectures' tensor
tables, `engine/models`, not a formula of their own)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from fusegen.jobs.bench import flops
from fusegen.jobs.bench.presets import PRESETS

COUNTS = [(1, 1), (1024, 1000), (7, 0)]  # (prompt, output) tokens per request

# preset -> (num_params, layer_linear_params, lm_head_params, weight_bytes bf16,
#            weight_bytes fp32, request_flops(200, 180), workload_flops(COUNTS))
PINNED = {
    "tiny": (139584, 36864, 32768, 213632, 427264, 104551424, 1412258304),
    "cpu-small": (57942528, 3145728, 16384000, 83117056, 166234112, 26153746432,
                  168214609920),
    "gpu-8b": (8030261248, 218103808, 525336576, 15009849344, 30019698688, 5517201113088,
               30377381462016),
    "gpu-offload": (32763417600, 487587840, 778567680, 63969699840, 127939399680,
                    24028530606080, 130562456289280),
    "chat": (134515008, 3538944, 28311552, 269030016, 538060032, 95645076480,
             627956872704),
}
PINNED |= {name: PINNED["cpu-small"] for name in ("cpu-offload", "cpu-prefill", "labelling")}
PINNED["gpu-8b-1k"] = PINNED["gpu-8b"]


def _numbers(shape) -> tuple[int, ...]:
    return (flops.num_params(shape), flops.layer_linear_params(shape),
            flops.lm_head_params(shape), flops.weight_bytes(shape, "bfloat16"),
            flops.weight_bytes(shape, "float32"), flops.request_flops(shape, 200, 180),
            flops.workload_flops(shape, COUNTS))


def test_every_preset_is_pinned():
    assert sorted(PINNED) == sorted(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_flops_and_bytes_are_pinned(name):
    assert _numbers(PRESETS[name].model) == PINNED[name]


def test_mixture_of_experts_is_pinned():
    # cpu-small's attention with 8 experts of 256, 2 a token: every expert is stored and
    # read, 2 of them and the router multiply each token.
    moe = replace(PRESETS["cpu-small"].model, arch="mixtral", num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=256)
    assert flops.num_params(moe) == 64266752
    assert flops.layer_linear_params(moe) == 1576960
    assert flops.weight_bytes(moe, "bfloat16") == 95765504
    assert flops.workload_flops(moe, COUNTS) == 117411627008


def test_a_real_models_extra_norms_are_counted():
    # Qwen3's q/k head norms are in its tensor table, so --model counts them as
    # transformers does.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from fusegen.engine.models.config import ModelConfig
    from fusegen.jobs.bench.model import shape_of

    config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=False)
    shape = shape_of(ModelConfig.from_dict({**config.to_dict(),
                                            "architectures": ["Qwen3ForCausalLM"]}))
    assert shape.arch == "qwen3"
    assert flops.num_params(shape) == sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    # tiny's numbers with a vocabulary of 100 (embedding and head), plus 2 layers' q and
    # k norms of 16: what the Llama formula used to give it, and more
    assert flops.num_params(shape) == PINNED["tiny"][0] - 2 * (512 - 100) * 64 + 2 * 2 * 16


def test_experts_on_an_architecture_without_them_are_refused():
    moe = replace(PRESETS["tiny"].model, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32)
    with pytest.raises(ValueError, match="'llama' has no mixture of experts; num_experts 4"):
        flops.num_params(moe)
    with pytest.raises(ValueError, match="model arch 'gpt2' is none fusegen runs"):
        flops.num_params(replace(PRESETS["tiny"].model, arch="gpt2"))
