"""Qwen3: token-exact greedy equality with transformers on tiny random checkpoints
(q/k head norms drawn at random, so a norm dropped or misplaced changes the tokens), and
config.json errors that name the key."""
import json

import pytest

from checkpoints import make_hf_checkpoint
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models.config import ModelConfig
from test_engine_equality import MAX_TOKENS, PROMPTS, check_equal

pytest.importorskip("transformers")

SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    # GQA (4 query heads on 2 KV heads), head_dim 32 != hidden / heads
    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", "bpe", seed=1,
                              head_dim=32)


def test_fused_batch_equals_transformers(qwen3_dir):
    outs, stats = check_equal(qwen3_dir)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert stats["num_steps"] == MAX_TOKENS  # every prompt prefilled in one fused step


def test_chunked_prefill_equals_transformers(qwen3_dir):
    _, stats = check_equal(qwen3_dir, max_num_batched_tokens=8, block_size=4)
    assert stats["num_steps"] > MAX_TOKENS * 2


def test_deterministic_mode_equals_transformers(qwen3_dir):
    check_equal(qwen3_dir, prompts=PROMPTS[1:4], deterministic=True, max_num_batched_tokens=8)


@pytest.mark.parametrize("overrides", [
    # one KV head, biases on q/k/v/o, the head tied to the embedding
    dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True),
    # layer 1 attends to its last 5 positions (prompts run to 40 tokens)
    dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
], ids=["mqa_bias_tied", "sliding_window"])
def test_config_variants_equal_transformers(tmp_path, overrides):
    model_dir = make_hf_checkpoint(tmp_path, "qwen3", "bpe", seed=2, **overrides)
    cfg = ModelConfig.from_dir(model_dir)
    if "sliding_window" in overrides:
        assert [cfg.layer_window(i) for i in range(2)] == [0, 5]
    check_equal(model_dir, prompts=PROMPTS[1:5], max_num_batched_tokens=16, block_size=4)


def test_layer_types_from_max_window_layers():
    # No layer_types in config.json: transformers' rule, layers from max_window_layers on
    raw = _raw(num_hidden_layers=4, use_sliding_window=True, sliding_window=7,
               max_window_layers=2)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_types == [FULL, FULL, SLIDING, SLIDING]
    assert [cfg.layer_window(i) for i in range(4)] == [0, 0, 7, 7]
    assert (cfg.qkv_bias, cfg.o_bias, cfg.head_dim) == (False, False, 128)  # Qwen3 defaults


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=[FULL]), r"layer_types must list one entry per layer \(2\)"),
    (dict(layer_types=[FULL, "chunked_attention"]),
     r"layer_types entry 'chunked_attention' not supported"),
    (dict(layer_types=[FULL, SLIDING]), r"layer_types has sliding_attention layers but no "
     r"sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     r"rope_scaling type 'yarn' not supported"),
])
def test_config_errors_name_the_key(tmp_path, changes, message):
    (tmp_path / "config.json").write_text(json.dumps(_raw(**changes)))
    with pytest.raises(ModelLoadError, match=f"config.json: {message}"):
        ModelConfig.from_dir(tmp_path)


def test_checkpoint_names_the_head_norms():
    from fusegen.engine.models import get_architecture

    cfg = ModelConfig.from_dict(_raw(head_dim=32, attention_bias=True))
    shapes = get_architecture("Qwen3ForCausalLM").checkpoint_shapes(cfg)
    layer = {k.removeprefix("model.layers.1."): v for k, v in shapes.items()
             if k.startswith("model.layers.1.")}
    assert layer["self_attn.q_norm.weight"] == layer["self_attn.k_norm.weight"] == (32,)
    assert layer["self_attn.q_proj.weight"] == (128, 64)
    assert layer["self_attn.o_proj.bias"] == (64,)
    assert len(layer) == 15  # 2 norms, q/k/v/o weights and biases, 2 head norms, 3 MLP


def _raw(**changes) -> dict:
    raw = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 448,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2}
    return raw | changes
