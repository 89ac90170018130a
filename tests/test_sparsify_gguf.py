"""`fusegen sparsify --model X.gguf`: a GGUF file is read as `fusegen quantize` reads it
(dequantized to fp32, its config and tokenizer written from the metadata), each row of
its decoder linears keeps exactly its count of the largest dequantized |w| (Wanda: of
|w| * ||x||, the same choice as on the same weights stored as a checkpoint directory),
the kept values are the dequantized ones in bf16 by default, the tied embeddings stay
dense and the head stays tied; the sparse checkpoint generates the greedy tokens of the
same pruned weights stored dense; a truncated or missing file is refused by name with
nothing written."""
import json
from functools import partial

import pytest
import torch
from safetensors.torch import save_file

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from quant_helpers import PROMPTS, assert_usage_error, is_linear, read_all, run_command
from sparsify_helpers import check_written, decoded
from fusegen.engine.weights import sparsify as sp
from fusegen.kernels import sparse_format

run_cli = partial(run_command, "sparsify")
GENERATE_PROMPTS = ["Hello world", "The quick brown fox", "1 2 3"]


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    """A tied-embedding llama (96 hidden, 160 intermediate: tiles cut at the edges) as
    a Q4_1 GGUF file, the type SmolLM2-135M's file holds: (the Hugging Face dir, file)."""
    root = tmp_path_factory.mktemp("gguf")
    src = make_hf_checkpoint(root / "src", "llama", seed=5, hidden_size=96,
                             intermediate_size=160, tie_word_embeddings=True)
    return src, write_gguf(src, root / "tiny.gguf", qtype=Q.Q4_1)


def dequantized(path) -> dict[str, torch.Tensor]:
    """The file's tensors under Hugging Face names, dequantized to fp32 (no head: tied)."""
    from fusegen.engine.weights.gguf import gguf_model_config, load_gguf_state_dict

    state = load_gguf_state_dict(path, gguf_model_config(path), torch.float32)
    return {name: lazy.load() for name, lazy in state.items()}


