"""`fusegen bench --workload`: the named workloads on any preset, their exact lengths,
the transformers baselines on a subset (--hf-requests), and the inputs refused."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from click.testing import CliRunner

from fusegen.jobs.bench import checkpoint
from fusegen.jobs.bench.harness import BenchConfig, workload_for
from fusegen.jobs.bench.html_report import render_bench_html
from fusegen.jobs.bench.presets import PRESETS, WORKLOADS, LengthDist
from fusegen.jobs.bench.report import _workload, _workload_line
from fusegen.jobs.bench_cmd import bench


# --- the workloads on presets ------------------------------------------------------------

def test_gpu_8b_runs_the_sharegpt_like_lengths():
    # one definition: gpu-8b's own lengths are the workload's, and naming it changes
    # nothing, the cached checkpoint's key included
    gpu = PRESETS["gpu-8b"]
    named = gpu.with_workload("sharegpt-like")
    assert gpu.workload == "sharegpt-like" and named == gpu
    assert gpu.prompt_len is WORKLOADS["sharegpt-like"].prompt_len
    assert (gpu.prompt_len, gpu.output_len) == (
        LengthDist("lognormal", 4, 1024, mean=200.0, sigma=1.0),
        LengthDist("lognormal", 4, 1024, mean=180.0, sigma=0.9))
    on_1k = gpu.with_workload("random-1k-1k")
    assert checkpoint.shape_key(on_1k.model) == checkpoint.shape_key(gpu.model)
    assert on_1k.model.max_position_embeddings == 4096  # holds 2048 already
    # gpu-8b-1k keeps TensorRT-LLM's table's 1000 / 1000
    assert PRESETS["gpu-8b-1k"].prompt_len == LengthDist("uniform", 1000, 1000)


@pytest.mark.parametrize("name", ["tiny", "cpu-small", "labelling", "chat"])
def test_a_workload_replaces_the_presets_requests(name):
    preset = PRESETS[name].with_workload("random-1k-1k")
    assert (preset.num_requests, preset.prompt_len, preset.output_len) == (
        1000, LengthDist("uniform", 1024, 1024), LengthDist("uniform", 1024, 1024))
    assert (preset.prompts, preset.shared_prefix_len, preset.workload) == (
        "random", 0, "random-1k-1k")
    # the model is the preset's, with the positions 1024 + 1024 needs
    assert preset.model.max_position_embeddings == max(
        2048, PRESETS[name].model.max_position_embeddings)
    assert preset.model.hidden_size == PRESETS[name].model.hidden_size
    assert preset.hf_batch_size == PRESETS[name].hf_batch_size
    # --requests and --layers still apply after it
    shrunk = preset.shrink(num_requests=7, num_layers=1)
    assert (shrunk.num_requests, shrunk.model.num_layers, shrunk.workload) == (
        7, 1, "random-1k-1k")


@pytest.mark.parametrize("name", ["tiny", "cpu-small"])
def test_random_1k_1k_requests_are_exactly_1024_in_and_out(name, tmp_path):
    config = BenchConfig(PRESETS[name].with_workload("random-1k-1k").shrink(num_requests=5),
                         cache_dir=tmp_path)
    requests, _ = workload_for(config)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in requests] == [(1024, 1024)] * 5
    vocab = PRESETS[name].model.vocab_size
    assert all(0 <= t < vocab for r in requests for t in r.prompt_ids)
    assert len({tuple(r.prompt_ids) for r in requests}) == 5  # no two prompts alike


def test_sharegpt_like_on_cpu_small_draws_1000_long_tailed_requests(tmp_path):
    config = BenchConfig(PRESETS["cpu-small"].with_workload("sharegpt-like"), cache_dir=tmp_path)
    requests, _ = workload_for(config)
    prompts = [r.num_prompt_tokens for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert len(requests) == 1000
    assert 4 <= min(prompts) and max(prompts) <= 1024 and 4 <= min(outputs) and max(outputs) <= 1024
    assert 160 < sum(prompts) / 1000 < 220 and 145 < sum(outputs) / 1000 < 205
    assert max(prompts) > 800  # the long tail
    assert workload_for(config)[0] == requests  # seeded


def test_the_report_names_the_workload_and_its_parameters(tmp_path):
    preset = PRESETS["tiny"].with_workload("sharegpt-like").shrink(num_requests=3)
    requests, _ = workload_for(BenchConfig(preset, cache_dir=tmp_path))
    work = _workload(preset, requests)
    assert work["name"] == "sharegpt-like" and work["num_requests"] == 3
    assert work["prompt_dist_params"] == {"kind": "lognormal", "low": 4, "high": 1024,
                                          "mean": 200.0, "sigma": 1.0}
    assert work["output_dist_params"] == {"kind": "lognormal", "low": 4, "high": 1024,
                                          "mean": 180.0, "sigma": 0.9}
    assert work["prompt_dist"] == "lognormal mean~200 sigma 1, clipped to 4..1024"
    assert _workload_line({"workload": work, "preset": "tiny"}) == (
        f"  workload sharegpt-like: {WORKLOADS['sharegpt-like'].about}")
    own = _workload(PRESETS["tiny"], requests)
    assert own["name"] is None and own["prompt_dist"] == "uniform 2..24"
    assert _workload_line({"workload": own, "preset": "tiny"}) == \
        "  workload: preset tiny's own lengths"


# --- refused inputs ----------------------------------------------------------------------

def test_an_unknown_workload_is_refused():
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--workload", "sharegpt"])
    assert result.exit_code == 2
    assert "'sharegpt' is not one of 'sharegpt-like', 'random-1k-1k'" in result.output
    with pytest.raises(ValueError, match="unknown workload 'sharegpt'; one of sharegpt-like, "
                       "random-1k-1k"):
        PRESETS["tiny"].with_workload("sharegpt")



def test_a_grid_the_model_cannot_take_is_a_usage_error(tmp_path):
    # found when fusegen's engine is built, before anything is timed: the message, not a
    # traceback
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--skip-hf", "--requests", "2",
                                        "--cache-dir", str(tmp_path),
                                        "--tensor-parallel-size", "3",
                                        "--tensor-parallel-mode", "2d"])
    assert result.exit_code == 2, result.output
    assert "a Tesseract grid of 3 ranks at tesseract_depth 1 needs 3 = q x q x 1" in \
        result.output

def test_a_model_too_short_for_the_workload_is_refused(tmp_path):
    # a real model (--model) keeps its positions: tiny's own checkpoint has 128
    model_dir = checkpoint.ensure_checkpoint("tiny", PRESETS["tiny"].model, tmp_path)
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--workload", "random-1k-1k",
                                        "--model", str(model_dir), "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert (f"workload random-1k-1k's requests reach 2048 positions but {model_dir} has "
            "max_position_embeddings 128 (1024 prompt + 1024 output tokens)") in \
        " ".join(result.output.split())
    # and fusegen's max_model_len, where one is set
    preset = PRESETS["tiny"].with_workload("random-1k-1k")
    with pytest.raises(ValueError, match=r"workload random-1k-1k's requests reach 2048 positions "
                       r"but --max-model-len is 1500 \(1024 prompt \+ 1024 output tokens\); "
                       "raise it to at least 2048"):
        BenchConfig(preset, cache_dir=tmp_path, engine_options={"max_model_len": 1500})
    BenchConfig(preset, cache_dir=tmp_path, engine_options={"max_model_len": 2048})


def test_more_hf_requests_than_requests_is_refused(tmp_path):
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--workload", "random-1k-1k",
                                        "--requests", "3", "--hf-requests", "4",
                                        "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "--hf-requests 4 must be between 1 and --requests 3" in result.output
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--hf-requests", "0"])
    assert result.exit_code == 2 and "--hf-requests" in result.output


# --- random-1k-1k on the tiny preset, end to end -----------------------------------------

@pytest.fixture(scope="module")
def run_1k(tmp_path_factory):
    cache = tmp_path_factory.mktemp("bench-cache")
    out = tmp_path_factory.mktemp("bench-out") / "r.json"
    result = CliRunner().invoke(bench, [
        "--preset", "tiny", "--workload", "random-1k-1k", "--requests", "2",
        "--hf-requests", "1", "--skip-hf-continuous", "--cache-dir", str(cache),
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads(out.read_text()), out.with_suffix(".html").read_text()


def test_every_request_runs_exactly_1024_prompt_and_1024_output_tokens(run_1k):
    _, report, _ = run_1k
    fusegen = report["results"]["fusegen"]
    assert fusegen["budgets_met"] is True  # 1024 output ids each, finished by length
    assert (fusegen["num_requests"], fusegen["num_prompt_tokens"],
            fusegen["num_output_tokens"]) == (2, 2048, 2048)
    # the engine's own count of the prompt tokens it ran or found cached
    assert fusegen["prompt_tokens_computed"] + fusegen["prompt_tokens_cached"] == 2048
    assert fusegen["num_preemptions"] == 0
    assert report["model"]["max_position_embeddings"] == 2048
    static = report["results"]["hf_static"]
    assert static["budgets_met"] is True
    assert (static["num_requests"], static["num_prompt_tokens"], static["num_output_tokens"],
            static["num_generated_tokens"], static["num_padded_prompt_tokens"]) == (
        1, 1024, 1024, 1024, 1024)


def test_the_baseline_on_a_subset_is_compared_per_token(run_1k):
    table, report, _ = run_1k
    fusegen, static = report["results"]["fusegen"], report["results"]["hf_static"]
    assert report["config"]["hf_requests"] == 1
    for rate in ("output_tokens_per_s", "total_tokens_per_s"):
        assert report["ratios"]["hf_static"][rate] == pytest.approx(fusegen[rate] / static[rate])
    assert static["output_tokens_per_s"] == pytest.approx(1024 / static["elapsed_s"])
    assert ("transformers (hf generate, static bs 4) ran the first 1 of the 2 requests "
            "(--hf-requests: 1,024 prompt and 1,024 output tokens): its rates are per token "
            "of those, and 'fusegen x' divides fusegen's rate over all 2 by that") in table


def test_the_report_says_which_workload_ran(run_1k):
    table, report, html = run_1k
    work = report["workload"]
    assert work["name"] == "random-1k-1k" and work["about"] == WORKLOADS["random-1k-1k"].about
    assert work["prompt_dist_params"] == work["output_dist_params"] == asdict(
        LengthDist("uniform", 1024, 1024))
    fixed = {"min": 1024, "mean": 1024.0, "max": 1024}
    assert work["prompt_len"] == work["output_len"] == fixed
    line = f"  workload random-1k-1k: {WORKLOADS['random-1k-1k'].about}"
    assert line in table.splitlines()
    assert "prompts: 2,048 tokens (fixed 1024, mean 1024.0); outputs: 2,048 tokens (fixed " \
        "1024, mean 1024.0)" in table
    assert "workload random-1k-1k: exactly 1024 random prompt ids" in html
    assert html == render_bench_html(report)
    # MFU and the memory roofline over the workload
    util = report["utilisation"]
    assert util["mfu"] == pytest.approx(report["results"]["fusegen"]["mfu"]) and util["mfu"] > 0
    assert 0 < util["memory_roofline_fraction"]
