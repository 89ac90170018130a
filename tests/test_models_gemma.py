"""Gemma 2 and Gemma 3 text models: token-exact greedy equality with transformers on
tiny random checkpoints (norm weights drawn at random around Gemma's 1 + w), checks
that their soft-caps, sliding windows and local rotary base decide tokens, Gemma's
norm arithmetic in bf16, the real Gemma 3 270M config, and config.json errors."""
import json
import shutil

import pytest
import torch

from checkpoints import hf_greedy, make_hf_checkpoint
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.models.gemma import gelu_tanh_and_mul, gemma_rms_norm
from fusegen.engine.models.rope import cos_sin_tables
from test_engine_equality import MAX_TOKENS, PROMPTS, check_equal

transformers = pytest.importorskip("transformers")

SLIDING, FULL = "sliding_attention", "full_attention"
# Small caps that bite: pre-cap scores and logits reach 4-6 in these checkpoints.
GEMMA2 = dict(head_dim=16, sliding_window=6, attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0, query_pre_attn_scalar=24, tie_word_embeddings=False)
GEMMA3 = dict(head_dim=32, sliding_window=6, layer_types=[SLIDING, FULL],
              rope_parameters={FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                               SLIDING: {"rope_type": "default", "rope_theta": 1e4}})


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    # GQA (4 on 2), layers 0 sliding (window 6) and 1 global, prompts up to 40 tokens
    return make_hf_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2", "bpe", seed=1,
                              **GEMMA2)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    # local base 1e4 on the sliding layer, 1e6 with linear scaling on the global one, tied
    return make_hf_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", "bpe", seed=1,
                              **GEMMA3)


@pytest.mark.parametrize("fixture", ["gemma2_dir", "gemma3_dir"])
def test_fused_batch_equals_transformers(fixture, request):
    outs, stats = check_equal(request.getfixturevalue(fixture))
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert stats["num_steps"] == MAX_TOKENS  # every prompt prefilled in one fused step


@pytest.mark.parametrize("fixture", ["gemma2_dir", "gemma3_dir"])
def test_chunked_prefill_equals_transformers(fixture, request):
    _, stats = check_equal(request.getfixturevalue(fixture), max_num_batched_tokens=8,
                           block_size=4)
    assert stats["num_steps"] > MAX_TOKENS * 2


def test_deterministic_mode_equals_transformers(gemma2_dir):
    check_equal(gemma2_dir, prompts=PROMPTS[1:4], deterministic=True, max_num_batched_tokens=8)


@pytest.mark.parametrize("host", [2**30, 0], ids=["host", "disk"])
def test_streamed_layers_equal_transformers(tmp_path, host):
    # Layers 2-5 stream in every step (their norms made 1 + w again each time).
    from fusegen.engine import LLM
    from test_offload import budget_for

    model_dir = make_hf_checkpoint(tmp_path, "gemma3", "bpe", seed=4, **GEMMA3 | dict(
        num_hidden_layers=6, layer_types=[SLIDING, FULL] * 3))
    with LLM(str(model_dir), dtype="float32") as llm:
        sizes = llm.placement.sizes
    options = dict(device_memory=budget_for(sizes, 2), host_memory=host)
    with LLM(str(model_dir), dtype="float32", **options) as llm:
        assert llm.placement.layer_tiers == ["device"] * 2 + ["host" if host else "disk"] * 4
    check_equal(model_dir, prompts=PROMPTS[1:4], **options)


@pytest.mark.parametrize("arch, overrides", [
    # one KV head per query head, head tied to the embedding, a cap of 0.5 on the logits
    ("gemma2", dict(head_dim=32, num_key_value_heads=4, sliding_window=4,
                    attn_logit_softcapping=8.0, final_logit_softcapping=0.5,
                    query_pre_attn_scalar=32)),
    # one KV head, biases, two sliding layers to a global one, capped logits
    ("gemma3", dict(head_dim=32, num_key_value_heads=1, num_hidden_layers=3, attention_bias=True,
                    sliding_window=5, sliding_window_pattern=3, final_logit_softcapping=0.5)),
], ids=["gemma2_mha_tied", "gemma3_mqa_bias_capped"])
def test_config_variants_equal_transformers(tmp_path, arch, overrides):
    model_dir = make_hf_checkpoint(tmp_path, arch, "bpe", seed=2, **overrides)
    check_equal(model_dir, prompts=PROMPTS[1:5], max_num_batched_tokens=16, block_size=4)


