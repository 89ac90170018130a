"""Synthetic checkpoints load in transformers exactly as written."""
import json

import pytest
import torch
from safetensors.torch import load_file

from fusegen.engine.models.synthetic import build_checkpoint, build_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
CASES = {
    "llama": dict(arch="llama"),
    "llama_bias_headdim_rope": dict(arch="llama", attention_bias=True, head_dim=32, rope_scaling=LLAMA3_ROPE,
                                    rope_theta=500000.0, tokenizer="sentencepiece"),
    "mistral_sharded": dict(arch="mistral", tokenizer="sentencepiece", max_shard_bytes=100_000),
    "qwen2_tied": dict(arch="qwen2", tie_word_embeddings=True, eos_token_id=[511, 7], num_kv_heads=1),
}


def read_weights(path) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


@pytest.mark.parametrize("name", CASES)
def test_loads_in_transformers_with_equal_tensors(tmp_path, name):
    kwargs = CASES[name]
    path = build_checkpoint(tmp_path, init_std=0.2, **kwargs)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
    assert {k: v for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched keys
    weights, state = read_weights(path), model.state_dict()
    tied = kwargs.get("tie_word_embeddings", False)
    assert set(weights) == set(state) - ({"lm_head.weight"} if tied else set())
    for key, tensor in weights.items():
        assert torch.equal(state[key], tensor), key
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_weight_names_and_shapes(tmp_path):
    path = build_checkpoint(tmp_path, "llama", num_layers=1, head_dim=24, attention_bias=True)
    shapes = {k: tuple(v.shape) for k, v in read_weights(path).items()}
    assert shapes == {
        "model.embed_tokens.weight": (512, 64),
        "model.layers.0.input_layernorm.weight": (64,),
        "model.layers.0.self_attn.q_proj.weight": (96, 64), "model.layers.0.self_attn.q_proj.bias": (96,),
        "model.layers.0.self_attn.k_proj.weight": (48, 64), "model.layers.0.self_attn.k_proj.bias": (48,),
        "model.layers.0.self_attn.v_proj.weight": (48, 64), "model.layers.0.self_attn.v_proj.bias": (48,),
        "model.layers.0.self_attn.o_proj.weight": (64, 96), "model.layers.0.self_attn.o_proj.bias": (64,),
        "model.layers.0.post_attention_layernorm.weight": (64,),
        "model.layers.0.mlp.gate_proj.weight": (128, 64),
        "model.layers.0.mlp.up_proj.weight": (128, 64),
        "model.layers.0.mlp.down_proj.weight": (64, 128),
        "model.norm.weight": (64,),
        "lm_head.weight": (512, 64),
    }


def test_config_as_transformers_reads_it(tmp_path):
    path = build_checkpoint(tmp_path, "llama", rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1e6,
                            head_dim=32, eos_token_id=[511, 3])
    config = transformers.AutoConfig.from_pretrained(path)
    # transformers merges the legacy rope_scaling in, hence its "type" key beside "rope_type"
    assert {k: v for k, v in config.rope_parameters.items() if k != "type"} == {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (32, 2, 512)
    assert (config.bos_token_id, config.eos_token_id, config.tie_word_embeddings) == (510, [511, 3], False)
    raw = json.loads((path / "config.json").read_text())
    assert (raw["rope_theta"], raw["rope_scaling"], raw["torch_dtype"]) == (1e6, {"type": "linear", "factor": 2.0},
                                                                            "float32")  # legacy keys too
    mistral = json.loads((build_checkpoint(tmp_path / "m", "mistral") / "config.json").read_text())
    qwen2 = json.loads((build_checkpoint(tmp_path / "q", "qwen2") / "config.json").read_text())
    assert mistral["sliding_window"] is None and "attention_bias" not in mistral
    assert (qwen2["use_sliding_window"], qwen2["sliding_window"]) == (False, None)


@pytest.mark.parametrize("eos", [None, 7, [511, 7]])
def test_generation_config_eos_round_trips(tmp_path, eos):
    path = build_checkpoint(tmp_path, "qwen2", eos_token_id=eos)
    gen = transformers.GenerationConfig.from_pretrained(path)
    assert gen.eos_token_id == (511 if eos is None else eos)
    assert gen.bos_token_id == 510
    assert isinstance(json.loads((path / "generation_config.json").read_text())["eos_token_id"], type(gen.eos_token_id))


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_tokenizer_loads_in_transformers(tmp_path, kind):
    path = build_checkpoint(tmp_path, tokenizer=kind)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert len(hf) == 512
    assert (hf.bos_token, hf.eos_token) == (("<|begin_of_text|>", "<|end_of_text|>") if kind == "bpe" else ("<s>", "</s>"))
    assert hf.encode("Hi")[0] == hf.bos_token_id
    if kind == "sentencepiece":  # the Llama-2 layout: specials, then <0x00>..<0xFF>
        assert hf.convert_ids_to_tokens([0, 1, 2, 3, 258]) == ["<unk>", "<s>", "</s>", "<0x00>", "<0xFF>"]


def test_sharded_index(tmp_path):
    path = build_checkpoint(tmp_path, "mistral", max_shard_bytes=100_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards and not (path / "model.safetensors").exists()
    weights = read_weights(path)
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    for name, shard in index["weight_map"].items():
        assert name in load_file(path / shard)


def test_deterministic_and_seeded(tmp_path):
    a = build_checkpoint(tmp_path / "a", "llama", seed=3)
    b = build_checkpoint(tmp_path / "b", "llama", seed=3)
    c = build_checkpoint(tmp_path / "c", "llama", seed=4)
    for name in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_init_std_norms_and_dtype(tmp_path):
    w = read_weights(build_checkpoint(tmp_path, "llama", init_std=0.25, hidden_size=128, intermediate_size=256,
                                      dtype="bfloat16"))
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert abs(w["model.layers.0.mlp.up_proj.weight"].float().std().item() - 0.25) < 0.01
    norm = w["model.norm.weight"].float()
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.0 < norm.std().item() < 0.3  # 1 + small noise


def test_vocab_size_default_and_limits(tmp_path):
    assert read_weights(build_checkpoint(tmp_path / "a"))["lm_head.weight"].shape[0] == 512  # 512 ids, already x64
    assert read_weights(build_checkpoint(tmp_path / "b", vocab_size=640))["lm_head.weight"].shape[0] == 640
    with pytest.raises(ValueError, match="smaller than the tokenizer's 512 ids"):
        build_checkpoint(tmp_path / "c", vocab_size=500)


def test_bad_arguments_are_clear(tmp_path):
    with pytest.raises(ValueError, match="arch must be one of"):
        build_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="tokenizer kind"):
        build_tokenizer(tmp_path, "wordpiece")
    with pytest.raises(ValueError, match="must be at least 258"):
        build_tokenizer(tmp_path, "bpe", vocab_size=200)
    with pytest.raises(ValueError, match="always has q/k/v biases"):
        build_checkpoint(tmp_path, "qwen2", attention_bias=False)
