"""Phi-3: greedy tokens equal transformers' `generate` (fp32) with the fused qkv and
gate_up checkpoint tensors, GQA, mixed prompt lengths in one fused batch, chunked
prefill, partial rotary, and LongRoPE with prompts on both sides of its switch."""
import pytest
import transformers

from checkpoints import make_hf_checkpoint
from test_loader import edit_config
from test_engine_equality import MAX_TOKENS, PROMPTS, check_equal
from test_scheduler import make, run_step
from fusegen.engine.block_manager import BlockManager
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.scheduler import Scheduler
from fusegen.engine.tokenizer import Tokenizer

ORIGINAL = 32  # original_max_position_embeddings of the LongRoPE checkpoints


def longrope(partial: float = 1.0, head_dim: int = 16) -> dict:
    """rope_parameters with short and long factors far apart, so that a token rotated
    by the wrong list changes the tokens."""
    half = int(head_dim * partial) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 3.0 * i for i in range(half)]}


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3", "bpe", seed=1)


def check_fused_and_chunked(model_dir):
    """Token-exact with every prompt prefilled in one fused step, then with the
    prompts prefilled 8 tokens a step beside other requests' decodes."""
    outs, stats = check_equal(model_dir)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert stats["num_steps"] == MAX_TOKENS
    _, stats = check_equal(model_dir, max_num_batched_tokens=8, block_size=4)
    assert stats["num_steps"] > MAX_TOKENS * 2


def test_fused_batch_and_chunked_prefill_equal_transformers(phi3_dir):
    check_fused_and_chunked(phi3_dir)


@pytest.mark.parametrize("overrides", [
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}),
    dict(sliding_window=6, num_key_value_heads=1),
])
def test_config_variants_equal_transformers(tmp_path, overrides):
    model_dir = make_hf_checkpoint(tmp_path, "phi3", "bpe", seed=2, **overrides)
    check_equal(model_dir, prompts=PROMPTS[1:4], max_num_batched_tokens=16)


# transformers' generate recomputes the cache when a request grows past the original
# length (as fusegen's scheduler does) only from 5.20 on: before, its prepare step
# dropped the cache but still fed one token, so its continuation past the switch is
# not a reference.
RECOMPUTES_AT_THE_SWITCH = pytest.mark.skipif(
    tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 20),
    reason="transformers < 5.20 does not recompute at the LongRoPE switch")


@RECOMPUTES_AT_THE_SWITCH
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_on_both_sides_of_the_switch(tmp_path, partial):
    model_dir = make_hf_checkpoint(tmp_path, "phi3", "bpe", seed=3,
                                   rope_parameters=longrope(partial),
                                   original_max_position_embeddings=ORIGINAL)
    # Prompts shorter than the original length (their generation crosses it: the
    # switch happens mid-request) and longer (the long factors from the first token).
    prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[1], PROMPTS[3]]
    lengths = [len(Tokenizer.from_dir(model_dir).encode(p)) for p in prompts]
    assert max(lengths[:2]) <= ORIGINAL < min(lengths[2:]) and min(lengths) + 40 > ORIGINAL
    check_equal(model_dir, prompts=prompts, max_tokens=40)
    # Chunks of 16 tokens: a long prompt's first chunks lie below the original length
    # but still take the long factors, as the whole prompt does in transformers.
    check_equal(model_dir, prompts=prompts, max_tokens=40, max_num_batched_tokens=16)


def test_scheduler_recomputes_a_request_growing_past_the_switch():
    # 6 prompt tokens, switch at 8: the request decodes to 8 tokens, then the step that
    # makes it 9 sends it back to compute all 9 in the blocks it holds, then decodes on.
    scheduler = Scheduler(BlockManager(num_blocks=8, block_size=4), max_num_seqs=4,
                          max_num_batched_tokens=64, max_model_len=64, recompute_at=8)
    scheduler.add(make(0, 6, max_tokens=10))
    scheduled = []
    for _ in range(6):
        batch, _ = run_step(scheduler)
        scheduled.append(batch.num_scheduled_tokens[0])
    request = batch.requests[0]
    assert scheduled == [6, 1, 1, 9, 1, 1] and request.num_tokens == 12
    assert request.block_table == [0, 1, 2]  # no block taken or given back


def test_longrope_attention_factor_from_config(tmp_path):
    rope = longrope() | {"attention_factor": 0.8}
    model_dir = make_hf_checkpoint(tmp_path, "phi3", "bpe", seed=4, rope_parameters=rope,
                                   original_max_position_embeddings=ORIGINAL)
    assert ModelConfig.from_dir(model_dir).rope_scaling["attention_factor"] == 0.8
    check_equal(model_dir, prompts=[PROMPTS[3]], max_tokens=8)


@pytest.mark.parametrize("changes, key", [
    (dict(rope_parameters=longrope() | {"short_factor": [1.0, 2.0]}), "short_factor"),
    (dict(rope_parameters=longrope() | {"long_factor": None}), "long_factor"),
    # 16 * 0.3125: an odd rotary width
    (dict(rope_parameters=longrope() | {"partial_rotary_factor": 0.3125}),
     "partial_rotary_factor"),
])
def test_config_errors_name_the_key(phi3_dir, tmp_path, changes, key):
    model_dir = tmp_path / "edited"
    model_dir.mkdir()
    (model_dir / "config.json").write_text((phi3_dir / "config.json").read_text())
    edit_config(model_dir, **changes)
    with pytest.raises(ModelLoadError, match=key):
        ModelConfig.from_dir(model_dir)


def test_longrope_turns_prefix_caching_off(tmp_path):
    # A LongRoPE request's keys depend on its whole length (the factors switch at the
    # original length and the request is recomputed), so blocks shared between requests
    # could hold keys rotated with the other factors: the engine does not cache them.
    from fusegen.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for rope, cached in ((longrope(), False), (None, True)):
        extra = dict(rope_parameters=rope, original_max_position_embeddings=ORIGINAL) \
            if rope else {}
        model_dir = make_hf_checkpoint(tmp_path / str(cached), "phi3", "bpe", seed=3, **extra)
        with LLM(str(model_dir), dtype="float32") as llm:
            assert (llm.engine.scheduler.block_manager.cache is not None) == cached
            llm.generate([PROMPTS[3], PROMPTS[3]], params, use_tqdm=False)
            assert (llm.stats()["prompt_tokens_cached"] > 0) == cached
