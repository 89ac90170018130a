"""Token-exact greedy equality with transformers `generate` (fp32): one prompt at a
time there, fused batches of mixed lengths here."""
import pytest

from checkpoints import hf_greedy, make_hf_checkpoint
from fusegen.engine import LLM, SamplingParams

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Bonjour, comment allez-vous aujourd'hui ? Très bien, merci.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
    "日本語のテキスト 🎉",
    "a",
    "In the beginning the universe was created. This has made a lot of people very "
    "angry and been widely regarded as a bad move.",
]
MAX_TOKENS = 12


def check_equal(model_dir, prompts=PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True,
                **engine_options):
    with LLM(str(model_dir), dtype="float32", **engine_options) as llm:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        outs = llm.generate(prompts, params)
        stats = llm.stats()
        for prompt, out in zip(prompts, outs):
            ids = llm.tokenizer.encode(prompt)
            assert out.error is None and out.num_prompt_tokens == len(ids)
            assert out.token_ids == hf_greedy(model_dir, ids, max_tokens, ignore_eos), prompt
    return outs, stats


@pytest.mark.parametrize("fixture", ["llama_dir", "mistral_sp_dir", "qwen2_dir"])
def test_fused_batch_equals_transformers(fixture, request):
    outs, stats = check_equal(request.getfixturevalue(fixture))
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in outs)
    assert stats["num_steps"] == MAX_TOKENS  # every prompt prefilled in one fused step


def test_chunked_prefill_equals_transformers(llama_dir):
    # 8 tokens a step: the long prompts are prefilled over several steps, mixed with
    # other requests' decodes.
    _, stats = check_equal(llama_dir, max_num_batched_tokens=8, block_size=4)
    assert stats["num_steps"] > MAX_TOKENS * 2


def test_preemption_equals_transformers(mistral_sp_dir):
    # 32 blocks of 4 tokens cannot hold all seven requests: some are preempted and
    # recomputed, and the tokens do not change.
    _, stats = check_equal(mistral_sp_dir, num_kv_blocks=32, block_size=4)
    assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("head", ["logits", "greedy"])
def test_logits_in_chunks_equal_transformers(llama_dir, monkeypatch, head):
    # Sampled rows through the LM head 3 at a time: 7 requests, 3 chunks per step; through
    # the logits and the sampler, or (greedy rows, fusegen's CPU GEMM) the head's argmax.
    from fusegen.engine import graphs, model_runner as runner
    from fusegen.engine.models.decoder import CausalLM
    from fusegen.engine.weights.packed import NativeLinear, _native_gemm
    monkeypatch.setattr(runner, "LOGITS_CHUNK", 3)
    monkeypatch.setattr(graphs, "LOGITS_CHUNK", 3)  # a CPU graph's head (greedy_head)
    calls = []
    if head == "logits":
        original = CausalLM.logits
        monkeypatch.setattr(CausalLM, "greedy_tokens", lambda *args: None)
        monkeypatch.setattr(CausalLM, "logits",
                            lambda self, x, r: calls.append(len(x)) or original(self, x, r))
    else:
        if not _native_gemm():
            pytest.skip("fp32 weights go to oneDNN on this CPU, which has no argmax head")
        original = NativeLinear.argmax
        monkeypatch.setattr(NativeLinear, "argmax",
                            lambda self, h: calls.append(len(h)) or original(self, h))
    check_equal(llama_dir)
    assert calls[:3] == [3, 3, 1] and max(calls) == 3


def test_eos_stops_like_transformers(qwen2_dir):
    outs, _ = check_equal(qwen2_dir, max_tokens=40, ignore_eos=False)
    assert {o.finish_reason for o in outs} <= {"stop", "length"}


@pytest.mark.parametrize("arch, overrides", [
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}, rope_theta=500.0)),
    ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("llama", dict(head_dim=32, attention_bias=True, mlp_bias=True)),
    ("qwen2", dict(num_key_value_heads=1, rope_theta=1e6)),
    ("mistral", dict(sliding_window=6, num_key_value_heads=4)),
])
def test_config_variants_equal_transformers(tmp_path, arch, overrides):
    model_dir = make_hf_checkpoint(tmp_path, arch, "bpe", seed=3, **overrides)
    check_equal(model_dir, prompts=PROMPTS[1:4], max_num_batched_tokens=16)


def test_sharded_checkpoint_loads(tmp_path):
    model_dir = make_hf_checkpoint(tmp_path, "llama", "sentencepiece", seed=5,
                                   max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    check_equal(model_dir, prompts=PROMPTS[:3])
