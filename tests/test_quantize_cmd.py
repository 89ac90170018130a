"""`fusegen quantize` (jobs/quantize_cmd.py, engine/weights/quantize.py): what it writes
(codes equal to quantize_group's, the config entry, untouched tensors byte for byte,
tied embeddings, MoE experts, a GGUF source, shards), AWQ (its search never above
round-to-nearest, its folding leaving the fp32 model's logits as they were, MoE experts
and routers included; an expert without calibration rows left round-to-nearest), and
each bad argument's error."""
import json
from functools import partial
from pathlib import Path

import pytest
import torch

from checkpoints import load_hf, make_hf_checkpoint
from quant_helpers import (MOE, PROMPTS, assert_usage_error, is_linear, read_all, run_command,
                           source_tensors)
from fusegen.engine.weights import awq, quantize as qz
from fusegen.kernels.group_linear import dequantize_group, quantize_group

run_cli = partial(run_command, "quantize")


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """Llama with 128 hidden and 256 intermediate channels: every group size divides."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("wide"), "llama", hidden_size=128,
                              intermediate_size=256)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def check_quantized(source: dict, written: dict, bits: int, group_size: int,
                    symmetric: bool, cast=None) -> int:
    """Every source linear written as quantize_group's codes (whose dequantized weight
    is dequantize_group's), every other tensor byte for byte (or as `cast` makes it);
    nothing else written. Returns the linears counted."""
    expected, count = set(), 0
    for name, tensor in source.items():
        if not is_linear(name):
            want = tensor if cast is None else cast(tensor)
            assert same_bytes(written[name], want), name
            expected.add(name)
            continue
        base = name.removesuffix(".weight")
        ref = quantize_group(tensor.float(), bits, group_size, symmetric)
        got = (written[base + ".qweight"], written[base + ".scales"],
               written.get(base + ".zeros"))
        assert (got[2] is None) == symmetric, base
        for a, b in zip(got, ref):
            assert b is None or same_bytes(a, b), base
        in_features = tensor.shape[1]
        assert torch.equal(dequantize_group(*got, bits, group_size, in_features),
                           dequantize_group(*ref, bits, group_size, in_features))
        expected |= {base + ".qweight", base + ".scales"} | (set() if symmetric else
                                                             {base + ".zeros"})
        count += 1
    assert set(written) == expected
    return count


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_round_trip(wide_dir, tmp_path, bits, symmetric, group_size):
    out = tmp_path / "q"
    result = run_cli("--model", wide_dir, "--bits", bits, "--group-size", group_size,
                     "--symmetric" if symmetric else "--asymmetric", "--output", out)
    assert result.exit_code == 0, result.output
    assert check_quantized(source_tensors(wide_dir), read_all(out), bits, group_size,
                           symmetric) == 14  # 2 layers x q, k, v, o, gate, up, down
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fusegen", "bits": bits, "group_size": group_size,
        "symmetric": symmetric, "method": "rtn"}
    source_config = json.loads((wide_dir / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source_config
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (wide_dir / name).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    assert f"quantized 14 tensors to int{bits} (group {group_size}" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # no staging directory left


def test_tied_embeddings_written_once(qwen2_dir, tmp_path):
    out = tmp_path / "q"
    qz.quantize_checkpoint(qwen2_dir, out, qz.QuantizeSpec(8, 32, True))
    written = read_all(out)
    assert not any(name.startswith("lm_head") for name in written)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    source = source_tensors(qwen2_dir)
    assert same_bytes(written["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    # Qwen2's q/k/v biases stay dense beside the codes
    assert same_bytes(written["model.layers.0.self_attn.q_proj.bias"],
                      source["model.layers.0.self_attn.q_proj.bias"])
    check_quantized(source, written, 8, 32, True)


@pytest.mark.parametrize("arch,num_linears", [("qwen3_moe", 2 * (4 + 3 * 4)),
                                              ("mixtral", 2 * (4 + 3 * 4)),
                                              ("phi3", 2 * 4)])
def test_moe_experts_and_fused_tensors(tmp_path, arch, num_linears):
    src = make_hf_checkpoint(tmp_path / "src", arch, **MOE.get(arch, {}))
    report = qz.quantize_checkpoint(src, tmp_path / "q", qz.QuantizeSpec(4, 64, False))
    written = read_all(tmp_path / "q")
    assert check_quantized(source_tensors(src), written, 4, 64, False) == num_linears
    assert report.num_quantized == num_linears
    router = {"qwen3_moe": "model.layers.1.mlp.gate.weight",
              "mixtral": "model.layers.1.block_sparse_moe.gate.weight"}.get(arch)
    if router:  # the router stays dense
        assert router in written and written[router].dtype == torch.float32


def test_gguf_source(llama_dir, tmp_path):
    from gguf_checkpoints import Q, write_gguf

    from fusegen.engine.weights.gguf import gguf_model_config, load_gguf_state_dict

    path = write_gguf(llama_dir, tmp_path / "tiny.gguf", qtype=Q.Q8_0)
    out = tmp_path / "q"
    result = run_cli("--model", path, "--bits", 8, "--group-size", 32, "--output", out)
    assert result.exit_code == 0, result.output
    state = load_gguf_state_dict(path, gguf_model_config(path), torch.float32)
    source = {name: t.load() for name, t in state.items()}
    check_quantized(source, read_all(out), 8, 32, False, cast=lambda t: t.to(torch.bfloat16))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["quantization_config"]["bits"] == 8 and config["torch_dtype"] == "bfloat16"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= \
        {p.name for p in out.iterdir()}


def test_large_output_sharded_with_index(wide_dir, tmp_path):
    out = tmp_path / "q"
    report = qz.quantize_checkpoint(wide_dir, out, qz.QuantizeSpec(4, 32, True),
                                    max_shard_bytes=100_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert report.num_files == len(files) > 2
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    written = read_all(out)
    assert set(index["weight_map"]) == set(written)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in written.values())
    check_quantized(source_tensors(wide_dir), written, 4, 32, True)


def test_sharded_source_written_whole(tmp_path):
    src = make_hf_checkpoint(tmp_path / "src", "llama", max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()
    report = qz.quantize_checkpoint(src, tmp_path / "q", qz.QuantizeSpec(8, 64, False))
    assert report.num_files == 1  # small: one file, whatever the source's shards
    assert sorted(p.name for p in (tmp_path / "q").glob("model*")) == ["model.safetensors"]
    check_quantized(source_tensors(src), read_all(tmp_path / "q"), 8, 64, False)


def test_interrupted_run_leaves_nothing(wide_dir, tmp_path, monkeypatch):
    out = tmp_path / "q"
    qz.quantize_checkpoint(wide_dir, out, qz.QuantizeSpec(8, 32, True))
    before = (out / "model.safetensors").read_bytes()
    calls = []

    def fail(*args):  # the second shard's write is interrupted
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args)

    real = qz._write_shard
    monkeypatch.setattr(qz, "_write_shard", fail)
    with pytest.raises(KeyboardInterrupt):
        qz.quantize_checkpoint(wide_dir, out, qz.QuantizeSpec(4, 32, True), overwrite=True,
                               max_shard_bytes=100_000)
    assert (out / "model.safetensors").read_bytes() == before  # the old one untouched
    assert [p.name for p in tmp_path.iterdir()] == ["q"]
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        qz.quantize_checkpoint(wide_dir, tmp_path / "new", qz.QuantizeSpec(4, 32, True),
                               max_shard_bytes=100_000)
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


# -- AWQ ------------------------------------------------------------------------------

def down_error(dense_dir: Path, quantized_dir: Path, layer: int, spec,
               expert: int | None = None) -> float:
    """Mean squared error of layer `layer`'s down projection (a Qwen3-MoE `expert`'s, on
    the rows routed to it) on its calibration rows (run through `dense_dir`): x @ w.T
    against x @ dequantized.T, w from `dense_dir` and the codes from `quantized_dir`."""
    rows = awq.calibrate(qz.open_source(dense_dir), PROMPTS)[layer, "down", expert].rows
    mlp = "mlp" if expert is None else f"mlp.experts.{expert}"
    base = f"model.layers.{layer}.{mlp}.down_proj"
    w = read_all(dense_dir)[base + ".weight"].float()
    codes = read_all(quantized_dir)
    dense = dequantize_group(codes[base + ".qweight"], codes[base + ".scales"],
                             codes.get(base + ".zeros"), spec.bits, spec.group_size,
                             w.shape[1])
    return (rows @ w.t() - rows @ dense.t()).pow(2).mean().item()


def test_awq_error_not_above_round_to_nearest(wide_dir, tmp_path):
    spec = qz.QuantizeSpec(4, 32, False, "awq")
    calibration = tmp_path / "prompts.txt"
    calibration.write_text("\n".join(PROMPTS) + "\n")
    result = run_cli("--model", wide_dir, "--bits", 4, "--group-size", 32, "--method", "awq",
                     "--calibration", calibration, "--output", tmp_path / "awq")
    assert result.exit_code == 0, result.output
    assert "awq layer 0 qkv: alpha" in result.output
    report = qz.quantize_checkpoint(wide_dir, tmp_path / "awq2", spec, prompts=PROMPTS)
    assert set(report.searches) == {(i, g) for i in (0, 1)
                                    for g in ("qkv", "o", "gate_up", "down")}
    for alpha, error, rtn in report.searches.values():
        assert error <= rtn and 0.0 <= alpha <= 1.0
    assert any(error < rtn for _, error, rtn in report.searches.values())
    # Recomputed from the files: the down projections' output error on the calibration
    # rows, AWQ's (the folded model's weight and inputs, x / s) against round-to-nearest's.
    qz.quantize_checkpoint(wide_dir, tmp_path / "fold", spec, prompts=PROMPTS, dense=True)
    qz.quantize_checkpoint(wide_dir, tmp_path / "rtn", qz.QuantizeSpec(4, 32, False))
    for i in (0, 1):
        awq_error = down_error(tmp_path / "fold", tmp_path / "awq2", i, spec)
        rtn_error = down_error(wide_dir, tmp_path / "rtn", i, spec)
        assert awq_error < rtn_error
        assert awq_error == pytest.approx(report.searches[i, "down"][1], rel=1e-3)
        assert rtn_error == pytest.approx(report.searches[i, "down"][2], rel=1e-3)


def moe_groups(num_experts: int) -> set[str]:
    return {"qkv", "o", "moe gate_up"} | {f"expert {e} down" for e in range(num_experts)}


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),  # 2 kv heads for 4 query heads: o's scales shared per kv head
    ("qwen2", {"num_key_value_heads": 4}),  # o's scales through v's rows and bias
    ("gemma3", {"num_key_value_heads": 4}),  # norms applied as (1 + w)
    ("phi3", {}),  # q/k/v and gate/up in one tensor each
    ("qwen3_moe", {}),  # experts' gate/up, router and each expert's up / down rows
    ("mixtral", {}),
])
def test_awq_folding_keeps_fp32_logits(tmp_path, arch, overrides):
    src = make_hf_checkpoint(tmp_path / "src", arch, **MOE.get(arch, {}), **overrides)
    spec = qz.QuantizeSpec(4, 32, False, "awq")
    report = qz.quantize_checkpoint(src, tmp_path / "fold", spec, prompts=PROMPTS, dense=True)
    groups = {g for _, g in report.searches}
    assert groups == (moe_groups(4) if arch in MOE else {"qkv", "o", "gate_up", "down"})
    assert set(report.searches) == {(i, g) for i in (0, 1) for g in groups}
    assert report.round_to_nearest == []  # every expert got calibration rows
    for alpha, error, rtn in report.searches.values():  # alpha 0 is round-to-nearest
        assert error <= rtn and 0.0 <= alpha <= 1.0
    for group in groups:  # each kind of folding exercised: some layer's alpha above 0
        assert any(alpha > 0 for (_, g), (alpha, _, _) in report.searches.items() if g == group)
    assert "quantization_config" not in json.loads((tmp_path / "fold" / "config.json").read_text())
    folded, source = read_all(tmp_path / "fold"), source_tensors(src)
    assert any(not torch.equal(folded[name], source[name])  # scales were folded in
               for name in source if name.endswith("layernorm.weight"))
    if arch in MOE:  # the routers' columns took the experts' gate/up scales
        routers = [name for name in source if name.endswith(".gate.weight")]
        assert len(routers) == 2
        assert all(not torch.equal(folded[name], source[name]) for name in routers)
    ids = torch.tensor([[3, 17, 55, 101, 7, 9, 200, 12, 40, 41]])
    with torch.no_grad():
        want = load_hf(src)(ids).logits
        got = load_hf(tmp_path / "fold")(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_awq_expert_errors_from_files(tmp_path):
    """Each expert's down error recomputed from the written codes on its routed rows:
    AWQ's (the folded model's weight and inputs) and round-to-nearest's equal the
    report's, AWQ's below."""
    src = make_hf_checkpoint(tmp_path / "src", "qwen3_moe", **MOE["qwen3_moe"])
    spec = qz.QuantizeSpec(4, 32, False, "awq")
    report = qz.quantize_checkpoint(src, tmp_path / "awq", spec, prompts=PROMPTS)
    qz.quantize_checkpoint(src, tmp_path / "fold", spec, prompts=PROMPTS, dense=True)
    qz.quantize_checkpoint(src, tmp_path / "rtn", qz.QuantizeSpec(4, 32, False))
    for e in range(4):
        _, error, rtn = report.searches[1, f"expert {e} down"]
        awq_error = down_error(tmp_path / "fold", tmp_path / "awq", 1, spec, expert=e)
        rtn_error = down_error(src, tmp_path / "rtn", 1, spec, expert=e)
        assert awq_error < rtn_error
        assert awq_error == pytest.approx(error, rel=1e-3)
        assert rtn_error == pytest.approx(rtn, rel=1e-3)


def test_awq_expert_without_calibration_rows_is_round_to_nearest(tmp_path):
    """Layer 0's router never picks expert 4 (its row zero; the others v, -v, u, -u, so
    the top 2 logits are |x.v| and |x.u|, above 0): that expert's down is written as
    round-to-nearest's codes, reported so; its gate/up still take the shared scale."""
    from safetensors.torch import load_file, save_file

    src = make_hf_checkpoint(tmp_path / "src", "qwen3_moe",
                             **{**MOE["qwen3_moe"], "num_experts": 5})
    state = load_file(src / "model.safetensors")
    router = state["model.layers.0.mlp.gate.weight"]  # [5, h]
    v, u = router[0].clone(), router[2].clone()
    state["model.layers.0.mlp.gate.weight"] = torch.stack([v, -v, u, -u, 0 * v])
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})

    calibration = tmp_path / "prompts.txt"
    calibration.write_text("\n".join(PROMPTS) + "\n")
    result = run_cli("--model", src, "--bits", 4, "--group-size", 32, "--method", "awq",
                     "--calibration", calibration, "--output", tmp_path / "cli")
    assert result.exit_code == 0, result.output
    assert "awq layer 0 expert 4 down: no calibration rows routed to this expert, " \
        "round-to-nearest" in result.output
    assert "awq layer 0 moe gate_up: alpha" in result.output
    assert "awq layer 0 expert 3 down: alpha" in result.output
    spec = qz.QuantizeSpec(4, 32, False, "awq")
    report = qz.quantize_checkpoint(src, tmp_path / "awq", spec, prompts=PROMPTS)
    assert report.round_to_nearest == [(0, "expert 4 down")]
    assert set(report.searches) == {(i, g) for i in (0, 1) for g in moe_groups(5)} - {
        (0, "expert 4 down")}
    for alpha, error, rtn in report.searches.values():
        assert error <= rtn
    base = "model.layers.0.mlp.experts.4.down_proj"
    written = read_all(tmp_path / "awq")
    source = source_tensors(src)
    want = quantize_group(source[base + ".weight"].float(), 4, 32, False)
    assert all(same_bytes(written[base + suffix], t)
               for suffix, t in zip((".qweight", ".scales", ".zeros"), want))
    # its up rows are not divided (no down scale), its gate / up columns are scaled
    qz.quantize_checkpoint(src, tmp_path / "fold", spec, prompts=PROMPTS, dense=True)
    folded = read_all(tmp_path / "fold")
    s = folded["model.layers.0.mlp.experts.4.gate_proj.weight"] / \
        source["model.layers.0.mlp.experts.4.gate_proj.weight"]  # [I, h]: s in every row
    torch.testing.assert_close(folded["model.layers.0.mlp.experts.4.up_proj.weight"],
                               source["model.layers.0.mlp.experts.4.up_proj.weight"] * s[0])
    assert not torch.allclose(s[0], torch.ones_like(s[0]))
    ids = torch.tensor([[3, 17, 55, 101, 7, 9, 200, 12, 40, 41]])
    with torch.no_grad():
        want_logits = load_hf(src)(ids).logits
        got = load_hf(tmp_path / "fold")(ids).logits
    torch.testing.assert_close(got, want_logits, rtol=1e-4,
                               atol=1e-4 * want_logits.abs().max().item())


