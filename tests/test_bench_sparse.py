"""`fusegen bench --sparsity` on the tiny preset: a run of fusegen on the model pruned to
each (sparsity, values) beside the dense run, on the same requests; each run's bytes per
decoder layer are exactly the codec's bytes of the tiles it loaded, its tokens are those
of the same pruned weights stored dense, and its figures are the ones printed and drawn;
under the memory pool the pruned model keeps more layers resident and streams fewer
bytes; bad options are usage errors naming the value."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from statistics import median

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from gguf_checkpoints import Q, write_gguf
from quant_helpers import read_all
from fusegen.engine.weights.sparsify import kept_count, prune_rows
from fusegen.jobs.bench.fusegen_runner import run_fusegen
from fusegen.jobs.bench.harness import BenchConfig, run_benchmark, workload_for
from fusegen.jobs.bench.presets import PRESETS, OffloadSpec
from fusegen.jobs.bench_cmd import bench
from fusegen.kernels import sparse_format as codec

TINY = PRESETS["tiny"].shrink(num_requests=6)
SPARSITIES = (0.5, 0.8)
VARIANTS = {"fusegen_sparse50_bfloat16": (0.5, "bfloat16"),
            "fusegen_sparse50_int8": (0.5, "int8"),
            "fusegen_sparse80_bfloat16": (0.8, "bfloat16"),
            "fusegen_sparse80_int8": (0.8, "int8")}
# a decoder layer's linears in the checkpoint: (name, out, in) of the tiny shape
LINEARS = (("self_attn.q_proj", 64, 64), ("self_attn.k_proj", 32, 64),
           ("self_attn.v_proj", 32, 64), ("self_attn.o_proj", 64, 64),
           ("mlp.gate_proj", 128, 64), ("mlp.up_proj", 128, 64), ("mlp.down_proj", 64, 128))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")


@pytest.fixture(scope="module")
def sparse_run(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out") / "sparse.json"
    result = CliRunner().invoke(bench, [
        "--preset", "tiny", "--requests", "6", "--skip-hf", "--sparsity", "0.8,0.5",
        "--sparse-values", "both", "--cache-dir", str(cache_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    return result.stdout, json.loads(out.read_text()), out.with_suffix(".html").read_text()


def layer_name(i: int, linear: str) -> str:
    return f"model.layers.{i}.{linear}.weight"


def test_every_variant_ran_the_same_requests(sparse_run):
    _, report, _ = sparse_run
    results = report["results"]
    assert [n for n in results if n.startswith("fusegen")] == ["fusegen", *VARIANTS]
    dense = results["fusegen"]
    for name, (sparsity, values) in VARIANTS.items():
        r = results[name]
        assert r["budgets_met"] and r["quantization"] == "sparse", name
        assert (r["num_requests"], r["num_prompt_tokens"], r["num_output_tokens"]) == (
            dense["num_requests"], dense["num_prompt_tokens"], dense["num_output_tokens"])
        config = json.loads((Path(r["checkpoint"]) / "config.json").read_text())
        entry = config["sparsity_config"]
        assert (entry["sparsity"], entry["values"], entry["method"]) == (
            sparsity, values, "magnitude")
    assert [row["name"] for row in report["sparse"]["rows"]] == ["fusegen", *VARIANTS]


def test_layer_bytes_are_the_tiles_bytes_exactly(sparse_run):
    _, report, _ = sparse_run
    rows = {row["name"]: row for row in report["sparse"]["rows"]}
    dense = [sum(4 * out * inp for _, out, inp in LINEARS)] * TINY.model.num_layers
    assert rows["fusegen"]["linear_bytes_by_layer"] == dense == [147456, 147456]  # fp32
    for name in VARIANTS:
        found = read_all(Path(rows[name]["checkpoint"]))
        want = [sum(codec.nbytes(codec.from_tensors(layer_name(i, linear), found, out, inp))
                    for linear, out, inp in LINEARS) for i in range(TINY.model.num_layers)]
        assert rows[name]["linear_bytes_by_layer"] == want, name
        assert report["results"][name]["linear_bytes_by_layer"] == want, name
        assert rows[name]["bytes_ratio"] == sum(want) / sum(dense)
    # 50% bf16: 18,432 values of 2 B, 10 tiles of 512 B bitmap and 8 B offset, 7 weights' 8 B
    assert rows["fusegen_sparse50_bfloat16"]["linear_bytes_by_layer"][0] == \
        18432 * 2 + 10 * 520 + 7 * 8 == 42120


def test_checkpoints_hold_the_magnitude_pruned_weights(sparse_run, cache_dir):
    _, report, _ = sparse_run
    source = read_all(Path(report["model"]["checkpoint"]))
    for name, (sparsity, values) in VARIANTS.items():
        found = read_all(Path(report["results"][name]["checkpoint"]))
        for linear, out, inp in LINEARS:
            weight = layer_name(1, linear)
            w = source[weight].float()
            pruned = prune_rows(w, w.abs(), kept_count(inp, sparsity))
            assert ((pruned != 0).sum(1) == kept_count(inp, sparsity)).all()
            got = codec.decode(codec.from_tensors(weight, found, out, inp))
            want = (pruned.to(torch.bfloat16).float() if values == "bfloat16"
                    else codec.decode(codec.encode(pruned, "int8")))
            assert torch.equal(got, want), (name, weight)


def _stored_dense(sparse: Path, dst: Path) -> Path:
    """The sparse checkpoint's weights decoded and stored dense (fp32, no
    sparsity_config): the same pruned model in the dense form."""
    found = read_all(sparse)
    config = json.loads((sparse / "config.json").read_text())
    for module in config.pop("sparsity_config")["modules"]:
        out, inp = next((o, i) for linear, o, i in LINEARS if f".{linear}." in module)
        found[module] = codec.decode(codec.from_tensors(module, found, out, inp))
    dst.mkdir()
    for path in sparse.iterdir():
        if path.suffix not in (".safetensors",) and path.name != "config.json" \
                and path.name != "model.safetensors.index.json":
            shutil.copy(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in found.items() if ".sparse_" not in n},
              dst / "model.safetensors")
    return dst


def test_each_variant_generates_what_its_pruned_weights_stored_dense_do(sparse_run, cache_dir,
                                                                        tmp_path):
    _, report, _ = sparse_run
    requests, warmup = workload_for(BenchConfig(TINY, cache_dir=cache_dir))
    digests = set()
    for name in VARIANTS:
        r = report["results"][name]
        dense = _stored_dense(Path(r["checkpoint"]), tmp_path / name)
        ref = run_fusegen(dense, requests, warmup, dtype="float32", device="cpu",
                          engine_options={"enable_prefix_caching": True},
                          progress=lambda _: None)
        # the dense form indeed, as the dense run's
        assert ref.extra["quantization"] == report["results"]["fusegen"]["quantization"]
        assert ref.extra["output_digest"] == r["output_digest"], name
        digests.add(r["output_digest"])
    assert report["results"]["fusegen"]["output_digest"] not in digests  # pruning shows


def test_figures_are_the_runs_own(sparse_run):
    stdout, report, page = sparse_run
    results, sparse = report["results"], report["sparse"]
    dense_step = median(results["fusegen"]["decode_step_times_s"])
    for row in sparse["rows"]:
        r = results[row["name"]]
        assert row["decode_step_median_s"] == median(r["decode_step_times_s"])
        assert row["decode_speedup"] == pytest.approx(dense_step / row["decode_step_median_s"])
        assert row["output_tokens_per_s"] == r["output_tokens_per_s"]
        assert row["throughput_ratio"] == pytest.approx(
            r["output_tokens_per_s"] / results["fusegen"]["output_tokens_per_s"])
        assert "offload" not in row  # everything resident
    for values in ("bfloat16", "int8"):  # the lowest sparsity from which every one wins
        wins = [s for s in SPARSITIES if sparse["rows"][_index(sparse, s, values)]
                ["decode_speedup"] > 1]
        want = next((s for s in SPARSITIES if all(w in wins for w in SPARSITIES if w >= s)),
                    None)
        assert sparse["wins_from"][values] == want
    lines = stdout[stdout.index("sparse weights (magnitude pruning"):].splitlines()
    assert re.match(r"fusegen sparse 50% bf16 +42,120 +0\.29x", lines[3]), lines[3]
    assert any(line.startswith("sparse int8 values decode faster than dense ")
               for line in lines)
    # the page: a row per run carrying the JSON's exact figures, a bar per run
    section = page[page.index("<h2>Sparse weights</h2>"):page.index("<h2>Memory plan</h2>")]
    cells = {first: re.findall(r'data-value="([^"]*)"', rest)
             for first, rest in re.findall(r"<tr><td>([^<]*)</td>(.*?)</tr>", section)}
    for row in sparse["rows"]:
        assert cells[row["label"]] == [json.dumps(row[k]) for k in (
            "linear_bytes_per_layer", "bytes_ratio", "decode_step_median_s", "decode_speedup",
            "output_tokens_per_s", "throughput_ratio")]
    assert section.count('class="sparse-bar"') == len(sparse["rows"])


def _index(sparse: dict, sparsity: float, values: str) -> int:
    return next(i for i, row in enumerate(sparse["rows"])
                if row.get("sparsity") == sparsity and row.get("values") == values)


def test_offload_pruned_model_streams_fewer_bytes(cache_dir):
    # The tiny shape in bf16 with six layers and a device budget of two dense layers
    # (and two staging slots): the model pruned to 30% (bf16 values, 0.77x the bytes)
    # keeps three resident under the same budget and streams the others' tiles.
    tiny = PRESETS["tiny"]
    preset = replace(tiny, name="tiny-offload",
                     model=replace(tiny.model, num_layers=6, dtype="bfloat16"), num_requests=4,
                     offload=OffloadSpec(resident_fraction=1 / 3, host_memory="0"))
    report = run_benchmark(BenchConfig(preset, cache_dir=cache_dir, hf_static=False,
                                       hf_continuous=False, sparsities=(0.3,)))
    dense, sparse = report["sparse"]["rows"]
    assert dense["offload"]["layers"] == {"device": 2, "host": 0, "disk": 4}
    assert sparse["offload"]["layers"] == {"device": 3, "host": 0, "disk": 3}
    for row in (dense, sparse):  # a streamed layer: its linears and two bf16 norms of 64
        per_layer = row["linear_bytes_by_layer"][-1] + 2 * 64 * 2
        assert row["offload"]["streamed_bytes_per_step"] == \
            row["offload"]["layers"]["disk"] * per_layer
        assert row["offload"]["stall_per_step_s"] >= 0
    assert sparse["linear_bytes_by_layer"][-1] < dense["linear_bytes_by_layer"][-1] == 73728
    assert report["results"]["fusegen_sparse30_bfloat16"]["budgets_met"]
    assert report["results"]["fusegen_sparse30_bfloat16"]["offload"][
        "streamed_bytes_per_step"] == sparse["offload"]["streamed_bytes_per_step"]


@pytest.fixture(scope="module")
def tiny_gguf(llama_dir, tmp_path_factory):
    """The session's tiny Llama as a Q8_0 GGUF file."""
    return write_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", qtype=Q.Q8_0)


