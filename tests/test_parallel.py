"""Device groups (engine/parallel): tensor and pipeline parallel ranks in worker processes
under the engine's controller, on CPU with gloo. Tokens must equal the single-process
engine's (which the equality tests tie to transformers). Every engine here is a CPU one,
also on a machine with a GPU (one GPU cannot hold a group of two ranks)."""
from __future__ import annotations

import functools
import os
import signal

import psutil
import pytest
import torch

from checkpoints import ARCHS, make_hf_checkpoint
from fusegen import LLM as _LLM
from fusegen import SamplingParams
from fusegen.engine.errors import DeviceGroupError, EngineConfigError
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.parallel.plan import (check_parallel, model_stages, rank_devices,
                                          rank_infos, stage_layers)
from fusegen.engine.parallel.shard import (rank_model_config, shard_fixed_sources,
                                           shard_layer_sources, vocab_range)

LLM = functools.partial(_LLM, device="cpu")

# Mixed lengths in one fused batch; the long one spans several 16-token blocks.
PROMPTS = [list(range(5, 14)), [20, 21, 22], list(range(30, 70)), [7] * 17]


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tokens(llm, prompts=PROMPTS, params=None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params or greedy(),
                                                          use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    return {arch: make_hf_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Each architecture's tokens from the single-process engine."""
    out = {}
    for arch, path in checkpoints.items():
        with LLM(str(path), dtype="float32") as llm:
            out[arch] = tokens(llm)
    return out


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "fusegen.engine.parallel" in " ".join(p.cmdline())]


# -- policy ---------------------------------------------------------------------------

def _config(checkpoints, arch="llama") -> ModelConfig:
    return ModelConfig.from_dir(checkpoints[arch])


def test_splits_the_model_cannot_take_are_refused(checkpoints):
    cfg = _config(checkpoints)  # 4 heads, 2 KV heads, intermediate 128, 2 layers
    cases = [
        (3, 1, "tensor_parallel_size 3 does not divide the model's 4 attention heads; use "
               "one of [1, 2, 4]"),
        (1, 3, "pipeline_parallel_size 3 exceeds the model's 2 layers; every stage needs at "
               "least one"),
        (0, 1, "tensor_parallel_size must be an integer >= 1, got 0"),
    ]
    for tp, pp, message in cases:
        with pytest.raises(EngineConfigError) as info:
            check_parallel(cfg, tp, pp)
        assert str(info.value) == message
    odd = ModelConfig.from_dir(checkpoints["llama"])
    odd.intermediate_size = 130
    with pytest.raises(EngineConfigError, match=r"^tensor_parallel_size 4 does not divide "
                                                r"the model's intermediate size 130"):
        check_parallel(odd, 4, 1)
    odd.intermediate_size, odd.num_heads, odd.num_kv_heads = 128, 12, 3
    with pytest.raises(EngineConfigError, match=r"^tensor_parallel_size 2 and the model's 3 "
                                                r"KV heads: one must divide the other"):
        check_parallel(odd, 2, 1)
    # Refused at LLM(...), before any process starts.
    with pytest.raises(EngineConfigError, match="does not divide the model's 4 attention"):
        LLM(str(checkpoints["llama"]), dtype="float32", tensor_parallel_size=3)
    assert _children() == []


def test_stages_balance_bytes_and_ranks_get_devices():
    assert stage_layers([1] * 8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layers([1] * 8, 3) == [range(0, 2), range(2, 5), range(5, 8)]
    assert stage_layers([5, 1, 1, 1, 1, 5], 2) == [range(0, 3), range(3, 6)]
    assert stage_layers([9, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert stage_layers([1, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    # the last stage also runs the head: counted there (at half its weights)
    assert stage_layers([2] * 8, 2, tail=5) == [range(0, 5), range(5, 8)]
    assert model_stages(3_146_752, 8, 32_000 * 512, 2) == [range(0, 5), range(5, 8)]
    assert rank_devices("cpu", 4, 0) == ["cpu"] * 4
    assert rank_devices("cuda", 2, 4) == ["cuda:0", "cuda:1"]
    assert rank_devices("cuda:3,1", 2, 4) == ["cuda:3", "cuda:1"]
    for device, world, gpus, message in [
            ("cuda", 4, 2, "a device group of 4 ranks needs 4 GPUs; this machine shows 2"),
            ("cuda:0", 2, 2, "device 'cuda:0' names 1 GPU(s) for a device group of 2 ranks"),
            ("cuda:0,2", 2, 2, "device 'cuda:0,2': the GPUs must be below 2")]:
        with pytest.raises(EngineConfigError, match="^" + message.replace("(", r"\(")
                           .replace(")", r"\)")):
            rank_devices(device, world, gpus)
    infos = rank_infos(2, 2, [range(0, 1), range(1, 2)], ["cpu"] * 4, num_cores=8)
    assert [(i.rank, i.tp_rank, i.pp_rank, i.num_threads) for i in infos] == \
        [(0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)]
    assert [(i.prev_rank, i.next_rank, i.replies) for i in infos] == \
        [(None, 2, False), (None, 3, False), (0, None, True), (1, None, False)]
    assert infos[3].tp_ranks == [2, 3] and infos[3].layers == range(1, 2)


def test_shared_memory_too_small_for_the_logits_is_refused_before_start():
    from fusegen.engine.parallel.group import check_shared_memory

    check_shared_memory(64 * 2**20, "x", free=64 * 2**20)
    with pytest.raises(EngineConfigError) as info:
        check_shared_memory(300 * 2**20, "2 stage(s) x max_num_seqs 256 x vocabulary 152064 x "
                            "4 bytes", free=64 * 2**20)
    assert str(info.value) == (
        "a device group passes sampled logits through 300 MiB of shared memory (2 stage(s) x "
        "max_num_seqs 256 x vocabulary 152064 x 4 bytes); /dev/shm has 64 MiB free: give it "
        "more (a container's --shm-size) or lower max_num_seqs")


@pytest.mark.parametrize("arch, tp", [("llama", 2), ("llama", 4), ("phi3", 2),
                                      ("mixtral", 2), ("qwen3", 2)])
def test_rank_shards_rebuild_every_parameter(checkpoints, arch, tp):
    """Stacking the ranks' slices (each rank's q, k, v and gate, up in their places)
    gives back the whole model's parameters; KV heads repeat when ranks outnumber them."""
    from fusegen.engine.weights.loader import fuse, load_state_dict

    cfg = _config(checkpoints, arch)
    arch_ = get_architecture(cfg.architecture)
    state = load_state_dict(str(checkpoints[arch]), cfg, False)
    whole = fuse(arch_.layer_sources(state, 1, cfg), "cpu", torch.float32)
    ranks = [fuse(shard_layer_sources(cfg, arch_.layer_sources(state, 1, cfg), r, tp), "cpu",
                  torch.float32) for r in range(tp)]
    local = rank_model_config(cfg, tp)
    d, heads, kv = cfg.head_dim, local.num_heads, local.num_kv_heads
    q = torch.cat([r["qkv.weight"][:heads * d] for r in ranks])
    k = torch.cat([r["qkv.weight"][heads * d:(heads + kv) * d] for r in ranks])
    q_full, k_full, _ = whole["qkv.weight"].split([cfg.num_heads * d, cfg.num_kv_heads * d,
                                                   cfg.num_kv_heads * d])
    assert torch.equal(q, q_full)
    repeat = max(tp // cfg.num_kv_heads, 1)  # each KV head on `repeat` ranks
    assert torch.equal(k, k_full.view(cfg.num_kv_heads, d, -1).repeat_interleave(repeat, 0)
                       .reshape(-1, k_full.shape[-1]))
    assert torch.equal(torch.cat([r["o.weight"] for r in ranks], dim=1), whole["o.weight"])
    if cfg.num_experts:  # [E * 2I, h] and [E * h, I]: per expert gate, up / down
        e, inter = cfg.num_experts, cfg.moe_intermediate_size
        gate_up = torch.cat([r["gate_up.weight"].view(e, 2, inter // tp, -1) for r in ranks], 2)
        assert torch.equal(gate_up.reshape(-1, cfg.hidden_size), whole["gate_up.weight"])
        down = torch.cat([r["down.weight"].view(e, cfg.hidden_size, -1) for r in ranks], 2)
        assert torch.equal(down.reshape(e * cfg.hidden_size, -1), whole["down.weight"])
    else:
        inter = cfg.intermediate_size
        gate_up = torch.cat([r["gate_up.weight"].view(2, inter // tp, -1) for r in ranks], 1)
        assert torch.equal(gate_up.reshape(2 * inter, -1), whole["gate_up.weight"])
        assert torch.equal(torch.cat([r["down.weight"] for r in ranks], 1),
                           whole["down.weight"])
    for name in whole:
        if "norm" in name or name.startswith("router"):
            assert all(torch.equal(r[name], whole[name]) for r in ranks), name
    fixed = arch_.fixed_sources(state, cfg)
    slices = [shard_fixed_sources(cfg, fixed, r, tp)["embed"][0] for r in range(tp)]
    assert [s.shape[0] for s in slices] == [b - a for a, b in
                                            (vocab_range(cfg.vocab_size, tp, r)
                                             for r in range(tp))]
    assert torch.equal(torch.cat(slices), fixed["embed"][0])


# -- the engine with a device group ---------------------------------------------------

# Chunked prefill (16-token steps) and preemption with swapping: eight requests of 9 to
# 44 prompt tokens and 20 new ones over 12 KV blocks of 16.
TIGHT = dict(max_num_batched_tokens=16, num_kv_blocks=12)
TIGHT_PROMPTS = [list(range(5, 14 + i)) for i in range(0, 40, 5)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_device_groups_give_single_process_tokens(checkpoints, reference, arch):
    path = str(checkpoints[arch])
    with LLM(path, dtype="float32") as llm:
        expected = tokens(llm, TIGHT_PROMPTS, greedy(20))
    with LLM(path, dtype="float32", tensor_parallel_size=2) as llm:
        assert tokens(llm) == reference[arch]
    for split in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                  dict(tensor_parallel_size=2, pipeline_parallel_size=2)):
        with LLM(path, dtype="float32", **split, **TIGHT) as llm:
            assert tokens(llm, TIGHT_PROMPTS, greedy(20)) == expected, split
            assert llm.engine.stats.num_preemptions > 0
    assert _children() == []


def test_pipeline_and_both_splits_equal_single_process(checkpoints, reference):
    for arch, tp, pp in [("llama", 1, 2), ("llama", 2, 2), ("llama", 4, 1),
                         ("mixtral", 1, 2), ("gemma3", 2, 2)]:
        with LLM(str(checkpoints[arch]), dtype="float32", tensor_parallel_size=tp,
                 pipeline_parallel_size=pp) as llm:
            assert tokens(llm) == reference[arch], (arch, tp, pp)
            report = llm.engine.memory_report()
            refused = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, prompt_logprobs=1),
                                   use_tqdm=False)[0]
            assert refused.error_code == "invalid_params" and refused.outputs[0].token_ids == []
            assert "prompt_logprobs needs every prompt row's logits" in refused.error
            assert report["group"]["tensor_parallel_size"] == tp
            assert report["group"]["stages"] == [[s.start, s.stop] for s in
                                                 stage_layers([1, 1], pp)]


def test_pipeline_is_bit_identical_through_chunking_preemption_and_sampling(checkpoints):
    """Stages run whole layers, so a pipeline computes the same bits as one process;
    in deterministic mode that holds even though a pipeline splits the requests over two
    batches in flight: seeded sampling and logprobs equal exactly, through chunked
    prefill (16-token steps) and preemption (12 KV blocks for requests of up to 4)."""
    path = str(checkpoints["llama"])
    prompts = [list(range(5, 14 + i)) for i in range(0, 40, 5)]
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=i, logprobs=2,
                             ignore_eos=True) for i in range(len(prompts))]
    knobs = dict(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=12,
                 num_host_kv_blocks=0, deterministic=True)

    def run(**parallel):
        with LLM(path, **knobs, **parallel) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return ([o.outputs[0].token_ids for o in outs],
                    [o.outputs[0].cumulative_logprob for o in outs],
                    llm.engine.stats.num_preemptions)
    one, two = run(), run(pipeline_parallel_size=2)
    assert one[0] == two[0] and one[1] == two[1]
    assert one[2] > 0 and two[2] > 0  # preemption happened in both


def test_pipeline_keeps_two_batches_in_flight(checkpoints):
    """Non-blocking pipeline: the controller submits batch k + 1 before it collects batch
    k, each batch holding half the requests, so stage 0 has batch k + 1 to run while
    stage 1 runs batch k; every stage runs the batches in the order they were submitted.
    Asserted on the order of events and the batches' contents, never on durations: how
    much the stages overlap in time is the OS scheduler's, and a busy machine's."""
    prompts = [list(range(5 + i, 60 + i)) for i in range(24)]

    def run(max_in_flight):
        with LLM(str(checkpoints["llama"]), dtype="float32", pipeline_parallel_size=2) as llm:
            engine, events = llm.engine, []
            engine.max_in_flight = max_in_flight
            submit, collect = engine.runner.submit, engine.runner.collect
            engine.runner.submit = lambda batch: events.append(
                {r.request_id for r in batch.requests}) or submit(batch)
            engine.runner.collect = lambda: events.append("collect") or collect()
            out = tokens(llm, prompts, greedy(24))
            trace = engine.runner.stage_trace()
        return out, events, trace

    overlapped, events, trace = run(2)
    blocking, blocking_events, blocking_trace = run(1)
    assert overlapped == blocking
    # 24 requests in two alternating halves of 12, two batches out before each collect
    batches = [e for e in events if e != "collect"]
    assert events == [batches[0], batches[1]] + [e for b in batches[2:] for e in ("collect", b)] \
        + ["collect"] * 2
    assert [len(b) for b in batches] == [12] * len(batches) == [12] * 48
    assert all(b == batches[k % 2] for k, b in enumerate(batches))
    assert not batches[0] & batches[1]
    # the blocking baseline: one batch of all 24 at a time
    assert blocking_events == [e for b in blocking_events[::2] for e in (b, "collect")]
    assert [len(b) for b in blocking_events[::2]] == [24] * 24
    # each stage ran every batch, in submission order
    for stage_trace, num_batches in ((trace, 48), (blocking_trace, 24)):
        assert {rank: [step for step, *_ in steps] for rank, steps in stage_trace.items()} \
            == {0: list(range(num_batches)), 1: list(range(num_batches))}
    # Blocking, stage 0 cannot start batch k + 1 before stage 1 has ended batch k: the
    # controller submits it only after the reply stage 1 sends after its end (one clock).
    first, last = blocking_trace[0], {step: end for step, _, _, end in blocking_trace[1]}
    assert all(start > last[step - 1] for step, _, start, _ in first[1:])


def test_collective_bytes_match_one_dimensional_tensor_parallelism(checkpoints):
    """Per step with T tokens, S sampled rows, hidden h, fp32, 2 ranks: per layer two
    all-reduces of T x h x 4 bytes (ring: each rank sends 2 (2 - 1) / 2 of it), one for
    the embedding, and the greedy head's gather of S (value, index) pairs."""
    cfg = _config(checkpoints)
    with LLM(str(checkpoints["llama"]), dtype="float32", tensor_parallel_size=2) as llm:
        runner = llm.engine.runner
        before = runner.collective_bytes()
        tokens(llm, [PROMPTS[2]], greedy(1))  # one step: 40 tokens, one sampled
        after = runner.collective_bytes()
    h, num_tokens = cfg.hidden_size, len(PROMPTS[2])
    expected = (2 * cfg.num_layers + 1) * num_tokens * h * 4 + 1 * 2 * 4
    for rank in (0, 1):
        assert after[rank]["tensor_parallel"] - before[rank]["tensor_parallel"] == expected


def test_killed_rank_fails_the_step_and_nothing_hangs(checkpoints):
    llm = LLM(str(checkpoints["llama"]), dtype="float32", tensor_parallel_size=2,
              collective_timeout=60)
    try:
        pids = llm.engine.runner.group.pids
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(DeviceGroupError) as info:
            tokens(llm, PROMPTS, greedy(50))
        # found by watching the ranks' processes: waiting out collective_timeout would
        # say "did not answer ... within 60 s" instead
        assert str(info.value).startswith("device_group_failed: rank 1 (pid "
                                          f"{pids[1]}) exited with code -9 during ")
        assert DeviceGroupError.code == "device_group_failed"
        with pytest.raises(DeviceGroupError, match="^device_group_failed: rank 1"):
            tokens(llm, PROMPTS[:1], greedy(2))  # the group is gone: at once
    finally:
        llm.close()
    assert _children() == []


@pytest.mark.parametrize("host_memory", ["1GiB", 0])
def test_each_rank_streams_its_share_of_layers(tmp_path, host_memory):
    """The memory pool plans per rank: a device budget that holds one of a stage's four
    layers streams the other three from host memory (or the memory-mapped checkpoint) on
    every rank, and the tokens stay those of one process holding everything."""
    from test_offload import budget_for

    path = str(make_hf_checkpoint(tmp_path, "llama", seed=11, num_hidden_layers=8))
    options = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64)
    with LLM(path, **options) as llm:
        expected = tokens(llm)
    with LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **options) as llm:
        budget = budget_for(llm.placement.sizes, resident=1)
    with LLM(path, device_memory=budget, host_memory=host_memory, tensor_parallel_size=2,
             pipeline_parallel_size=2, **options) as llm:
        assert llm.placement.layer_tiers == ["device"] + ["host" if host_memory else "disk"] * 3
        assert tokens(llm) == expected
        ranks = llm.memory_report()["ranks"]
    assert sorted(ranks) == [0, 1, 2, 3]
    assert all(r["layers"] == {"device": 1, "host": 3 if host_memory else 0,
                               "disk": 0 if host_memory else 3} for r in ranks.values())
    assert all(r["streamed"]["loads"] > 0 for r in ranks.values())
