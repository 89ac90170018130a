"""Asynchronous scheduling (engine/llm_engine.py): step N+1 scheduled and submitted while
step N runs. Every output is token-exact with the synchronous loop's, no discarded token
shows or counts, and every KV block is free at the end."""
import json
from types import SimpleNamespace

import pytest

from checkpoints import make_hf_checkpoint
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.block_manager import BlockManager
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.llm_engine import _async_scheduling
from fusegen.engine.options import EngineOptions
from fusegen.engine.request import PLACEHOLDER, Request
from fusegen.engine.scheduler import Scheduler

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog.",
           "Bonjour, comment allez-vous ?", "1 2 3 4 5 6 7 8 9 10", "a",
           "In the beginning the universe was created. This has made a lot of people "
           "very angry and been widely regarded as a bad move."]


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run(model_dir, prompts, params, async_scheduling, **options):
    """(outputs as plain tuples, stats, submitted placeholders, free blocks at the end)."""
    with LLM(str(model_dir), dtype="float32", async_scheduling=async_scheduling,
             **options) as llm:
        engine = llm.engine
        assert engine.async_scheduling is async_scheduling
        placeholders = []
        submit = engine.runner.submit
        engine.runner.submit = lambda batch: placeholders.append(
            sum(r.num_placeholders for r in batch.requests)) or submit(batch)
        outs = llm.generate(prompts, params)
        blocks = engine.block_manager
        assert blocks.num_free_blocks == blocks.num_blocks  # every block back
        # (a batch of finished requests' discarded tokens may still be in flight)
        assert engine.scheduler.num_unfinished == 0
        got = [(o.error, [(c.token_ids, c.finish_reason, c.text) for c in o.outputs])
               for o in outs]
        return got, llm.stats(), placeholders


def check_same(model_dir, prompts, params, **options):
    """The async run's outputs and counters equal the synchronous run's; it overlapped
    (some step ran a token still in flight)."""
    sync, sync_stats, none = run(model_dir, prompts, params, False, **options)
    overlapped, stats, placeholders = run(model_dir, prompts, params, True, **options)
    assert overlapped == sync
    assert sum(none) == 0 and sum(placeholders) > 0
    generated = sum(len(c[0]) for _, outs in sync for c in outs)
    assert stats["num_generated_tokens"] == sync_stats["num_generated_tokens"] == generated
    assert stats["num_finished"] == sync_stats["num_finished"]
    return sync, stats, sync_stats


def test_mixed_lengths_and_one_or_two_tokens(llama_dir):
    params = [greedy(m) for m in (1, 2, 7, 12, 3, 20)]
    outs, *_ = check_same(llama_dir, PROMPTS, params)
    assert [len(o[1][0][0]) for o in outs] == [1, 2, 7, 12, 3, 20]


def test_chunked_prefill(llama_dir):
    _, stats, _ = check_same(llama_dir, PROMPTS, [greedy(9)] * len(PROMPTS),
                          max_num_batched_tokens=8, block_size=4)
    assert stats["num_steps"] > 9 * 2


def test_eos_and_stop_token_ids(qwen2_dir):
    # eos where the model draws it, stop_token_ids on tokens the greedy run emits
    with LLM(str(qwen2_dir), dtype="float32", async_scheduling=False) as llm:
        full = [o.token_ids for o in llm.generate(PROMPTS, greedy(16))]
    params = [SamplingParams(max_tokens=40, temperature=0.0)] * 3 + [
        greedy(16, stop_token_ids=[full[i][3 + i]]) for i in range(3, len(PROMPTS))]
    outs, *_ = check_same(qwen2_dir, PROMPTS, params)
    reasons = [o[1][0][1] for o in outs]
    assert reasons[3:] == ["stop"] * 3
    assert [len(o[1][0][0]) for o in outs[3:]] == [full[i].index(full[i][3 + i]) + 1
                                                   for i in range(3, len(PROMPTS))]


def test_stop_strings(llama_dir):
    with LLM(str(llama_dir), dtype="float32", async_scheduling=False) as llm:
        texts = [o.text for o in llm.generate(PROMPTS, greedy(24))]
    stops = [[t[6:9]] if len(t) > 9 else ["\x00never"] for t in texts]
    outs, *_ = check_same(llama_dir, PROMPTS, [greedy(24, stop=s) for s in stops])
    assert sum(o[1][0][1] == "stop" for o in outs) >= 3


