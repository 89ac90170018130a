"""Prefix caching: the block manager's cached blocks on plain integers (exact ids,
reference counts, eviction order, hash chaining, collisions), then token-exact greedy
generation with and without caching against transformers."""
import json
import random

import pytest

from checkpoints import hf_greedy
from fusegen.engine import LLM, SamplingParams, prefix_cache
from fusegen.engine.block_manager import BlockManager
from fusegen.engine.request import Request
from fusegen.engine.sampling_params import SamplingParams

SIZE = 4  # tokens per block


def make(request_id, tokens, max_tokens=4):
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens,
                                                            temperature=0.0))


def admit(bm, req):
    """What the scheduler does for a waiting request: take its cached blocks, allocate
    the rest of its prompt, mark it computed (the step ran)."""
    hits = bm.computed_blocks(req)
    n = req.num_tokens - len(hits) * SIZE
    assert bm.can_allocate(req, n, hits)
    bm.allocate(req, n, hits)
    req.num_computed_tokens += n
    return hits


def manager(num_blocks=8, **kwargs):
    return BlockManager(num_blocks, SIZE, enable_caching=True, cache_salt="m|fp32|4", **kwargs)


SHARED = list(range(100, 112))  # three full blocks


def test_second_request_reuses_leading_full_blocks_with_reference_counts():
    bm = manager()
    a, b = make(0, SHARED + [1, 2]), make(1, SHARED + [3])
    assert admit(bm, a) == [] and a.block_table == [0, 1, 2, 3]
    assert admit(bm, b) == [0, 1, 2] and b.block_table == [0, 1, 2, 4]
    assert b.num_computed_tokens == 13  # computed from 12, past the three cached blocks
    assert [bm.ref_count(i) for i in range(5)] == [2, 2, 2, 1, 1]
    assert bm.num_free_blocks == 3 and bm.num_used_blocks == 5


def test_whole_prompt_in_cache_still_computes_its_last_token():
    bm = manager()
    admit(bm, make(0, SHARED))
    again = make(1, SHARED)
    # 12 tokens = 3 full blocks, but the last token must run for logits: 2 blocks reused
    assert admit(bm, again) == [0, 1] and again.block_table == [0, 1, 3]


def test_freed_blocks_stay_cached_and_are_evicted_last_block_first():
    bm = manager(num_blocks=5)
    a = make(0, SHARED + [1, 2])
    admit(bm, a)  # blocks 0..3, of which 0, 1, 2 full and cached
    bm.free(a)
    # the partial block 3 is plain free; the cached ones wait, last block first
    assert list(bm._free) == [4, 3] and list(bm._evictable) == [2, 1, 0]
    assert bm.num_free_blocks == 5 and bm.num_cached_free_blocks == 3
    other = make(1, [7] * 13)  # 4 blocks, nothing shared: plain free ones go first
    admit(bm, other)
    assert other.block_table == [4, 3, 2, 1]  # then 2 and 1 are evicted, 0 stays
    assert list(bm._evictable) == [0]
    # the first block survived: a request with the same start still finds it
    assert bm.computed_blocks(make(2, SHARED[:4] + [5, 6])) == [0]
    assert bm.computed_blocks(make(3, SHARED + [9])) == [0]  # blocks 1, 2 were evicted


def test_hit_on_an_evictable_block_takes_it_off_the_free_count():
    bm = manager(num_blocks=4)
    a = make(0, SHARED + [1])
    admit(bm, a)
    bm.free(a)
    b = make(1, SHARED + [2, 3, 4, 5, 6])  # 3 cached blocks + 2 new: 5 > 4 blocks
    hits = bm.computed_blocks(b)
    assert hits == [0, 1, 2]
    assert not bm.can_allocate(b, 5, hits)  # 2 new + 3 evictable hits > 4 free
    assert bm.can_allocate(make(2, SHARED + [2]), 2, hits)  # 1 new + 3 hits == 4


def test_same_tokens_after_another_prefix_do_not_hit():
    bm = manager()
    admit(bm, make(0, [1, 2, 3, 4] + [5, 6, 7, 8] + [0]))
    # block 2's tokens equal, block 1's differ: the chained key differs, no hit at all
    assert bm.computed_blocks(make(1, [9, 9, 9, 9] + [5, 6, 7, 8] + [0])) == []
    assert bm.computed_blocks(make(2, [1, 2, 3, 4] + [5, 6, 7, 0] + [0])) == [0]


