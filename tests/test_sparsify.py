"""`fusegen sparsify` (jobs/sparsify_cmd.py, engine/weights/sparsify.py): each row keeps
exactly its count, magnitude keeps the top |w| set and Wanda the top |w| * ||x|| set
(the norms computed here from transformers' own forward pass, MoE experts' on the
tokens routed to them), the written tiles decode to the pruned weights (exactly, or
within int8's rounding), the config entry, the report's exact bytes, and each bad
input's error with nothing written."""
import json
from functools import partial
import re
from pathlib import Path

import pytest
import torch

from checkpoints import make_hf_checkpoint
from quant_helpers import (LINEAR_SUFFIXES, MOE, PROMPTS, assert_usage_error, is_linear,
                           read_all, run_command, source_tensors)
from sparsify_helpers import check_written, decoded, layer_bytes, top_mask
from fusegen.engine.weights import quantize as qz
from fusegen.engine.weights import sparsify as sp
from fusegen.kernels import sparse_format

run_cli = partial(run_command, "sparsify")


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    """Llama whose linears cut tiles at their edges: 96 hidden, 160 intermediate."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("odd"), "llama", hidden_size=96,
                              intermediate_size=160)


def test_kept_count_rounds_half_to_even():
    assert sp.kept_count(64, 0.5) == 32
    assert sp.kept_count(128, 0.7) == 38  # 38.4
    assert sp.kept_count(64, 0.3) == 45  # 44.8, although 1 - 0.3 is 0.7 - 2^-53 as floats
    assert sp.kept_count(10, 0.25) == 8  # 7.5: to the even 8
    assert sp.kept_count(10, 0.35) == 6  # 6.5: to the even 6
    assert sp.kept_count(10, 0.99) == 0


def test_equal_scores_keep_the_lower_column():
    w = torch.tensor([[1.0, -1.0, 1.0, 0.5], [0.5, 2.0, -2.0, 2.0]])
    got = sp.prune_rows(w, w.abs(), 2)
    assert torch.equal(got, torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.0, 2.0, -2.0, 0.0]]))


@pytest.mark.parametrize("values", ["bf16", "fp32", "int8"])
def test_magnitude_round_trip(odd_dir, tmp_path, values):
    out = tmp_path / "s"
    result = run_cli("--model", odd_dir, "--sparsity", 0.5, "--values", values,
                     "--output", out)
    assert result.exit_code == 0, result.output
    written = read_all(out)
    assert check_written(source_tensors(odd_dir), written, 0.5, values) == 14
    config = json.loads((out / "config.json").read_text())
    linears = sorted(n for n in source_tensors(odd_dir) if is_linear(n))
    assert config["sparsity_config"] == {
        "format": "fusegen-bitmap-tiles", "version": 1, "tile": [64, 64],
        "values": {"bf16": "bfloat16", "fp32": "float32", "int8": "int8"}[values],
        "sparsity": 0.5, "method": "magnitude", "modules": linears}
    source_config = json.loads((odd_dir / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "sparsity_config"} == source_config
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (odd_dir / name).read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no staging directory left
    # the report: per layer and in total, dense bytes (fp32 source) against the format's
    value_name = {"bf16": "bfloat16", "fp32": "float32", "int8": "int8"}[values]
    assert f"bytes of the decoder linears, dense (float32) against sparse ({value_name} " \
        f"values, bitmaps, offsets{', scales' if values == 'int8' else ''}):" in result.output
    for i in (0, 1):
        names = [n for n in linears if f".layers.{i}." in n]
        dense = sum(4 * source_tensors(odd_dir)[n].numel() for n in names)
        sparse = sum(layer_bytes(written, n) for n in names)
        assert f"layer {i}: 7 linears, {dense} B dense -> {sparse} B sparse" in result.output
    total = sum(layer_bytes(written, n) for n in linears)
    assert re.search(rf"total: 14 linears, \d+ B dense -> {total} B sparse", result.output)


def test_source_dtype_kept_by_default(tmp_path):
    src = make_hf_checkpoint(tmp_path / "src", "llama", torch_dtype="bfloat16")
    state = source_tensors(src)
    if state["model.layers.0.mlp.up_proj.weight"].dtype != torch.bfloat16:
        from safetensors.torch import load_file, save_file

        bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
        save_file(bf16, src / "model.safetensors", metadata={"format": "pt"})
        state = source_tensors(src)
    sp.sparsify_checkpoint(src, tmp_path / "s", sp.SparsifySpec(0.7))
    assert json.loads((tmp_path / "s" / "config.json").read_text())[
        "sparsity_config"]["values"] == "bfloat16"
    check_written(state, read_all(tmp_path / "s"), 0.7, "bf16")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "phi3"])
def test_moe_experts_and_fused_tensors(tmp_path, arch):
    src = make_hf_checkpoint(tmp_path / "src", arch, **MOE.get(arch, {}))
    report = sp.sparsify_checkpoint(src, tmp_path / "s", sp.SparsifySpec(0.75, values="fp16"))
    written = read_all(tmp_path / "s")
    num_linears = 2 * (4 + 3 * 4) if arch in MOE else 2 * 4
    assert check_written(source_tensors(src), written, 0.75, "fp16") == num_linears
    assert report.num_quantized == len(report.layers) == num_linears
    router = {"qwen3_moe": "model.layers.1.mlp.gate.weight",
              "mixtral": "model.layers.1.block_sparse_moe.gate.weight"}.get(arch)
    if router:  # the router stays dense
        assert written[router].dtype == torch.float32


def test_sharded_output(odd_dir, tmp_path):
    report = sp.sparsify_checkpoint(odd_dir, tmp_path / "s", sp.SparsifySpec(0.5),
                                    max_shard_bytes=100_000)
    assert report.num_files > 2
    written = read_all(tmp_path / "s")
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(written)
    check_written(source_tensors(odd_dir), written, 0.5, "fp32")


# -- Wanda ----------------------------------------------------------------------------

def reference_norms(src: Path, arch: str) -> dict[str, torch.Tensor]:
    """Each linear's input L2 norm per channel over the prompts' tokens, from
    transformers' fp32 forward pass (each prompt alone, tokenized with its special
    tokens as fusegen does). An MoE expert's: over the tokens its router sends it
    (softmax top-k of the router's logits), down's input computed from its weights."""
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    config, weights = model.config, source_tensors(src)
    seen: dict[str, list] = {}
    hooks = []
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        tracked = isinstance(module, torch.nn.Linear) and short in LINEAR_SUFFIXES \
            and ".experts." not in name
        if arch in MOE and short in ("block_sparse_moe", "mlp") and ".layers." in name:
            tracked = True  # the MoE block's input: what its router and experts read
        if tracked:
            hooks.append(module.register_forward_hook(
                lambda mod, args, out, key=name: seen.setdefault(key, []).append(
                    args[0].reshape(-1, args[0].shape[-1]).detach())))
    with torch.no_grad():
        for prompt in PROMPTS:
            model(torch.tensor([tokenizer.encode(prompt, add_special_tokens=True).ids]))
    for hook in hooks:
        hook.remove()
    inputs = {key: torch.cat(rows) for key, rows in seen.items()}
    norms = {}
    for key, x in inputs.items():
        if key.endswith(("block_sparse_moe", "mlp")):  # Mixtral's is mlp in transformers 5
            layer = key.removesuffix(".block_sparse_moe").removesuffix(".mlp")
            block = layer + (".block_sparse_moe" if arch == "mixtral" else ".mlp")
            norms |= expert_norms(block, x, weights, config, arch)
            continue
        norms[key + ".weight"] = x.norm(dim=0)
    return norms


def expert_norms(block: str, x: torch.Tensor, weights: dict, config, arch: str) -> dict:
    k = config.num_experts_per_tok
    num_experts = MOE[arch].get("num_experts") or MOE[arch]["num_local_experts"]
    logits = x @ weights[block + ".gate.weight"].float().t()  # [T, E]
    routed = torch.topk(torch.softmax(logits, -1), k, dim=-1).indices  # [T, k]
    names = {"mixtral": ("w1", "w3", "w2"),
             "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}[arch]
    norms = {}
    for e in range(num_experts):
        rows = x[(routed == e).any(-1)]
        assert rows.shape[0] > 0, (block, e)
        base = f"{block}.experts.{e}."
        gate, up, down = (weights[base + n + ".weight"].float() for n in names)
        hidden = torch.nn.functional.silu(rows @ gate.t()) * (rows @ up.t())
        norms[base + names[0] + ".weight"] = norms[base + names[1] + ".weight"] = rows.norm(dim=0)
        norms[base + names[2] + ".weight"] = hidden.norm(dim=0)
    return norms


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3", "qwen3_moe", "mixtral"])
def test_wanda_keeps_top_weight_times_input_norm(tmp_path, arch):
    """Each row keeps the top |w| * ||x_k|| of norms computed here independently of
    fusegen's engine. The two fp32 passes round differently (about 1e-6 relative), so
    a row whose kept and dropped scores lie within 1e-4 of each other at the boundary
    (a near tie) is checked by that tolerance instead of by the exact set."""
    src = make_hf_checkpoint(tmp_path / "src", arch, **MOE.get(arch, {}))
    calibration = tmp_path / "prompts.txt"
    calibration.write_text("\n".join(PROMPTS) + "\n")
    result = run_cli("--model", src, "--sparsity", 0.6, "--method", "wanda",
                     "--calibration", calibration, "--output", tmp_path / "s")
    assert result.exit_code == 0, result.output
    assert "no calibration tokens routed" not in result.output
    source, written = source_tensors(src), read_all(tmp_path / "s")
    assert json.loads((tmp_path / "s" / "config.json").read_text())[
        "sparsity_config"]["method"] == "wanda"
    norms = reference_norms(src, arch)
    linears = [name for name in source if is_linear(name)]
    assert set(norms) == set(linears)
    masks, near_ties, differs = {}, 0, 0
    for name in linears:
        w = source[name].float()
        kept = sp.kept_count(w.shape[1], 0.6)
        scores = w.abs() * norms[name]
        want = top_mask(scores, kept)
        got = sparse_format.decode(decoded(written, name, w.shape)) != 0
        assert (got.sum(1) == kept).all(), name
        ordered = scores.sort(dim=1, descending=True).values
        gap = (ordered[:, kept - 1] - ordered[:, kept]) / ordered[:, kept - 1]
        exact = gap > 1e-4
        assert torch.equal(got[exact], want[exact]), name
        for row in (~exact).nonzero().flatten().tolist():
            near_ties += 1
            lowest_kept = scores[row][got[row]].min()
            highest_dropped = scores[row][~got[row]].max()
            assert lowest_kept >= highest_dropped * (1 - 1e-4), (name, row)
        differs += int((got != top_mask(w.abs(), kept)).any(1).sum())
        masks[name] = got
    total_rows = sum(source[n].shape[0] for n in linears)
    assert near_ties <= total_rows // 100
    assert differs > total_rows // 4  # the norms changed many rows' choice from magnitude's
    check_written(source, written, 0.6, "fp32", masks=masks)


def test_wanda_expert_without_tokens_pruned_by_magnitude(tmp_path):
    """Layer 0's router never picks expert 4 (its row zero, the others v, -v, u, -u):
    that expert's linears are pruned by magnitude, and the report says so."""
    from safetensors.torch import load_file, save_file

    src = make_hf_checkpoint(tmp_path / "src", "qwen3_moe",
                             **{**MOE["qwen3_moe"], "num_experts": 5})
    state = load_file(src / "model.safetensors")
    router = state["model.layers.0.mlp.gate.weight"]
    v, u = router[0].clone(), router[2].clone()
    state["model.layers.0.mlp.gate.weight"] = torch.stack([v, -v, u, -u, 0 * v])
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    report = sp.sparsify_checkpoint(src, tmp_path / "s", sp.SparsifySpec(0.5, "wanda"),
                                    prompts=PROMPTS)
    base = "model.layers.0.mlp.experts.4."
    assert report.by_magnitude == [base + n + ".weight"
                                   for n in ("gate_proj", "up_proj", "down_proj")]
    written, source = read_all(tmp_path / "s"), source_tensors(src)
    for name in report.by_magnitude:
        w = source[name].float()
        got = sparse_format.decode(decoded(written, name, w.shape)) != 0
        assert torch.equal(got, top_mask(w.abs(), 32)), name


# -- errors ---------------------------------------------------------------------------

def test_bad_inputs(odd_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "s"
    base = ("--model", odd_dir, "--output", out)
    for bad in ("0", "1", "1.5", "-0.2"):
        assert_usage_error(run_cli(*base, "--sparsity", bad), "'--sparsity'",
                           "sparsity must be between 0 and 1 (exclusive)", f"got {float(bad)}",
                           out=out)
    assert_usage_error(run_cli(*base, "--sparsity", 0.995), "'--sparsity'",
                       "sparsity 0.995 keeps no weight of tensor "
                       "'model.layers.0.self_attn.q_proj.weight''s rows of 96", out=out)
    assert_usage_error(run_cli(*base, "--sparsity", 0.5, "--method", "wanda"),
                       "'--calibration'", "--method wanda needs calibration prompts", out=out)
    wanda = (*base, "--sparsity", 0.5, "--method", "wanda", "--calibration")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    assert_usage_error(run_cli(*wanda, blank), "blank.txt: no calibration prompts", out=out)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), parquet)
    assert_usage_error(run_cli(*wanda, parquet), "'--calibration-column'",
                       "p.parquet: no column 'prompt' (columns: text)", out=out)
    assert_usage_error(run_cli(*wanda, tmp_path / "missing.jsonl"),
                       "missing.jsonl: no such calibration file", out=out)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert_usage_error(run_cli(*base, "--sparsity", 0.5, "--calibration", prompts),
                       "--calibration is used only by --method wanda", out=out)
    assert_usage_error(run_cli(*base, "--sparsity", 0.5, "--values", "int4"), "'--values'",
                       "'int4' is not one of", out=out)
    sparse = tmp_path / "sparse"
    sp.sparsify_checkpoint(odd_dir, sparse, sp.SparsifySpec(0.5))
    entry = json.dumps(json.loads((sparse / "config.json").read_text())["sparsity_config"])
    assert_usage_error(run_cli("--model", sparse, "--sparsity", 0.5, "--output", out),
                       "'--model'", f"sparse: already sparse (config.json's sparsity_config is "
                       f"{entry}); sparsify the 16-bit checkpoint it was made from", out=out)
    quantized = tmp_path / "quantized"
    qz.quantize_checkpoint(odd_dir, quantized, qz.QuantizeSpec(8, 32, True))
    assert_usage_error(run_cli("--model", quantized, "--sparsity", 0.5, "--output", out),
                       "'--model'", "quantized: already quantized (config.json's "
                       "quantization_config is", "sparsify the 16-bit checkpoint", out=out)
    # quantize refuses a sparse source likewise
    result = run_command("quantize", "--model", sparse, "--bits", 8, "--output", out)
    assert result.exit_code == 2 and "already sparse" in result.output \
        and "quantize the 16-bit checkpoint" in result.output
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    for file in odd_dir.iterdir():
        (unknown / file.name).write_bytes(file.read_bytes())
    config = json.loads((unknown / "config.json").read_text())
    config["architectures"], config["model_type"] = ["BertForMaskedLM"], "bert"
    (unknown / "config.json").write_text(json.dumps(config))
    result = run_cli("--model", unknown, "--sparsity", 0.5, "--output", out)
    assert_usage_error(result, "'--model'", "BertForMaskedLM", out=out)
    out.mkdir()
    result = run_cli(*base, "--sparsity", 0.5)
    assert result.exit_code == 2 and "already exists; pass --overwrite" in result.output
    assert list(out.iterdir()) == []
    result = run_cli(*base, "--sparsity", 0.5, "--overwrite")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["sparsity_config"]["sparsity"] == 0.5


