"""`fusegen bench`: FLOP accounting by hand, the workload, the cache, and the tiny preset
end to end (every engine's output tokens must equal the budgets asked)."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from fusegen.jobs.bench import checkpoint, flops
from fusegen.jobs.bench.harness import BenchConfig, workload_for
from fusegen.jobs.bench.hf_static import batch_inputs
from fusegen.jobs.bench.presets import PRESETS, LengthDist, PresetModel
from fusegen.jobs.bench.workload import BenchRequest, describe_workload, draw_length, make_workload
from fusegen.jobs.bench_cmd import bench

# h=64, i=128, 2 layers, 4 heads of 16, 2 KV heads, vocab 100.
SHAPE = PresetModel(arch="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=64, dtype="float32")


# --- model FLOPs and bytes, computed by hand --------------------------------------------

def test_layer_linear_params_by_hand():
    # q 64*64 + k 64*32 + v 64*32 + o 64*64 + gate/up/down 3*64*128
    assert flops.layer_linear_params(SHAPE) == 4096 + 2048 + 2048 + 4096 + 24576 == 36864


def test_request_flops_by_hand():
    # p=3 prompt tokens, n=2 outputs: T = 3 + 2 - 1 = 4 tokens pass through the layers.
    linear = 2 * 4 * 2 * 36864  # 2 FLOPs x 4 tokens x 2 layers x 36864 weights = 589824
    attention = 4 * 2 * 4 * 16 * (1 + 2 + 3 + 4)  # contexts 1..4, 4*L*nh*d = 512 -> 5120
    head = 2 * 64 * 100 * 2  # LM head for the 2 sampled tokens = 25600
    assert (linear, attention, head) == (589824, 5120, 25600)
    assert flops.request_flops(SHAPE, 3, 2) == 620544
    # one prompt token, one output: 1 token through, context 1, 1 LM head
    assert flops.request_flops(SHAPE, 1, 1) == 2 * 2 * 36864 + 512 + 12800
    assert flops.request_flops(SHAPE, 5, 0) == 0
    assert flops.workload_flops(SHAPE, [(3, 2), (1, 1)]) == 620544 + 160768


def test_param_counts_match_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    assert flops.num_params(SHAPE) == sum(p.numel() for p in model.parameters())
    layer = model.model.layers[0]
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert flops.layer_linear_params(SHAPE) == linear


def test_bytes_by_hand():
    # per token: K and V x 2 layers x 2 KV heads x 16 x 4 bytes
    assert flops.kv_bytes_per_token(SHAPE, "float32") == 2 * 2 * 2 * 16 * 4 == 512
    # p=3, n=3: prefill reads 3 entries, then tokens fed back at contexts 4 and 5
    assert flops.request_kv_bytes(SHAPE, "float32", 3, 3) == (3 + 4 + 5) * 512
    # every weight but the embedding table, in bf16
    assert flops.weight_bytes(SHAPE, "bfloat16") == (flops.num_params(SHAPE) - 6400) * 2
    tied = replace(SHAPE, tie_word_embeddings=True)
    assert flops.weight_bytes(tied, "bfloat16") == flops.weight_bytes(SHAPE, "bfloat16")
    seconds = flops.memory_bound_seconds(SHAPE, "float32", [(3, 3)], num_steps=3, bandwidth=1e6)
    assert seconds == pytest.approx((3 * flops.weight_bytes(SHAPE, "float32") + 12 * 512) / 1e6)


def test_moe_flops_count_the_experts_each_token_runs_through():
    moe = replace(SHAPE, arch="mixtral", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32)
    # attention 12288 (q 4096 + k 2048 + v 2048 + o 4096) + router 64*4 + 2 experts of 3*64*32
    assert flops.layer_linear_params(moe) == 12288 + 256 + 2 * 6144 == 24832
    assert flops.request_flops(moe, 1, 1) == 2 * 2 * 24832 + 512 + 12800


def test_moe_param_count_matches_transformers():
    # Every expert is stored: a real Mixtral's shape, read from its config as --model does.
    from transformers import MixtralConfig, MixtralForCausalLM

    from fusegen.engine.models.config import ModelConfig
    from fusegen.jobs.bench.model import shape_of

    config = MixtralConfig(vocab_size=100, hidden_size=64, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    shape = shape_of(ModelConfig.from_dict({**config.to_dict(),
                                            "architectures": ["MixtralForCausalLM"]}))
    assert (shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size) == (4, 2, 32)
    assert flops.num_params(shape) == sum(p.numel() for p in MixtralForCausalLM(config).parameters())


def test_dense_shapes_keep_their_checkpoint_keys():
    # The key cpu-small's cached checkpoint was built under before the MoE fields existed.
    assert checkpoint.shape_key(PRESETS["cpu-small"].model) == "f938fb324795"
    moe = replace(PRESETS["cpu-small"].model, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=256)
    assert checkpoint.shape_key(moe) != "f938fb324795"


def test_preset_prompts_are_checked():
    with pytest.raises(ValueError, match="prompts must be 'random' or 'chat', got 'sharegpt'"):
        replace(PRESETS["tiny"], prompts="sharegpt")
    with pytest.raises(ValueError, match="preset chat prompts through a chat template: pass a "
                       "real model with --model"):
        BenchConfig(replace(PRESETS["chat"], default_model=None))


# --- workload ---------------------------------------------------------------------------

def test_workload_is_seeded_and_within_bounds():
    prompt, output = LengthDist("uniform", 16, 512), LengthDist("uniform", 16, 256)
    a = make_workload(50, prompt, output, vocab_size=1000, seed=3)
    assert a == make_workload(50, prompt, output, vocab_size=1000, seed=3)
    assert a != make_workload(50, prompt, output, vocab_size=1000, seed=4)
    assert all(16 <= r.num_prompt_tokens <= 512 and 16 <= r.max_tokens <= 256 for r in a)
    assert all(0 <= t < 1000 for r in a for t in r.prompt_ids)
    summary = describe_workload(a)
    assert summary["num_output_tokens"] == sum(r.max_tokens for r in a)
    assert summary["num_prompt_tokens"] == sum(len(r.prompt_ids) for r in a)


def test_lognormal_lengths_have_the_asked_mean_and_tail():
    dist = PRESETS["gpu-8b"].prompt_len
    rng = random.Random(0)
    lengths = [draw_length(dist, rng) for _ in range(20000)]
    assert 4 <= min(lengths) and max(lengths) <= 1024
    assert 170 < sum(lengths) / len(lengths) < 210  # ~200, a little less after clipping
    assert max(lengths) > 5 * 200  # a long tail


def test_presets_hold_their_longest_request():
    for preset in PRESETS.values():
        longest = preset.shared_prefix_len + preset.prompt_len.high + preset.output_len.high
        assert longest <= preset.model.max_position_embeddings, preset.name


def test_batch_inputs_pad_on_the_left():
    ids, mask = batch_inputs([BenchRequest([5, 6, 7], 1), BenchRequest([9], 4)], pad_id=0,
                             device="cpu")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_engine_stats_count_the_timed_run_alone():
    from fusegen.jobs.bench.fusegen_runner import _stats_delta

    warm = {"num_steps": 4, "mean_running": 2.0, "max_num_seqs": 256, "num_decode_steps": 2,
            "mean_decode_batch": 3.0, "step_seconds": 1.0}
    end = {"num_steps": 10, "mean_running": 5.0, "max_num_seqs": 256, "num_decode_steps": 6,
           "mean_decode_batch": 5.0, "step_seconds": 3.5}
    # running: (10*5 - 4*2) / 6 = 7; decode batch: (6*5 - 2*3) / 4 = 6
    assert _stats_delta(warm, end) == {"num_steps": 6, "num_decode_steps": 4, "step_seconds": 2.5,
                                       "mean_running": 7.0, "mean_decode_batch": 6.0}


# --- checkpoint cache -------------------------------------------------------------------

def test_checkpoint_is_cached_and_rebuilt_when_the_shape_changes(tmp_path, monkeypatch):
    built = []

    def fake_build(path, shape):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        built.append(shape)

    monkeypatch.setattr(checkpoint, "_build", fake_build)
    first = checkpoint.ensure_checkpoint("tiny", SHAPE, tmp_path)
    assert checkpoint.ensure_checkpoint("tiny", SHAPE, tmp_path) == first
    assert len(built) == 1 and checkpoint.is_built(first)
    smaller = replace(SHAPE, num_layers=1)
    second = checkpoint.ensure_checkpoint("tiny", smaller, tmp_path)
    assert second != first and len(built) == 2
    assert json.loads((second / "bench_shape.json").read_text())["num_layers"] == 1
    assert not list((tmp_path / "bench").glob(".*building*"))


# --- the tiny preset, end to end --------------------------------------------------------

@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")


@pytest.fixture(scope="module")
def tiny_run(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out") / "tiny.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--cache-dir", str(cache_dir),
                                        "--json", str(out)])
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text())


def test_tiny_output_tokens_equal_the_budgets(tiny_run, cache_dir):
    _, report = tiny_run
    config = BenchConfig(PRESETS["tiny"], cache_dir=cache_dir)
    requests, _ = workload_for(config)
    budgets = sum(r.max_tokens for r in requests)
    prompts = sum(r.num_prompt_tokens for r in requests)
    assert report["workload"]["num_output_tokens"] == budgets
    for name in ("fusegen", "hf_static", "hf_continuous"):
        r = report["results"][name]
        assert r["budgets_met"] is True, name
        assert (r["num_requests"], r["num_prompt_tokens"], r["num_output_tokens"]) == (
            len(requests), prompts, budgets), name
        counts = [(q.num_prompt_tokens, q.max_tokens) for q in requests]
        assert r["model_flops"] == flops.workload_flops(PRESETS["tiny"].model, counts), name
    # the static baseline generated past some budgets; those tokens are not counted
    static = report["results"]["hf_static"]
    assert static["num_generated_tokens"] > budgets


def test_tiny_report_fields_are_consistent(tiny_run):
    result, report = tiny_run
    for key in ("preset", "date", "machine", "versions", "config", "model", "workload",
                "ceiling", "results", "ratios", "utilisation"):
        assert key in report, key
    assert report["versions"]["torch"] == torch.__version__
    assert set(report["ceiling"]["matmul_flops"]) == {"bfloat16", "float32"}
    assert report["ceiling"]["memory_bandwidth"] > 0
    fusegen = report["results"]["fusegen"]
    for name in ("hf_static", "hf_continuous"):
        base = report["results"][name]
        for rate in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "flops_per_s"):
            assert report["ratios"][name][rate] == pytest.approx(fusegen[rate] / base[rate])
    assert fusegen["output_tokens_per_s"] == pytest.approx(
        fusegen["num_output_tokens"] / fusegen["elapsed_s"])
    util = report["utilisation"]
    peak = report["ceiling"]["matmul_flops"]["float32"]
    assert util["dtype"] == "float32"
    assert util["mfu"] == pytest.approx(fusegen["flops_per_s"] / peak) == fusegen["mfu"]
    assert util["num_steps"] == fusegen["num_steps"] > 0
    table = result.stdout
    assert "fusegen" in table and "hf generate, static bs 4" in table
    assert "model-FLOP utilisation" in table and "ceiling" in table


def test_skip_hf_runs_fusegen_alone(cache_dir, tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "3", "--skip-hf",
                                        "--cache-dir", str(cache_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["results"]["fusegen"]["num_requests"] == 3
    assert "skipped" in report["results"]["hf_static"] and report["ratios"] == {}


def test_bad_options_are_usage_errors(cache_dir):
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "0"])
    assert result.exit_code == 2 and "--requests" in result.output
    result = CliRunner().invoke(bench, ["--preset", "nope"])
    assert result.exit_code == 2 and "tiny" in result.output


def test_offload_preset_end_to_end(cache_dir):
    # The tiny shape with six layers and a budget that keeps two on the device: fusegen
    # streams the rest from disk, accelerate offloads under the same budget, and both
    # produce exactly the budgets.
    from fusegen.jobs.bench.harness import run_benchmark, workload_for
    from fusegen.jobs.bench.presets import OffloadSpec

    tiny = PRESETS["tiny"]
    preset = replace(tiny, name="tiny-offload", model=replace(tiny.model, num_layers=6),
                     num_requests=6, offload=OffloadSpec(resident_fraction=1 / 3,
                                                         host_memory="0"))
    config = BenchConfig(preset, cache_dir=cache_dir)
    report = run_benchmark(config)
    fusegen, baseline = report["results"]["fusegen"], report["results"]["hf_offload"]
    assert fusegen["budgets_met"] and baseline["budgets_met"]
    assert fusegen["num_output_tokens"] == baseline["num_output_tokens"] == \
        report["workload"]["num_output_tokens"]
    offload = fusegen["offload"]
    assert offload["layers"] == {"device": 2, "host": 0, "disk": 4}
    assert offload["device_bytes"] <= offload["device_budget"]
    # The budget holds the KV of every request at full length: nothing is preempted.
    requests, _ = workload_for(config)
    needed = sum(-(-(r.num_prompt_tokens + r.max_tokens) // 16) for r in requests)
    assert offload["kv_blocks"]["device"] >= needed
    assert fusegen["num_preemptions"] == 0
    assert offload["transfer_bandwidth"] > 0 and offload["decode_step_s"] > 0
    assert offload["decode_over_bound"] == pytest.approx(
        offload["decode_step_s"] / offload["transfer_bound_s"])
    assert 0 <= offload["stall_per_step_s"] * fusegen["num_steps"] <= fusegen["elapsed_s"]
    assert "disk" in baseline["device_map"]
    assert set(report["ratios"]) == {"hf_offload"}


def test_recorded_decode_steps_are_counted(cache_dir, tmp_path):
    # A CPU engine records its decode steps as CPU graphs (engine/graphs.py): the report
    # says how many of the timed run's decode steps replayed one, and names the graphs
    # after the device that ran them; an engine without graphs reports none.
    from fusegen.jobs.bench.report import _graphs_line

    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "6", "--skip-hf",
                                        "--cache-dir", str(cache_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    fusegen = json.loads(out.read_text())["results"]["fusegen"]
    graphs = fusegen["graphs"]
    assert graphs["device"] == "cpu" and graphs["failed"] is None and graphs["recorded"] >= 1
    assert 0 < graphs["replays"] <= fusegen["num_decode_steps"]
    assert (f"CPU graphs: {graphs['replays']:,} of {fusegen['num_decode_steps']:,} decode steps "
            "replayed a recorded graph") in result.stdout
    assert "CUDA graphs" not in result.stdout
    # the same figures from a GPU's run
    assert _graphs_line({**graphs, "device": "cuda"}, fusegen).startswith(
        f"CUDA graphs: {graphs['replays']:,} of {fusegen['num_decode_steps']:,} decode steps")
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "6", "--skip-hf",
                                        "--enforce-eager", "--cache-dir", str(cache_dir),
                                        "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "graphs" not in json.loads(out.read_text())["results"]["fusegen"]
    assert "graphs:" not in result.stdout