def test_salt_separates_caches():
    parent = b"\0" * 16
    key = prefix_cache.chain_hash(parent, (1, 2, 3, 4))
    assert key != prefix_cache.chain_hash(parent, (1, 2, 3, 5))
    assert key != prefix_cache.chain_hash(b"\1" * 16, (1, 2, 3, 4))
    a = prefix_cache.PrefixCache(4, SIZE, "model-a")
    b = prefix_cache.PrefixCache(4, SIZE, "model-b")
    a.register([0], [1, 2, 3, 4], 1)
    b.register([0], [1, 2, 3, 4], 1)
    assert a._key[0] != b._key[0]


def test_forced_hash_collision_never_hits(monkeypatch):
    # every block gets the same key: only the token and parent checks tell them apart
    monkeypatch.setattr(prefix_cache, "chain_hash", lambda parent, tokens: b"same")
    bm = manager()
    a = make(0, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    admit(bm, a)  # block 0 registered under b"same"; block 1 collides and stays private
    assert bm.computed_blocks(make(1, [5, 6, 7, 8, 0])) == []  # other tokens, same key
    assert bm.computed_blocks(make(2, [1, 2, 3, 4, 1, 2, 3, 4, 0])) == [0]  # block 1 differs
    bm.free(a)
    assert list(bm._evictable) == [0] and list(bm._free)[-2:] == [1, 2]  # 1 never cached


def test_collision_on_parent_identity_never_hits(monkeypatch):
    # Same tokens in block 1 after different block 0s, with every key equal per block
    # position: the parent check (a serial, never reused) must refuse the hit.
    monkeypatch.setattr(prefix_cache, "chain_hash", lambda parent, tokens: bytes([tokens[0]]))
    bm = manager()
    admit(bm, make(0, [1, 1, 1, 1, 5, 5, 5, 5, 0]))
    bm.cache.forget(0)  # block 0's entry gone, block 1's (parent: its serial) remains
    b = make(1, [1, 1, 1, 1, 5, 5, 5, 5, 0])
    assert bm.computed_blocks(b) == []
    admit(bm, b)  # recomputes block 0 into a new block with a new serial
    assert b.block_table[:2] == [3, 4]
    assert bm.computed_blocks(make(2, [1, 1, 1, 1, 5, 5, 5, 5, 0])) == [3]


def test_duplicate_content_borrows_the_registered_block_identity():
    # Two requests computing the same prefix side by side (neither cached before): the
    # second's blocks are duplicates; its later blocks still chain and register.
    bm = manager(num_blocks=12)
    a, b = make(0, SHARED + [1]), make(1, SHARED[:8] + [9, 9, 9, 9, 2])
    bm.allocate(a, 13)
    bm.allocate(b, 13)  # allocated without a lookup: blocks 4, 5 hold a copy of 0, 1
    assert b.block_table == [4, 5, 6, 7]
    assert bm.computed_blocks(make(2, SHARED[:8] + [9, 9, 9, 9, 3])) == [0, 1, 6]
    assert bm.num_cached_free_blocks == 0 and bm.cache.num_registered == 4  # 0, 1, 2, 6


def test_prompt_logprobs_requests_skip_the_cache(monkeypatch):
    bm = manager()
    admit(bm, make(0, SHARED + [1]))
    req = make(1, SHARED + [1])
    monkeypatch.setattr(req, "params", type("P", (), {"prompt_logprobs": 0})())
    assert bm.computed_blocks(req) == []


def test_caching_off_keeps_plain_fifo_ids():
    bm = BlockManager(6, SIZE)
    a = make(0, SHARED + [1])
    admit(bm, a)
    assert bm.computed_blocks(make(1, SHARED + [1])) == []
    bm.free(a)
    assert list(bm._free) == [4, 5, 0, 1, 2, 3] and bm.num_cached_free_blocks == 0


def test_swap_copies_and_shared_blocks_stay():
    bm = manager(num_host_blocks=4)
    a, b = make(0, SHARED + [1]), make(1, SHARED + [2])
    admit(bm, a)
    admit(bm, b)  # b: [0, 1, 2, 4]
    pairs = bm.swap_out(b)
    assert pairs == [(0, 0), (1, 1), (2, 2), (4, 3)]  # every block copied
    assert [bm.ref_count(i) for i in range(5)] == [1, 1, 1, 1, 0]  # a still holds 0..3
    assert b.block_table == [] and b.host_block_table == [0, 1, 2, 3]
    # back in: the shared blocks are still on the device, only the last block is copied
    assert bm.can_swap_in(b, 1)
    pairs = bm.swap_in(b, 1)
    assert pairs == [(3, 5)] and b.block_table == [0, 1, 2, 5]
    assert [bm.ref_count(i) for i in range(6)] == [2, 2, 2, 1, 0, 1]
    assert bm.num_free_host_blocks == 4


def test_reset_cache_forgets_every_block():
    bm = manager(num_blocks=5)
    a = make(0, SHARED + [1])
    admit(bm, a)
    bm.free(a)
    bm.reset_cache()
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 5
    assert bm.computed_blocks(make(1, SHARED + [1])) == []


# -- generation: token-exact with and without caching ---------------------------------

def _prompts():
    """Four prompts sharing a 37-token prefix (9 full blocks of 4), the prefix alone,
    and two unrelated prompts, interleaved."""
    rng = random.Random(3)
    ids = lambda k: [rng.randrange(3, 300) for _ in range(k)]  # noqa: E731
    shared = ids(37)
    sharing = [shared + ids(k) for k in (1, 5, 9, 3)]
    return [sharing[0], ids(11), sharing[1], sharing[2], ids(4), sharing[3], shared]


def _generate(model_dir, prompts, **options):
    with LLM(str(model_dir), dtype="float32", block_size=SIZE, **options) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=False)
        assert all(o.error is None for o in outs)
        return outs, llm.stats()


