"""From llama.cpp's names to Hugging Face's: a GGUF file's metadata as a config.json
dict, its tensor names as the checkpoint names the architecture modules state, and the
value changes llama.cpp's converter made that transformers' GGUF loader undoes (the
reference fusegen matches token for token):
- Llama: q and k rows permuted for llama.cpp's rotary layout, un-permuted here;
- Gemma 2 / 3: every norm weight stored as 1 + w; w is restored (the decoder adds 1).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from fusegen.engine.errors import ModelLoadError

# GGUF `general.architecture` -> the Hugging Face architecture fusegen runs it as.
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                    "gemma3": "Gemma3ForCausalLM"}
_GEMMA = ("gemma2", "gemma3")
_GEMMA_LOCAL_THETA = 10_000.0  # Gemma 3's sliding layers: llama.cpp's and transformers' base
_REQUIRED = object()


def is_gguf(model) -> bool:
    """Whether a model source names a GGUF file (rather than a checkpoint directory).
    Here, apart from the reader, so that asking does not import the `gguf` package."""
    path = Path(str(model))
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def hf_config(meta: dict, tensor_names: Iterable[str], source: str) -> dict:
    """The config.json transformers' GGUF loader makes of this metadata (the keys
    fusegen reads; absent ones take the same defaults in both)."""
    arch = _architecture(meta, source)
    key = functools.partial(_key, meta, arch, source)
    num_heads = key("attention.head_count")
    config = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "vocab_size": key("vocab_size", None) or len(_tokens(meta, source)),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _one_count(key("attention.head_count_kv", num_heads),
                                          f"{arch}.attention.head_count_kv", source),
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        # llama.cpp writes the output projection only when it is not the embedding
        "tie_word_embeddings": "output.weight" not in set(tensor_names),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    head_dim = key("attention.key_length", None) or key("rope.dimension_count", None)
    if head_dim:
        config["head_dim"] = head_dim
    rope = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10_000.0),
            **_rope_scaling(key, arch, source)}
    config["rope_parameters"] = rope
    if arch in _GEMMA:
        config |= _gemma_config(key, arch, rope)
    return config


def _gemma_config(key, arch: str, rope: dict) -> dict:
    config = {"sliding_window": key("attention.sliding_window", 4096)}
    if arch == "gemma3":  # one rotary table per layer type
        config["rope_parameters"] = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA_LOCAL_THETA}}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (cap := key(name, None)) is not None:
            config[name] = cap
    return config


def _rope_scaling(key, arch: str, source: str) -> dict:
    kind = key("rope.scaling.type", "none")
    if kind == "none":
        return {}
    if kind != "linear":
        raise ModelLoadError(f"{source}: {arch}.rope.scaling.type is {kind!r}; fusegen reads "
                             "GGUF files with linear rope scaling or none")
    return {"rope_type": "linear", "factor": key("rope.scaling.factor")}


def _architecture(meta: dict, source: str) -> str:
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{source}: GGUF metadata key 'general.architecture' is missing")
    if arch not in HF_ARCHITECTURES:
        raise _unsupported(arch, source)
    return arch


def _unsupported(arch: str, source: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: GGUF architecture {arch!r} not supported; fusegen "
                          f"reads GGUF files of {', '.join(HF_ARCHITECTURES)}")


def _key(meta: dict, arch: str, source: str, name: str, default=_REQUIRED):
    full = f"{arch}.{name}"
    if full in meta:
        return meta[full]
    if default is _REQUIRED:
        raise ModelLoadError(f"{source}: GGUF metadata key {full!r} is missing; the file "
                             "was not written by a complete llama.cpp converter")
    return default


def _tokens(meta: dict, source: str) -> list[str]:
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"{source}: GGUF metadata has neither a vocab_size nor "
                             "tokenizer.ggml.tokens; fusegen cannot size the vocabulary")
    return meta["tokenizer.ggml.tokens"]


def _one_count(value, key: str, source: str) -> int:
    # Some converters write a count per layer; fusegen's decoders have one for all.
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{source}: {key} differs between layers ({value}); fusegen "
                                 "runs models with one count for every layer")
        return value[0]
    return value


def gguf_tensor_names(arch: str, hf_names: Iterable[str], num_layers: int,
                      source: str) -> dict[str, str]:
    """Hugging Face checkpoint name -> the GGUF tensor name holding it, through the
    `gguf` package's own name table for `arch` (as transformers' loader maps them)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next((a for a, name in MODEL_ARCH_NAMES.items() if name == arch), None)
    if arch not in HF_ARCHITECTURES or arch_id is None:
        raise _unsupported(arch, source)
    table = get_tensor_name_map(arch_id, num_layers)
    names = {}
    for hf_name in hf_names:
        base, dot, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(base) if suffix in ("weight", "bias") else None
        if gguf_name is None:
            raise ModelLoadError(f"{source}: fusegen has no GGUF name for {hf_name!r} of a "
                                 f"{arch} model")
        names[hf_name] = f"{gguf_name}.{suffix}"
    return names


def value_transform(arch: str, gguf_name: str, num_heads: int, num_kv_heads: int
                    ) -> Callable[[np.ndarray], np.ndarray] | None:
    """What turns the tensor's stored values into the Hugging Face ones (None: nothing)."""
    if arch == "llama" and ".attn_q." in gguf_name:
        return functools.partial(_unpermute_rotary, num_heads=num_heads)
    if arch == "llama" and ".attn_k." in gguf_name:
        return functools.partial(_unpermute_rotary, num_heads=num_kv_heads)
    if arch in _GEMMA and "norm.weight" in gguf_name:
        return _minus_one
    return None


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    # [heads * D, ...] stored per head as (D/2, 2) -> Hugging Face's (2, D/2): the
    # inverse of llama.cpp's convert_hf_to_gguf permute, as transformers undoes it.
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _minus_one(w: np.ndarray) -> np.ndarray:
    return w - np.float32(1.0)  # in float32, as transformers subtracts it
