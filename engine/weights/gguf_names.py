"""From llama.cpp's names to Hugging Face's: a GGUF file's metadata as a config.json
dict, its tensor names as the checkpoint names the architecture modules state, and the
value changes llama.cpp's converter made that transformers' GGUF loader undoes (the
reference fusegen matches token for token):
- Llama: q and k rows permuted for llama.cpp's rotary layout, un-permuted here;
- Gemma 2 / 3: every norm weight stored as 1 + w; w is restored (the decoder adds 1).
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
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


def hf_config(meta: dict, tensors: Mapping[str, object], source: str) -> dict:
    """The config.json transformers' GGUF loader makes of this metadata (the keys
    fusegen reads; absent ones take the same defaults in both), once `check_metadata`
    has found it consistent with the tensor table (name -> an object with a `shape`)."""
    check_metadata(meta, {name: tuple(t.shape) for name, t in tensors.items()}, source)
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
        "tie_word_embeddings": "output.weight" not in tensors,
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


_LAYER = re.compile(r"blk\.(\d+)\.")  # a layer's tensors: blk.N.attn_q.weight, ...


def check_metadata(meta: dict, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Every size the engine builds from, checked against the tensor table and sane
    bounds before anything is made of it: a small file that claims ten million layers,
    a huge context or a NaN rotary base is a ModelLoadError naming the key, its value
    and what was expected, not per-layer structures sized from the claim."""
    from fusegen.engine.models.config import MAX_CONTEXT

    arch = _architecture(meta, source)
    check = _Checker(meta, arch, source)
    embedding = shapes.get("token_embd.weight")
    if embedding is None or len(embedding) != 2:
        raise ModelLoadError(f"{source}: the tensor table has no 2-D 'token_embd.weight' "
                             f"(found {embedding}); the file is damaged")
    vocab, hidden = embedding
    num_layers = _check_layers(check, shapes)
    check.equal("embedding_length", check.count("embedding_length"), hidden,
                "the width of tensor 'token_embd.weight'")
    if f"{arch}.vocab_size" in meta:
        check.equal("vocab_size", check.count("vocab_size"), vocab,
                    "the rows of tensor 'token_embd.weight'")
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and len(tokens) != vocab:  # llama.cpp requires them equal
        raise ModelLoadError(f"{source}: GGUF metadata 'tokenizer.ggml.tokens' lists "
                             f"{len(tokens)} tokens; expected {vocab}, the rows of tensor "
                             "'token_embd.weight'")
    _check_heads(check, shapes, hidden, num_layers)
    if "blk.0.ffn_up.weight" in shapes:
        check.equal("feed_forward_length", check.count("feed_forward_length"),
                    shapes["blk.0.ffn_up.weight"][0], "the rows of tensor 'blk.0.ffn_up.weight'")
    if check.count("context_length", 2048) > MAX_CONTEXT:
        raise check.bad("context_length", f"at most {MAX_CONTEXT} (2^24) positions; no "
                        "model in circulation is trained on more")
    check.count("attention.sliding_window", None)
    check.real("rope.freq_base", positive=True)
    check.real("rope.scaling.factor", positive=True)
    check.real("attention.layer_norm_rms_epsilon", positive=False)
    check.real("attn_logit_softcapping", positive=False)
    check.real("final_logit_softcapping", positive=False)


def _check_heads(check: "_Checker", shapes: dict, hidden: int, num_layers: int) -> None:
    """Head counts and size against layer 0's query and key projections."""
    heads = check.count("attention.head_count")
    kv_heads = check.count("attention.head_count_kv", heads, per_layer=num_layers)
    if heads % kv_heads:
        raise check.bad("attention.head_count_kv", f"a divisor of the head count, {heads}")
    # as hf_config and ModelConfig size a head
    head_dim, head_key = next(((value, f"{check.arch}.{name}") for name in
                               ("attention.key_length", "rope.dimension_count")
                               if (value := check.count(name, None))),
                              (hidden // heads, "embedding_length / head_count"))
    if head_dim == 0:
        raise check.bad("attention.head_count", f"at most {hidden}, the embedding width")
    for name, count, what in (("head_count", heads, "attn_q"),
                              ("head_count_kv", kv_heads, "attn_k")):
        rows = shapes.get(f"blk.0.{what}.weight", (count * head_dim,))[0]
        if count * head_dim != rows:  # which of the two is wrong the file cannot say
            raise ModelLoadError(
                f"{check.source}: GGUF metadata '{check.arch}.attention.{name}' is {count}, "
                f"heads of {head_dim} ({head_key}): {count * head_dim} rows; expected "
                f"{rows}, the rows of tensor 'blk.0.{what}.weight'")


def _check_layers(check: "_Checker", shapes: dict) -> int:
    """`block_count`, equal to the layers the tensor table holds (blk.0 .. blk.N-1)."""
    layers = {int(m[1]) for name in shapes if (m := _LAYER.match(name))}
    claimed = check.count("block_count")
    if claimed != len(layers):
        held = f"blk.0 to blk.{max(layers)}" if layers else "none"
        raise check.bad("block_count", f"{len(layers)}, the layers its tensor table holds "
                                       f"({held})")
    if layers and max(layers) != claimed - 1:
        gap = min(set(range(claimed)) - layers)
        raise check.bad("block_count", f"layers blk.0 to blk.{claimed - 1}, but the tensor "
                                       f"table has none of blk.{gap} (and has blk.{max(layers)})")
    return claimed


class _Checker:
    """Reads `{arch}.{name}` keys that must hold a positive integer or a finite number."""

    def __init__(self, meta: dict, arch: str, source: str):
        self.meta, self.arch, self.source = meta, arch, source

    def bad(self, name: str, expected: str) -> ModelLoadError:
        full = f"{self.arch}.{name}"
        return ModelLoadError(f"{self.source}: GGUF metadata {full!r} is "
                              f"{_shown(self.meta[full])}; expected {expected}")

    def equal(self, name: str, value, want: int, what: str) -> None:
        if value != want:
            raise self.bad(name, f"{want}, {what}")

    def count(self, name: str, default=_REQUIRED, per_layer: int | None = None):
        """A positive integer; with `per_layer`, also a list of one per layer (as some
        converters write head counts), all equal."""
        full = f"{self.arch}.{name}"
        if full not in self.meta:
            return _key(self.meta, self.arch, self.source, name, default)  # raises if required
        value = self.meta[full]
        if per_layer is not None and isinstance(value, list):
            if len(value) != per_layer:
                raise self.bad(name, f"one count per layer, {per_layer} of them")
            for item in value:
                if not _is_int(item) or item <= 0:
                    raise self.bad(name, "positive integers")
            return _one_count(value, f"{self.arch}.{name}", self.source)
        if not _is_int(value) or value <= 0:
            raise self.bad(name, "a positive integer")
        return value

    def real(self, name: str, positive: bool) -> None:
        """A finite number, above 0 or at least 0, where the file has the key."""
        value = self.meta.get(f"{self.arch}.{name}")
        if value is None:
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise self.bad(name, f"a finite number {'above' if positive else 'at least'} 0")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(value)} entries)"


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