@pytest.fixture(scope="module")
def expected(llama_dir):
    return [hf_greedy(llama_dir, p, 8) for p in _prompts()]


def test_cached_prefix_tokens_equal_transformers_with_exact_counts(llama_dir, expected):
    prompts = _prompts()
    outs, stats = _generate(llama_dir, prompts)
    assert [o.token_ids for o in outs] == expected
    # one step admits all: the first prompt's 9 full blocks are recorded as they are
    # allocated and the others take them (the prefix alone too: its last token runs)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 36, 36, 0, 36, 36]
    assert stats["prompt_tokens_cached"] == 4 * 36
    assert stats["prompt_tokens_computed"] == sum(map(len, prompts)) - 4 * 36


def test_deterministic_mode_reads_cached_blocks_bit_for_bit(llama_dir, expected):
    # batch-invariant kernels: a block computed by another request holds the same bits
    # the request would have computed, so the tokens stay those of transformers
    outs, stats = _generate(llama_dir, _prompts(), deterministic=True,
                            max_num_batched_tokens=6)
    assert [o.token_ids for o in outs] == expected
    assert stats["prompt_tokens_cached"] == 4 * 36


@pytest.mark.parametrize("caching, host_blocks", [(True, 0), (False, 0), (True, 16)])
def test_chunked_and_preempted_equal_transformers_with_and_without_caching(
        llama_dir, expected, caching, host_blocks):
    # 6 tokens a step split blocks of 4 mid-prefill; 16 blocks cannot hold every
    # request: they are preempted and recomputed (from their cached blocks), or swapped.
    outs, stats = _generate(llama_dir, _prompts(), enable_prefix_caching=caching,
                            max_num_batched_tokens=6, num_kv_blocks=16, max_model_len=64,
                            num_host_kv_blocks=host_blocks, kv_placement="device",
                            host_memory="64MiB" if host_blocks else None)
    assert [o.token_ids for o in outs] == expected
    assert stats["num_preemptions"] > 0
    assert (stats["num_swapped_blocks"] > 0) == (host_blocks > 0)
    cached = [36 * caching * (i in (2, 3, 5, 6)) for i in range(7)]
    assert [o.num_cached_tokens for o in outs] == cached
    # recomputed requests find their own blocks again: more than the first admissions
    assert (stats["prompt_tokens_cached"] > sum(cached)) == (caching and not host_blocks)


@pytest.mark.parametrize("host_memory", ["1GiB", 0])
def test_streamed_layers_read_cached_blocks(tmp_path, host_memory):
    # Layers streamed through the memory pool (from host RAM, or from the memory-mapped
    # checkpoint) write and read the same KV blocks as resident ones: a cached prefix
    # serves them alike.
    from checkpoints import make_hf_checkpoint
    from test_offload import budget_for

    model_dir = make_hf_checkpoint(tmp_path, "llama", "bpe", seed=11, num_hidden_layers=6,
                                   max_position_embeddings=128)
    options = dict(dtype="float32", block_size=SIZE, max_num_seqs=8,
                   max_num_batched_tokens=64, max_model_len=128)
    with LLM(str(model_dir), **options) as llm:
        budget = budget_for(llm.placement.sizes, resident=2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), device_memory=budget, host_memory=host_memory, **options) as llm:
        tiers = llm.placement.layer_tiers
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        stats = llm.stats()
    assert tiers.count("device") == 2 and tiers.count("host" if host_memory else "disk") == 4
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, 8) for p in _prompts()]
    assert stats["prompt_tokens_cached"] == 4 * 36