# -- running what it wrote ----------------------------------------------------------

@pytest.mark.parametrize("arch,method", [("llama", "magnitude"), ("qwen3_moe", "wanda"),
                                         ("phi3", "magnitude")])
def test_written_checkpoint_runs_as_pruned_dense(tmp_path, arch, method):
    """fusegen runs the sparse checkpoint (its linears as sparse tiles) and gives the
    greedy fp32 tokens of the same pruned weights written dense."""
    from fusegen import LLM, SamplingParams

    src = make_hf_checkpoint(tmp_path / "src", arch, **MOE.get(arch, {}))
    spec = sp.SparsifySpec(0.5, method)
    prompts = PROMPTS if method == "wanda" else None
    sp.sparsify_checkpoint(src, tmp_path / "sparse", spec, prompts=prompts)
    sp.sparsify_checkpoint(src, tmp_path / "dense", spec, prompts=prompts, dense=True)
    written, dense = read_all(tmp_path / "sparse"), read_all(tmp_path / "dense")
    assert "sparsity_config" not in json.loads((tmp_path / "dense" / "config.json").read_text())
    for name, w in dense.items():  # the dense copy holds exactly the decoded tiles
        if is_linear(name):
            assert torch.equal(sparse_format.decode(decoded(written, name, w.shape)), w), name
        else:
            assert torch.equal(written[name], w), name
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for form in ("sparse", "dense"):
        with LLM(str(tmp_path / form), dtype="float32", device="cpu") as llm:
            qkv = type(llm.engine.runner.model.layers[0].qkv).__name__
            assert ("Sparse" in qkv) == (form == "sparse"), qkv  # the tiles, not dense
            tokens[form] = [o.token_ids for o in llm.generate(
                ["Hello world", "The quick brown fox", "1 2 3"], params, use_tqdm=False)]
    assert tokens["sparse"] == tokens["dense"]


def test_tiles_encoded_again_past_the_cache(odd_dir, tmp_path, monkeypatch):
    """Past the planning cache's budget each linear is pruned and encoded again when
    written: the same bytes as when every linear's tiles were kept."""
    sp.sparsify_checkpoint(odd_dir, tmp_path / "cached", sp.SparsifySpec(0.6, values="int8"))
    monkeypatch.setattr(sp, "_CACHE_BYTES", 20_000)  # a few linears' tiles, not all
    sp.sparsify_checkpoint(odd_dir, tmp_path / "again", sp.SparsifySpec(0.6, values="int8"))
    assert (tmp_path / "cached" / "model.safetensors").read_bytes() == \
        (tmp_path / "again" / "model.safetensors").read_bytes()