def test_seeded_sampling_and_n(llama_dir):
    params = [SamplingParams(max_tokens=10 + i, temperature=0.9, top_p=0.9, seed=100 + i,
                             n=2 if i % 2 else 1, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs, *_ = check_same(llama_dir, PROMPTS, params)
    assert [len(o[1]) for o in outs] == [1, 2] * 3


def test_structured_output_and_processors_wait_for_their_token(llama_dir):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=3, json_schema=schema),
              greedy(12, repetition_penalty=1.3), greedy(12, logprobs=2),
              greedy(12, min_tokens=5), greedy(14), greedy(2)]
    outs, *_ = check_same(llama_dir, PROMPTS, params)
    assert json.loads(outs[0][1][0][2])["n"] in range(100)


def test_preemption_with_a_small_kv_cache(mistral_sp_dir):
    # 12 blocks of 4 tokens (one 48-token context): three prompts of 13-18 tokens are
    # admitted, and growing by 12 tokens each they cannot all stay: some are preempted
    # (which and when differ: requests in flight wait for a block instead), recomputed
    prompts = [[5 + (7 * i + 3 * j) % 150 for j in range(13 + i)] for i in range(6)]
    _, stats, sync_stats = check_same(mistral_sp_dir, prompts, [greedy(12)] * len(prompts),
                                      num_kv_blocks=12, block_size=4, max_model_len=48,
                                      kv_placement="device")
    assert stats["num_preemptions"] > 0 and sync_stats["num_preemptions"] > 0


def test_prefix_caching(llama_dir):
    shared = "You are a helpful assistant. Answer in one short sentence, please. "
    prompts = [shared + p for p in PROMPTS]
    _, stats, sync_stats = check_same(llama_dir, prompts, [greedy(8)] * len(prompts),
                                      block_size=4)
    assert stats["prompt_tokens_cached"] == sync_stats["prompt_tokens_cached"] > 0


