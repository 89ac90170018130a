"""Mixtral and Qwen3-MoE: greedy tokens equal transformers' `generate` (fp32) with top-2
of 4 experts, GQA, mixed prompt lengths in one fused batch, chunked prefill, streamed
expert layers, and router ties broken as transformers' `torch.topk` breaks them."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import load_hf, make_hf_checkpoint
from test_engine_deterministic import recorded  # noqa: F401 - the fixture
from test_loader import edit_config
from test_engine_equality import PROMPTS, check_equal
from test_models_phi3 import check_fused_and_chunked
from test_offload import budget_for
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.tokenizer import Tokenizer
from fusegen.engine.weights.loader import fuse, load_state_dict

# Top-2 of 4 experts, 4 query heads over 2 KV heads; Qwen3-MoE's experts narrower
# than its (unused) dense intermediate size.
MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      head_dim=16, norm_topk_prob=True),
}
ROUTER = {"mixtral": "block_sparse_moe.gate.weight", "qwen3_moe": "mlp.gate.weight"}


@pytest.fixture(scope="module", params=list(MOE))
def moe_dir(request, tmp_path_factory):
    arch = request.param
    return make_hf_checkpoint(tmp_path_factory.mktemp(arch), arch, "bpe", seed=2, **MOE[arch])


def test_fused_batch_and_chunked_prefill_equal_transformers(moe_dir):
    check_fused_and_chunked(moe_dir)


@pytest.mark.parametrize("arch, host", [("mixtral", "1GiB"), ("qwen3_moe", 0)])
def test_streamed_expert_layers_equal_transformers(tmp_path, arch, host):
    # Three of four layers stream (from pinned host memory, or the memory-mapped
    # checkpoint): each one's stacked experts travel as one unit through the slots.
    model_dir = make_hf_checkpoint(tmp_path, arch, "bpe", seed=3, num_hidden_layers=4,
                                   **MOE[arch])
    limits = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    with LLM(str(model_dir), dtype="float32", **limits) as llm:
        sizes = llm.placement.sizes
    options = limits | dict(device_memory=budget_for(sizes, 1), host_memory=host)
    with LLM(str(model_dir), dtype="float32", **options) as llm:
        assert llm.placement.layer_tiers == ["device"] + ["host" if host else "disk"] * 3
    check_equal(model_dir, prompts=PROMPTS[:4], **options)


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3_moe", dict(norm_topk_prob=False, num_key_value_heads=1)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=6)),
    ("mixtral", dict(sliding_window=6, num_key_value_heads=1, rope_theta=1e4)),
])
def test_config_variants_equal_transformers(tmp_path, arch, overrides):
    model_dir = make_hf_checkpoint(tmp_path, arch, "bpe", seed=4, **(MOE[arch] | overrides))
    check_equal(model_dir, prompts=PROMPTS[1:4], max_num_batched_tokens=16)


def tie_router(model_dir, arch):
    """Experts 1 and 2 get the same router row in every layer, so they score equally
    for every token; transformers' `torch.topk` then picks one of them whenever they
    straddle the top-2 boundary."""
    path = model_dir / "model.safetensors"
    state = load_file(path)
    for name, weight in state.items():
        if name.endswith(ROUTER[arch]):
            weight[2] = weight[1]
    save_file(state, path, metadata={"format": "pt"})


def hf_routes(model_dir, arch, prompt_ids):
    """transformers' router probabilities and chosen experts, [tokens, 4] and [tokens, 2]
    per layer, for one prompt."""
    model, seen = load_hf(model_dir), []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == model.config.num_hidden_layers
    hooks = [r.register_forward_hook(lambda _m, _i, out: seen.append(out)) for r in routers]
    with torch.no_grad():
        model(torch.tensor([prompt_ids]))
    for hook in hooks:
        hook.remove()
    return [(logits.float().softmax(-1), chosen) for logits, _, chosen in seen]


@pytest.mark.parametrize("arch", list(MOE))
def test_router_ties_broken_as_transformers(tmp_path, arch):
    model_dir = make_hf_checkpoint(tmp_path, arch, "bpe", seed=6, **MOE[arch])
    tie_router(model_dir, arch)
    # On the CPU, where transformers runs here: torch.topk breaks ties its own way on
    # each device (the CUDA test below compares on the GPU).
    outs, _ = check_equal(model_dir, device="cpu")
    # The ties happened and mattered: for some token routed above, exactly one expert
    # scored above the tied pair and topk kept expert 2, where "lowest index first"
    # would have kept expert 1.
    tokenizer, kept = Tokenizer.from_dir(model_dir), []
    for prompt, out in zip(PROMPTS, outs):
        routed = tokenizer.encode(prompt) + out.token_ids[:-1]
        for probs, chosen in hf_routes(model_dir, arch, routed):
            assert torch.equal(probs[:, 1], probs[:, 2])
            straddles = (probs > probs[:, 1:2]).sum(-1) == 1
            kept += chosen[straddles].tolist()
    assert any(2 in pair and 1 not in pair for pair in kept)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", list(MOE))
def test_router_ties_on_a_gpu_broken_as_transformers_there(tmp_path, arch):
    model_dir = make_hf_checkpoint(tmp_path, arch, "bpe", seed=6, **MOE[arch])
    tie_router(model_dir, arch)
    model = load_hf(model_dir).to("cuda")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    try:
        with LLM(str(model_dir), dtype="float32", device="cuda") as llm:
            for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
                ids = torch.tensor([llm.tokenizer.encode(prompt)], device="cuda")
                want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=12, pad_token_id=0, eos_token_id=None)
                assert out.token_ids == want[0, ids.shape[1]:].tolist(), prompt
    finally:
        model.to("cpu")  # the cached reference stays on the CPU for the other tests


@pytest.mark.parametrize("arch", list(MOE))
def test_moe_layer_equals_transformers_bit_for_bit(tmp_path, arch):
    """One layer's experts on the same hidden states, with tied router rows: the same
    routing and the same sums, rounded in the same order."""
    model_dir = make_hf_checkpoint(tmp_path, arch, "bpe", seed=8, **MOE[arch])
    tie_router(model_dir, arch)
    cfg = ModelConfig.from_dir(model_dir)
    family = get_architecture(cfg.architecture)
    layer = family.build_model(cfg).layers[0]
    state = load_state_dict(model_dir, cfg)
    layer.set_weights(fuse(family.layer_sources(state, 0, cfg), "cpu", torch.float32))
    hf_block = load_hf(model_dir).model.layers[0].mlp
    x = torch.randn(97, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_block(x[None])[0]
    assert torch.equal(layer._mlp(x), want)


def test_deterministic_mode_is_batch_invariant(moe_dir, recorded):
    # Each request's logits bit-identical alone and inside a batch of all of them.
    prompts = PROMPTS * 3
    params = [SamplingParams(max_tokens=4, temperature=0.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    with LLM(str(moe_dir), dtype="float32", deterministic=True) as llm:
        alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, params)]
        alone_logits = {seed: torch.stack(rows) for seed, rows in recorded.items()}
        recorded.clear()
        together = [o.token_ids for o in llm.generate(prompts, params)]
    assert alone == together
    assert alone_logits.keys() == recorded.keys()
    for seed, rows in recorded.items():
        assert torch.equal(alone_logits[seed], torch.stack(rows)), f"request {seed}"


@pytest.mark.parametrize("arch, changes, key", [
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
    ("qwen3_moe", dict(num_experts_per_tok=5), "num_experts_per_tok"),
    ("mixtral", dict(num_local_experts=0), "num_local_experts"),
])
def test_config_errors_name_the_key(tmp_path, arch, changes, key):
    model_dir = make_hf_checkpoint(tmp_path, arch, "bpe", **MOE[arch])
    edit_config(model_dir, **changes)
    with pytest.raises(ModelLoadError, match=key):
        ModelConfig.from_dir(model_dir)