# -- errors ---------------------------------------------------------------------------

def test_bad_arguments(llama_dir, wide_dir, tmp_path):
    out = tmp_path / "q"
    base = ("--model", wide_dir, "--bits", 4, "--output", out)
    assert_usage_error(run_cli("--model", wide_dir, "--bits", 3, "--output", out),
                       "--bits", "'3' is not one of '8', '4'", out=out)
    assert_usage_error(run_cli(*base, "--group-size", 48), "--group-size",
                       "'48' is not one of '32', '64', '128'", out=out)
    assert_usage_error(run_cli("--model", llama_dir, "--bits", 4, "--group-size", 128,
                               "--output", out),
                       "'--group-size'", "tensor 'model.layers.0.self_attn.q_proj.weight' "
                       "has 64 input features, not a multiple of the group size 128", out=out)
    assert_usage_error(run_cli("--model", tmp_path / "nowhere", "--bits", 4, "--output", out),
                       "'--model'", "nowhere: no such checkpoint directory or .gguf file",
                       out=out)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_usage_error(run_cli("--model", empty, "--bits", 4, "--output", out), "'--model'",
                       "config.json: not found", out=out)
    quantized = tmp_path / "quantized"
    qz.quantize_checkpoint(wide_dir, quantized, qz.QuantizeSpec(8, 32, True))
    assert_usage_error(run_cli("--model", quantized, "--bits", 4, "--output", out), "'--model'",
                       "quantized: already quantized (config.json's quantization_config is "
                       '{"quant_method": "fusegen", "bits": 8, "group_size": 32, "symmetric": '
                       'true, "method": "rtn"}); quantize the 16-bit checkpoint', out=out)
    assert_usage_error(run_cli(*base, "--method", "awq"), "'--calibration'",
                       "--method awq needs calibration prompts", out=out)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    assert_usage_error(run_cli(*base, "--calibration", prompts), "'--calibration'",
                       "--calibration is used only by --method awq", out=out)
    awq = (*base, "--method", "awq", "--calibration")
    assert_usage_error(run_cli(*awq, tmp_path / "missing.jsonl"), "'--calibration'",
                       "missing.jsonl: no such calibration file", out=out)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    assert_usage_error(run_cli(*awq, blank), "blank.txt: no calibration prompts", out=out)
    csv = tmp_path / "p.csv"
    csv.write_text("prompt\nhello\n")
    assert_usage_error(run_cli(*awq, csv), "calibration files are .parquet, .jsonl or .txt",
                       out=out)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hi"}\n{"text": "hello"}\n')
    assert_usage_error(run_cli(*awq, jsonl, "--calibration-column", "text"),
                       "'--calibration-column'", "p.jsonl: line 1 has no key 'text'", out=out)
    jsonl.write_text('{"prompt": "hi"}\nnot json\n')
    assert_usage_error(run_cli(*awq, jsonl), "'--calibration'", "p.jsonl: line 2 is not JSON",
                       out=out)
    jsonl.write_text('{"prompt": 5}\n')
    assert_usage_error(run_cli(*awq, jsonl), "p.jsonl: line 1: the prompt is int, not text",
                       out=out)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert_usage_error(run_cli(*awq, binary), "binary.txt: not UTF-8 text", out=out)
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), parquet)
    assert_usage_error(run_cli(*awq, parquet), "'--calibration-column'",
                       "p.parquet: no column 'prompt' (columns: text)", out=out)
    pq.write_table(pa.table({"prompt": pa.array([None, ""], pa.string())}), parquet)
    assert_usage_error(run_cli(*awq, parquet), "p.parquet: no calibration prompts", out=out)
    out.mkdir()
    result = run_cli(*base)
    assert result.exit_code == 2 and "already exists; pass --overwrite" in result.output
    assert list(out.iterdir()) == []
    result = run_cli("--model", wide_dir, "--bits", 4, "--output", wide_dir, "--overwrite")
    assert result.exit_code == 2 and "the output would replace the source model" in result.output
    assert (wide_dir / "model.safetensors").is_file()