def test_deterministic_mode(tmp_path_factory):
    model_dir = make_hf_checkpoint(tmp_path_factory.mktemp("det"), "llama", "bpe",
                                   hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2)
    params = [SamplingParams(max_tokens=8, temperature=0.8 if i % 2 else 0.0, seed=i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    check_same(model_dir, PROMPTS, params, deterministic=True, max_num_batched_tokens=16)


def test_option_checked_and_auto_off_on_cpu(llama_dir):
    with pytest.raises(EngineConfigError, match="async_scheduling must be true, false"):
        EngineOptions(async_scheduling="yes")
    with LLM(str(llama_dir), dtype="float32", device="cpu") as llm:
        assert llm.engine.async_scheduling is False


@pytest.mark.parametrize("asked, device, group, longrope, want", [
    (None, "cuda:0", False, False, False), (None, "cpu", False, False, False),
    (None, "cuda", True, False, False), (None, "cuda", False, True, False),
    (True, "cpu", False, False, True), (False, "cuda", False, False, False),
    (True, "cuda", True, False, "a device group .*keeps its own batches"),
    (True, "cpu", False, True, "the model's rotary factors .*LongRoPE")])
def test_option_resolved_per_runner(asked, device, group, longrope, want):
    config = SimpleNamespace(options=SimpleNamespace(async_scheduling=asked), device=device)
    runner = SimpleNamespace(supports_async_scheduling=not group,
                             uses_request_lengths=longrope)
    if isinstance(want, str):
        with pytest.raises(EngineConfigError, match=f"async_scheduling=True cannot run "
                                                    f"here: {want}"):
            _async_scheduling(config, runner, 0)
    else:
        assert _async_scheduling(config, runner, 0) is want


# -- the scheduler alone: plain integers ---------------------------------------------------

def _scheduler(num_blocks=16, eos=frozenset(), max_tokens=8):
    sched = Scheduler(BlockManager(num_blocks, block_size=4), max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=64, overlap=True)
    req = Request(0, [1, 2, 3], SamplingParams(max_tokens=max_tokens, temperature=0.0), eos)
    sched.add(req)
    return sched, req


def _submit(sched):
    batch = sched.schedule()
    for r in batch.requests:
        r.num_in_flight += 1
    sched.advance(batch)
    return batch


def test_placeholder_filled_then_the_extra_token_discarded():
    sched, req = _scheduler(eos=frozenset({9}))
    first = _submit(sched)  # the prompt: 3 tokens, samples output 1
    assert req.token_ids == [1, 2, 3, PLACEHOLDER] and req.num_computed_tokens == 3
    second = _submit(sched)  # output 1 runs before it is known
    assert second.num_scheduled_tokens == [1] and req.num_computed_tokens == 4
    assert req.token_ids == [1, 2, 3, PLACEHOLDER, PLACEHOLDER]
    assert sched.update(first, [5]) == [] and req.token_ids == [1, 2, 3, 5, PLACEHOLDER]
    third = _submit(sched)
    assert sched.update(second, [9]) == [req]  # eos: third's token is discarded
    assert (req.token_ids, req.finish_reason) == ([1, 2, 3, 5, 9], "stop")
    assert sched.block_manager.num_free_blocks == 16
    assert sched.update(third, [4]) == [] and req.token_ids == [1, 2, 3, 5, 9]
    assert (first.num_generated, second.num_generated, third.num_generated) == (1, 1, 0)
    assert not req.in_flight and not sched.schedule()


def test_no_step_past_max_tokens():
    sched, req = _scheduler(max_tokens=2)
    first, second = _submit(sched), _submit(sched)
    assert not sched.schedule()  # its second token, in flight, is its last
    sched.update(first, [5])
    assert sched.update(second, [6]) == [req] and req.output_token_ids == [5, 6]
    assert req.finish_reason == "length" and sched.block_manager.num_free_blocks == 16


def test_a_request_in_flight_waits_for_a_block_instead_of_preempting():
    # 2 blocks of 4: the prompt of 3 and its first output fill block 0 and ...
    sched = Scheduler(BlockManager(2, block_size=4), max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=64, overlap=True)
    old = Request(0, [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    new = Request(1, [4, 5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0))
    sched.add(old)
    sched.add(new)
    first = _submit(sched)  # both prompts: one block each
    assert [r.block_table for r in (old, new)] == [[0], [1]]
    second = _submit(sched)  # old's output 1 fits block 0; new's needs a block: none
    assert second.requests == [old] and second.num_deferred == 1
    assert sched.running == [old, new] and new.num_preemptions == 0
    sched.update(first, [8, 9])
    sched.update(second, [10])
    third = _submit(sched)  # new is back: the newest, preempted to make room for old
    assert (old.num_preemptions, new.num_preemptions) == (0, 1)
    assert third.requests == [old] and new.token_ids == [4, 5, 6, 7, 9]


def test_abort_in_flight_drops_the_placeholders_and_frees_the_blocks():
    sched, req = _scheduler()
    first, second = _submit(sched), _submit(sched)
    sched.finish([req], "abort")
    assert (req.token_ids, req.num_placeholders) == ([1, 2, 3], 0)
    assert sched.block_manager.num_free_blocks == 16
    assert sched.update(first, [5]) == [] == sched.update(second, [6])
    assert req.token_ids == [1, 2, 3] and not req.in_flight
    assert first.num_generated == second.num_generated == 0


def test_a_request_that_waits_for_its_token_is_not_advanced_at_submit():
    # logprobs: the step writes them into the request, so it runs once per token
    sched = Scheduler(BlockManager(16, block_size=4), max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=64, overlap=True)
    waits = Request(0, [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, logprobs=1))
    goes = Request(1, [4, 5], SamplingParams(max_tokens=8, temperature=0.0))
    sched.add(waits)
    sched.add(goes)
    first = _submit(sched)
    assert (waits.num_computed_tokens, waits.token_ids) == (0, [1, 2, 3])
    assert (goes.num_computed_tokens, goes.token_ids) == (2, [4, 5, PLACEHOLDER])
    second = _submit(sched)
    assert second.requests == [goes]
    sched.update(first, [7, 8])
    assert (waits.num_computed_tokens, waits.token_ids) == (3, [1, 2, 3, 7])
    assert goes.token_ids == [4, 5, 8, PLACEHOLDER]
    third = _submit(sched)
    assert third.requests == [waits, goes] and third.num_scheduled_tokens == [1, 1]
