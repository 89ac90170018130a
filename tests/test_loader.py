"""Checkpoint loading: what is refused, and that every error names the file and the fix."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import hf_greedy
from fusegen.engine import LLM, ModelLoadError, SamplingParams


@pytest.fixture
def ckpt(tmp_path, llama_dir):
    target = tmp_path / "model"
    shutil.copytree(llama_dir, target)
    return target


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def to_pickle(path):
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")


def test_pickle_refused_unless_opted_in(ckpt):
    to_pickle(ckpt)
    with pytest.raises(ModelLoadError, match=r"pytorch_model.bin.*refuses.*allow_pickle=True"):
        LLM(str(ckpt), dtype="float32")
    with LLM(str(ckpt), dtype="float32", allow_pickle=True) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0,
                                                       ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(ckpt, [5, 6, 7], 6)


def test_pickle_with_code_is_not_executed(ckpt, tmp_path):
    to_pickle(ckpt)
    marker = tmp_path / "executed"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model.embed_tokens.weight": Evil()}, ckpt / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="cannot load"):
        LLM(str(ckpt), dtype="float32", allow_pickle=True)
    assert not marker.exists()


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config.json: not found"):
        LLM(str(ckpt))


def test_unknown_architecture(ckpt):
    edit_config(ckpt, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"GPTNeoXForCausalLM.*not supported.*Llama"):
        LLM(str(ckpt))


def test_config_not_matching_weights(ckpt):
    edit_config(ckpt, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor "
                       r"'model.layers.0.mlp.down_proj.weight' has shape \(64, 128\), but "
                       r"config.json implies \(64, 96\); the config does not match"):
        LLM(str(ckpt))


def test_missing_and_unexpected_tensors(ckpt):
    state = load_file(ckpt / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"weights missing for model.layers.1.mlp.down_proj"):
        LLM(str(ckpt))
    edit_config(ckpt, num_hidden_layers=1)  # counted from the weights before the plan
    with pytest.raises(ModelLoadError, match=r"config.json: num_hidden_layers is 1; expected 2, "
                                             r"the layers its weights hold \(numbered 0 to 1\)"):
        LLM(str(ckpt))


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model: no \*.safetensors weights found"):
        LLM(str(ckpt))


def test_missing_tokenizer(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"model/tokenizer.json not found"):
        LLM(str(ckpt))


def test_missing_shard(tmp_path, ckpt):
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"lists shards that are missing: .*00001-of-00002"):
        LLM(str(ckpt))