# -- jobs: the option, the flag, the summary and the manifest -------------------------

def test_job_reports_cached_prompt_tokens_and_matches_uncached(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fusegen.jobs.driver import run_job
    from fusegen.jobs.spec import JobSpec
    from jobs_fixtures import read_output, tiny_model_dir

    instruction = "Label the sentiment of the review as positive or negative. " * 4
    prompts = [f"{instruction}Review {i}: {'good ' * (i % 3)}day" for i in range(10)]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")
    results = {}
    for caching in (True, False):
        out = tmp_path / f"out-{caching}"
        results[caching] = run_job(JobSpec(
            model=tiny_model_dir(), input=str(tmp_path / "in.parquet"), output=str(out),
            max_tokens=4, temperature=0.0, progress="none", enable_prefix_caching=caching,
            output_token_ids=True))
        manifest = json.loads((out / "_manifest.json").read_text())
        assert manifest["totals"]["prompt_tokens_cached"] == results[caching].prompt_tokens_cached
        [engine] = manifest["runs"][-1]["engine_stats"]
        assert engine["prompt_tokens_computed"] + engine["prompt_tokens_cached"] \
            == results[caching].num_prompt_tokens  # no preemption here
    assert results[False].prompt_tokens_cached == 0
    assert results[True].prompt_tokens_cached > 0
    assert "from the prefix cache" in results[True].summary()
    ids = [read_output(tmp_path / f"out-{c}").column("generated_token_ids").to_pylist()
           for c in (True, False)]
    assert ids[0] == ids[1]


def test_no_prefix_caching_flag_reaches_the_job(monkeypatch):
    from click.testing import CliRunner

    from fusegen.jobs import driver
    from fusegen.jobs.cli import main

    seen = []
    monkeypatch.setattr(driver, "run_job", lambda spec, **_: seen.append(spec) or 1 / 0)
    for flag, value in (("--no-prefix-caching", False), ("--enable-prefix-caching", True),
                        (None, True)):
        args = ["run", "--model", "m", "--input", "i", "--output", "o"] + ([flag] if flag else [])
        CliRunner().invoke(main, args)
        assert seen.pop().engine.enable_prefix_caching is value


# -- fusegen bench: the labelling preset, caching on and off in one run ---------------

def test_labelling_workload_shares_its_instruction():
    from fusegen.jobs.bench.presets import PRESETS
    from fusegen.jobs.bench.workload import make_workload

    preset = PRESETS["labelling"]
    requests = make_workload(8, preset.prompt_len, preset.output_len, 32000, seed=0,
                             shared_prefix_len=preset.shared_prefix_len)
    prefix = requests[0].prompt_ids[:1024]
    assert all(r.prompt_ids[:1024] == prefix for r in requests)
    assert all(1024 + 32 <= r.num_prompt_tokens <= 1024 + 128 for r in requests)
    assert {r.max_tokens for r in requests} == {32}
    assert preset.num_requests == 512 and preset.model.max_position_embeddings >= 1024 + 160


def test_bench_runs_fusegen_with_and_without_prefix_caching(tmp_path, monkeypatch):
    import dataclasses

    from click.testing import CliRunner

    from fusegen.jobs.bench.presets import PRESETS
    from fusegen.jobs.bench_cmd import bench

    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(PRESETS["tiny"],
                                                             shared_prefix_len=40))
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "6", "--skip-hf",
                                        "--prefix-caching", "both", "--cache-dir",
                                        str(tmp_path / "cache"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    on, off = (report["results"][n] for n in ("fusegen", "fusegen_no_prefix_cache"))
    prompts = report["workload"]["num_prompt_tokens"]
    assert on["budgets_met"] and off["budgets_met"]
    assert (off["prompt_tokens_computed"], off["prompt_tokens_cached"]) == (prompts, 0)
    # 5 of the 6 requests found the 40-token instruction's 2 full blocks of 16
    assert on["prompt_tokens_cached"] == 5 * 32
    assert on["prompt_tokens_computed"] == prompts - 5 * 32
    assert "prefix caching: fusegen computed" in result.stdout
    assert "fusegen, no prefix cache computed" in result.stdout