@pytest.mark.parametrize("values", [None, "fp32", "int8"])
def test_pruned_from_the_dequantized_weights(tied_gguf, tmp_path, values):
    src, gguf = tied_gguf
    out = tmp_path / "s"
    result = run_cli("--model", gguf, "--sparsity", 0.7, "--output", out,
                     *(("--values", values) if values else ()))
    assert result.exit_code == 0, result.output
    weights = dequantized(gguf)
    assert "lm_head.weight" not in weights
    # linears scored in fp32 and stored in --values (bf16 by default); the embeddings
    # and norms written in bf16, as `fusegen quantize` writes a GGUF file's
    expected = {name: w if is_linear(name) else w.to(torch.bfloat16)
                for name, w in weights.items()}
    written = read_all(out)
    assert check_written(expected, written, 0.7, values or "bf16") == 14
    for name, w in weights.items():  # 96 -> 29 kept (28.8), 160 -> 48 kept
        if is_linear(name):
            tiles = decoded(written, name, w.shape)
            counts = (sparse_format.decode(sparse_format.SparseTiles(
                tiles.bitmap, tiles.offsets, torch.ones(tiles.nnz), None, *w.shape)) != 0).sum(1)
            assert (counts == sp.kept_count(w.shape[1], 0.7)).all(), name
            assert sp.kept_count(w.shape[1], 0.7) == {96: 29, 160: 48}[w.shape[1]]
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"
    assert config["sparsity_config"]["values"] == \
        {None: "bfloat16", "fp32": "float32", "int8": "int8"}[values]
    assert config["sparsity_config"]["modules"] == sorted(n for n in weights if is_linear(n))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == json.loads((src / "config.json").read_text())[key], key
    assert {"tokenizer.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    assert "dense (bfloat16) against sparse" in result.output  # a GGUF's 16-bit form


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_runs_as_the_pruned_weights_stored_dense(tied_gguf, tmp_path, method):
    """Greedy fp32: the sparse checkpoint made from the GGUF file (its linears sparse
    tiles, its head the tied dense embeddings) gives the tokens of the same pruned
    weights written dense."""
    from fusegen import LLM, SamplingParams

    _, gguf = tied_gguf
    prompts = PROMPTS if method == "wanda" else None
    spec = sp.SparsifySpec(0.5, method)
    sp.sparsify_checkpoint(gguf, tmp_path / "sparse", spec, prompts=prompts)
    sp.sparsify_checkpoint(gguf, tmp_path / "dense", spec, prompts=prompts, dense=True)
    written, dense = read_all(tmp_path / "sparse"), read_all(tmp_path / "dense")
    assert set(dense) == {n for n in dequantized(gguf)}  # no head written: tied
    for name, w in dense.items():  # the dense copy holds exactly the decoded tiles
        assert w.dtype == torch.bfloat16, name
        if is_linear(name):
            assert torch.equal(sparse_format.decode(decoded(written, name, w.shape))
                               .to(torch.bfloat16), w), name
        else:
            assert torch.equal(written[name], w), name
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for form in ("sparse", "dense"):
        with LLM(str(tmp_path / form), dtype="float32", device="cpu") as llm:
            model = llm.engine.runner.model
            assert ("Sparse" in type(model.layers[0].qkv).__name__) == (form == "sparse")
            assert "Sparse" not in type(model.lm_head).__name__
            tokens[form] = [o.token_ids for o in llm.generate(
                GENERATE_PROMPTS, params, use_tqdm=False)]
    assert tokens["sparse"] == tokens["dense"]
    assert len({tuple(t) for t in tokens["sparse"]}) > 1  # not one degenerate answer


def test_wanda_chooses_as_on_the_same_weights_in_a_directory(tied_gguf, tmp_path):
    """Wanda on the GGUF file keeps exactly the weights it keeps on a checkpoint
    directory holding the file's dequantized fp32 weights (whose Wanda choice
    tests/test_sparsify.py checks against transformers' activations), and its
    choice is not magnitude's."""
    src, gguf = tied_gguf
    weights = dequantized(gguf)
    directory = tmp_path / "dequantized"
    directory.mkdir()
    for file in src.iterdir():
        if file.name != "model.safetensors":
            (directory / file.name).write_bytes(file.read_bytes())
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    spec = sp.SparsifySpec(0.6, "wanda", values="fp32")
    report = sp.sparsify_checkpoint(gguf, tmp_path / "from_gguf", spec, prompts=PROMPTS)
    sp.sparsify_checkpoint(directory, tmp_path / "from_dir", spec, prompts=PROMPTS)
    assert report.by_magnitude == []
    from_gguf, from_dir = read_all(tmp_path / "from_gguf"), read_all(tmp_path / "from_dir")
    differs = total = 0
    for name, w in weights.items():
        if not is_linear(name):
            continue
        for suffix in sparse_format.SUFFIXES[:3]:
            assert torch.equal(from_gguf[f"{name}.{suffix}"], from_dir[f"{name}.{suffix}"]), \
                (name, suffix)
        got = sparse_format.decode(decoded(from_gguf, name, w.shape)) != 0
        differs += int((got != (sp.prune_rows(w, w.abs(), sp.kept_count(w.shape[1], 0.6))
                                != 0)).any(1).sum())
        total += w.shape[0]
    assert differs > total // 4


def test_bad_gguf_files(tied_gguf, tmp_path):
    _, gguf = tied_gguf
    out = tmp_path / "s"
    data = gguf.read_bytes()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[:100])  # inside the header
    assert_usage_error(run_cli("--model", truncated, "--sparsity", 0.5, "--output", out),
                       "'--model'", "cut.gguf: truncated: the GGUF header runs past the end "
                       "of the file (100 bytes)", out=out)
    truncated.write_bytes(data[:-8])  # the last tensor's bytes cut short
    assert_usage_error(run_cli("--model", truncated, "--sparsity", 0.5, "--output", out),
                       "'--model'", "cut.gguf: truncated: tensor", f"past the end of the file "
                       f"({len(data) - 8} bytes)", out=out)
    # Wanda: refused before the calibration pass loads anything
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    assert_usage_error(run_cli("--model", truncated, "--sparsity", 0.5, "--method", "wanda",
                               "--calibration", prompts, "--output", out),
                       "'--model'", "cut.gguf: truncated", out=out)
    assert_usage_error(run_cli("--model", tmp_path / "missing.gguf", "--sparsity", 0.5,
                               "--output", out),
                       "'--model'", "missing.gguf: no such GGUF file", out=out)
    result = run_cli("--model", gguf, "--sparsity", 0.5, "--output", gguf)
    assert result.exit_code == 2 and "the output would replace the source model" in \
        result.output, result.output
    assert gguf.read_bytes() == data
