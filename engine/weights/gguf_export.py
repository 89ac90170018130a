"""A GGUF file written out as a Hugging Face checkpoint directory, for the tools that
read only those (vLLM; transformers without `gguf_file=`): `fusegen bench` runs its
baselines on the export while fusegen runs the file itself.

Everything comes from fusegen's own reader, so the directory holds what fusegen runs:
- config.json: the metadata as `hf_config` reads it (as transformers' GGUF loader does),
  with `model_type` and the stored dtype;
- the weights under Hugging Face names (`load_gguf_state_dict`: Llama's q/k rows
  un-permuted, Gemma's norms restored), dequantized into one dtype, as safetensors;
  shards of at most `max_shard_bytes`, each read from the file only while it is written,
  so the export never holds more than one shard in memory;
- tokenizer.json and tokenizer_config.json: the embedded vocabulary as
  `gguf_tokenizer` builds it, its special tokens and chat template;
- generation_config.json: the special token ids.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from fusegen.engine.models import get_architecture
from fusegen.engine.weights.gguf import GGUFFile, gguf_model_config, load_gguf_state_dict
from fusegen.engine.weights.gguf_names import hf_config
from fusegen.engine.weights.gguf_tokenizer import gguf_tokenizer

_GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_MAX_SHARD_BYTES = 2 << 30


def export_gguf(path, out_dir, dtype: torch.dtype = torch.float32,
                max_shard_bytes: int = _MAX_SHARD_BYTES) -> Path:
    """Write `path` (a .gguf file, or the first file of a split set) into `out_dir` as a
    Hugging Face checkpoint with its weights in `dtype`; returns `out_dir`."""
    reader = GGUFFile.open(path)
    cfg = gguf_model_config(path)
    raw = hf_config(reader.metadata, reader.tensors, str(path))
    name = str(dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", {
        **raw, "model_type": get_architecture(cfg.architecture).model_type,
        "dtype": name, "torch_dtype": name})  # both: transformers 5 and older readers
    _write_json(out / "generation_config.json",
                {k: raw[k] for k in _GENERATION_KEYS if raw.get(k) is not None})
    write_tokenizer(reader.metadata, str(path), out, cfg.max_position_embeddings)
    _write_weights(load_gguf_state_dict(path, cfg, dtype), out, max_shard_bytes)
    return out


def write_tokenizer(meta: dict, source: str, out: Path, max_len: int) -> None:
    backend, special_tokens, template = gguf_tokenizer(meta, source)
    backend.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special_tokens,
              "model_max_length": max_len, "clean_up_tokenization_spaces": False}
    if template is not None:
        config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", config)


def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into runs of at most max_shard_bytes (a larger tensor
    alone in its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _write_weights(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    # LazyTensors: sized without reading; each shard is read only to be written.
    sizes = {n: math.prod(t.shape) * t.dtype.itemsize for n, t in state.items()}
    shards = shard_plan(sizes, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)])
    for names, file in zip(shards, files):
        tensors = {n: state[n].load().contiguous() for n in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        weight_map = {n: file for names, file in zip(shards, files) for n in names}
        _write_json(out / "model.safetensors.index.json",
                    {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})


def _write_json(file: Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