@pytest.mark.parametrize("fixture, changes", [
    ("gemma2_dir", dict(attn_logit_softcapping=None)),
    ("gemma2_dir", dict(layer_types=[FULL, FULL])),
    ("gemma3_dir", dict(rope_parameters={**GEMMA3["rope_parameters"],
                                         SLIDING: {"rope_type": "default", "rope_theta": 1e6}})),
], ids=["attn_softcap", "sliding_window", "local_rope_base"])
def test_each_feature_decides_tokens(fixture, changes, request, tmp_path):
    # transformers itself continues differently without it: the equality tests above
    # would catch fusegen dropping it. (The final cap is monotonic: greedy tokens never
    # show it; test_capped_logits_equal_transformers does.)
    model_dir = request.getfixturevalue(fixture)
    other = shutil.copytree(model_dir, tmp_path / "other")
    config = json.loads((other / "config.json").read_text()) | changes
    (other / "config.json").write_text(json.dumps(config))
    prompts = [list(range(5, 45)), list(range(100, 125)), list(range(200, 233))]
    assert any(hf_greedy(model_dir, p, MAX_TOKENS) != hf_greedy(other, p, MAX_TOKENS)
               for p in prompts)


def test_capped_logits_equal_transformers(gemma2_dir, monkeypatch):
    # The logits the sampler sees, against transformers' for the same prompt: capped at
    # 3.0 where transformers' uncapped ones pass it.
    from fusegen.engine import LLM, SamplingParams
    from fusegen.engine.sampler import Sampler

    seen = []
    sample = Sampler.__call__
    monkeypatch.setattr(Sampler, "__call__", lambda self, logits, batch:
                        seen.append(logits) or sample(self, logits, batch))
    prompt = list(range(5, 45))
    with LLM(str(gemma2_dir), dtype="float32") as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    # eager attention: some transformers releases drop the score cap under SDPA
    model = transformers.AutoModelForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
        model.config.final_logit_softcapping = None
        uncapped = model(torch.tensor([prompt])).logits[0, -1]
    assert uncapped.abs().max() > 4.0 and expected.abs().max() < 3.0
    torch.testing.assert_close(seen[0][0].cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "qwen3"])
def test_synthetic_checkpoint_loads_in_transformers(tmp_path, arch):
    # fusegen's own builder (demo, bench) writes these architectures as transformers does
    from fusegen.engine.models.synthetic import build_checkpoint

    model_dir = build_checkpoint(tmp_path, arch, init_std=0.2)
    _, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                                output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # no missing or unexpected keys
    check_equal(model_dir, prompts=PROMPTS[1:3])