def test_calibration_files_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fusegen.jobs.quantize_cmd import read_prompts

    pq.write_table(pa.table({"prompt": ["a", None, "", "b", "c"], "x": [1, 2, 3, 4, 5]}),
                   tmp_path / "p.parquet")
    assert read_prompts(tmp_path / "p.parquet", "prompt", 2) == ["a", "b"]
    (tmp_path / "p.jsonl").write_text('{"q": "one"}\n\n{"q": "two"}\n')
    assert read_prompts(tmp_path / "p.jsonl", "q", 64) == ["one", "two"]
    (tmp_path / "p.txt").write_text("first line\r\n\nsecond\n")
    assert read_prompts(tmp_path / "p.txt", "ignored", 64) == ["first line", "second"]



# -- running what it wrote ----------------------------------------------------------

@pytest.mark.parametrize("arch,bits,symmetric,method", [
    ("wide", 8, True, "rtn"), ("wide", 4, False, "rtn"), ("wide", 4, True, "awq"),
    ("qwen3_moe", 4, False, "awq"), ("mixtral", 4, True, "awq"), ("gemma3", 4, False, "awq")])
def test_written_checkpoint_runs_as_dequantized(wide_dir, tmp_path, arch, bits, symmetric,
                                                method):
    """fusegen runs the written checkpoint compressed and gives the greedy fp32 tokens of
    the same checkpoint dequantized as it loads."""
    from fusegen import LLM, SamplingParams

    src = wide_dir if arch == "wide" else make_hf_checkpoint(tmp_path / "src", arch,
                                                             **MOE.get(arch, {}))
    out = tmp_path / "q"
    qz.quantize_checkpoint(src, out, qz.QuantizeSpec(bits, 32, symmetric, method),
                           prompts=PROMPTS if method == "awq" else None)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox", "1 2 3"]
    tokens = {}
    for form in (None, "dequantize"):
        with LLM(str(out), dtype="float32", device="cpu", quantization=form) as llm:
            linear = type(llm.engine.runner.model.layers[0].qkv).__name__
            assert (linear == "GroupQuantLinear") == (form is None), linear
            tokens[form] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[None] == tokens["dequantize"]