@pytest.mark.parametrize("kind", ["hf_dir", "gguf"])
def test_a_real_model_is_pruned_beside_its_dense_run(kind, llama_dir, tiny_gguf, tmp_path):
    # A checkpoint directory, and a GGUF file (pruned from its dequantized weights); with
    # --quantization, the dense run takes it and the pruned ones run their tiles.
    path = llama_dir if kind == "hf_dir" else tiny_gguf
    form = ["--quantization", "dequantize"] if kind == "gguf" else []
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, [
        "--preset", "tiny", "--requests", "3", "--skip-hf", "--model", str(path), *form,
        "--sparsity", "0.5", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    dense, sparse = report["results"]["fusegen"], report["results"]["fusegen_sparse50_bfloat16"]
    assert dense["quantization"] == "dequantize" and sparse["quantization"] == "sparse"
    assert sparse["budgets_met"] and sparse["num_output_tokens"] == dense["num_output_tokens"]
    checkpoint = Path(sparse["checkpoint"])
    assert checkpoint.parent == tmp_path / "cache" / "bench" / "sparse"
    shapes = {n: t.shape for n, t in read_all(llama_dir).items()}
    found = read_all(checkpoint)
    modules = json.loads((checkpoint / "config.json").read_text())["sparsity_config"]["modules"]
    want = [sum(codec.nbytes(codec.from_tensors(m, found, *shapes[m])) for m in modules
                if f".layers.{i}." in m) for i in range(len(sparse["linear_bytes_by_layer"]))]
    assert sparse["linear_bytes_by_layer"] == want
    dense_bytes = 2 if report["config"]["dtype"] == "bfloat16" else 4
    assert dense["linear_bytes_by_layer"][0] == dense_bytes * sum(
        shapes[m].numel() for m in modules if ".layers.0." in m)
    assert report["sparse"]["rows"][0]["label"] == "fusegen dense"


@pytest.mark.parametrize("args, named", [
    (["--sparsity", "1"], "--sparsity 1 is outside (0, 1)"),
    (["--sparsity", "0.5,0"], "--sparsity 0 is outside (0, 1)"),
    (["--sparsity", "nan"], "--sparsity nan is outside (0, 1)"),
    (["--sparsity", "70%"], "got '70%'"),
    (["--sparse-values", "int8"], "--sparse-values applies to the sparse runs; pass "
                                  "--sparsity too"),
    (["--sparsity", "0.5", "--sparse-values", "fp8"], "'fp8' is not one of"),
    # 64 inputs keep round(0.004 x 64) = 0 weights a row: sparsify refuses, before any run
    (["--sparsity", "0.996"], "sparsity 0.996 keeps no weight"),
])
def test_bad_sparse_options_are_usage_errors(args, named, cache_dir):
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "2", "--skip-hf",
                                        "--cache-dir", str(cache_dir), *args])
    assert result.exit_code == 2, result.output
    assert named in result.output, result.output
    assert "generating" not in result.output  # nothing ran