def test_engine_through_triton_interpreter(gemma2_dir):
    # Every kernel through Triton in its interpreter on CPU tensors (the attention's
    # soft-cap inside the kernel), token-identical to transformers.
    pytest.importorskip("triton")
    from test_triton_engine import test_engine_through_triton_interpreter as through_triton

    through_triton(gemma2_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_and_geglu_match_transformers_bit_for_bit(dtype):
    # The 1 + w taken once at load, in fp32, then Gemma's one rounding after the product.
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP, Gemma3RMSNorm

    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))
    norm = Gemma3RMSNorm(96, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(96, generator=gen).to(dtype)
    weight = 1.0 + norm.weight.data.float()
    with torch.no_grad():
        assert torch.equal(gemma_rms_norm(x, weight, 1e-6), norm(x))
        out, h = gemma_rms_norm(x, weight, 1e-6, residual=residual)
        assert torch.equal(h, residual + x) and torch.equal(out, norm(residual + x))
        # torch's vectorised gelu and its scalar tail differ in the last bit: equal where
        # the intermediate size is a multiple of the vector loop (16), as in every Gemma
        config = transformers.Gemma3TextConfig(hidden_size=96, intermediate_size=48)
        mlp = Gemma3MLP(config).to(dtype)
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        assert torch.equal(mlp.down_proj(gelu_tanh_and_mul(gate_up)), mlp(x))


def gemma3_270m_config() -> dict:
    """google/gemma-3-270m's config.json as published (transformers 4 keys, no
    layer_types: the sliding pattern says)."""
    return {
        "_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False, "attn_logit_softcapping": None, "bos_token_id": 2,
        "eos_token_id": 1, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640,
        "intermediate_size": 2048, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 18,
        "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": 512, "torch_dtype": "bfloat16",
        "use_bidirectional_attention": False, "vocab_size": 262144,
    }


def test_gemma3_270m_config_builds_as_transformers_reads_it():
    from transformers.models.gemma3.modeling_gemma3 import (Gemma3DecoderLayer,
                                                            Gemma3RotaryEmbedding)

    raw = gemma3_270m_config()
    reference = transformers.Gemma3TextConfig(**raw)
    cfg = ModelConfig.from_dict(raw)
    # transformers 5 writes the same model with per-layer-type rope_parameters
    written = reference.to_dict() | {"architectures": raw["architectures"]}
    assert ModelConfig.from_dict(written) == cfg
    windows = [cfg.layer_window(i) for i in range(18)]
    assert windows == [512 if t == SLIDING else 0 for t in reference.layer_types]
    assert windows == ([512] * 5 + [0]) * 3
    assert (cfg.head_dim, cfg.attn_scale) == (256, 1 / 16)
    assert cfg.attn_softcap == cfg.final_softcap == 0
    assert cfg.tie_word_embeddings and (cfg.vocab_size, cfg.num_kv_heads) == (262144, 1)
    # transformers' Gemma 3 never caps attention scores, whatever config.json says
    assert ModelConfig.from_dict(raw | {"attn_logit_softcapping": 50.0}).attn_softcap == 0

    arch = get_architecture("Gemma3ForCausalLM")
    model = arch.build_model(cfg)
    assert [layer.sliding_window for layer in model.layers] == windows
    assert [layer.rope_index for layer in model.layers] == [int(w > 0) for w in windows]
    hf_layer = Gemma3DecoderLayer(reference, 0)
    assert arch.layer_numel(cfg) == sum(p.numel() for p in hf_layer.parameters())
    names = {k.removeprefix("model.layers.0."): v for k, v in arch.checkpoint_shapes(cfg).items()
             if k.startswith("model.layers.0.")}
    assert names == {k: tuple(v.shape) for k, v in hf_layer.state_dict().items()}

    # Both rotary tables as transformers computes them: [positions, cos halves | sin halves]
    tables = cos_sin_tables(cfg, 64, torch.float32, "cpu")
    rotary = Gemma3RotaryEmbedding(reference)
    positions = torch.arange(64)[None]
    for table, layer_type in zip(tables, (FULL, SLIDING)):
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, layer_type)
        assert torch.equal(table, torch.cat([cos[0, :, :128], sin[0, :, :128]], dim=-1))


@pytest.mark.parametrize("arch, changes, message", [
    ("Gemma2ForCausalLM", dict(hidden_activation="gelu"),
     r"hidden_activation 'gelu' not supported"),
    ("Gemma2ForCausalLM", dict(use_bidirectional_attention=True),
     r"use_bidirectional_attention is true"),
    ("Gemma2ForCausalLM", dict(sliding_window=None),
     r"layer_types has sliding_attention layers but sliding_window is not set"),
    ("Gemma2ForCausalLM", dict(attn_logit_softcapping=0.0),
     r"attn_logit_softcapping must be positive or null, got 0.0"),
    ("Gemma3ForCausalLM", dict(layer_types=[SLIDING] * 3),
     r"layer_types must list one entry per layer \(2\)"),
    ("Gemma3ForCausalLM", dict(rope_parameters={FULL: {"rope_type": "yarn", "factor": 8.0}}),
     r"rope_parameters.full_attention type 'yarn' not supported"),
])
def test_config_errors_name_the_key(tmp_path, arch, changes, message):
    raw = {"architectures": [arch], "vocab_size": 448, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw | changes))
    with pytest.raises(ModelLoadError, match=f"config.json: {message}"):
        ModelConfig.from_dir(tmp_path)
