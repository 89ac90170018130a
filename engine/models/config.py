"""The model's shape, parsed from a Hugging Face config.json."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fusegen.engine.errors import ModelLoadError

# config.json architecture name -> its family's `config_flags(raw)`, in registration order:
# engine/models/registry.py fills it as each family module registers, so parsing a config
# needs no import of the registry (whose architectures take a ModelConfig).
ARCHITECTURE_FLAGS: dict[str, Callable[[dict], dict]] = {}

# Bounds on what a config may claim before anything is sized from it (per-layer lists,
# rotary tables, the memory plan). The longest context in circulation (Llama 4 Scout's
# 10M tokens) and the deepest open models (Llama 3.1 405B: 126 layers) sit well inside.
MAX_CONTEXT = 2**24
MAX_LAYERS = 10_000
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "max_position_embeddings")
# ModelConfig's field -> the config.json key it comes from, for the errors
_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
         "num_kv_heads": "num_key_value_heads"}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3" | "linear" | "longrope", ...} or None
    tie_word_embeddings: bool
    # Set per architecture (its module's `config_flags`):
    qkv_bias: bool  # biases on q/k/v projections (Qwen2; Llama with attention_bias)
    o_bias: bool  # bias on the output projection (Llama with attention_bias)
    mlp_bias: bool
    sliding_window: int  # 0: full attention; with `layer_types`, the sliding layers' window
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None  # the checkpoint's own dtype, when the config says
    # Set by the architectures that differ from Llama here (defaults: Llama's):
    # each layer's "sliding_attention" or "full_attention"; None: every layer attends
    # through `sliding_window` (0: fully).
    layer_types: list[str] | None = None
    # The rotary table of the sliding-window layers when it differs from the others'
    # (Gemma 3's local base); None: one table for every layer.
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    attn_scale: float | None = None  # attention logit scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores become c * tanh(s / c) before the mask; 0: off
    final_softcap: float = 0.0  # the same on the LM head's logits; 0: off
    # Rotary over the first int(head_dim * factor) of each head's dims (Phi-3 may set it).
    partial_rotary_factor: float = 1.0
    # Mixture-of-experts MLP (Mixtral, Qwen3-MoE; models/moe.py); 0 experts: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k: the experts each token runs through
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False  # the k routing weights renormalised to sum to 1

    def layer_window(self, index: int) -> int:
        """Layer `index`'s sliding window (0: it attends to every earlier position)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[index] == SLIDING else 0

    def layer_rope(self, index: int) -> int:
        """Which rotary table layer `index` uses: 0 the model's, 1 the local one."""
        local = self.local_rope_theta is not None and self.layer_types is not None
        return int(local and self.layer_types[index] == SLIDING)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found; a model directory needs a Hugging Face "
                                 "config.json beside its *.safetensors")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: a JSON {type(raw).__name__}, not an object of "
                                 "the model's settings")
        cfg = cls.from_dict(raw, source=str(path))
        from fusegen.engine.weights.loader import check_num_layers  # it imports this module

        check_num_layers(cfg, Path(model_dir), str(path))
        return cfg

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURE_FLAGS), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: architectures {archs} not supported; fusegen runs "
                f"{', '.join(ARCHITECTURE_FLAGS)}")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            fields = dict(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // max(num_heads, 1)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_param(raw, "rope_theta", 10000.0)),
                rope_scaling=None,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_list(raw.get("eos_token_id")),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
            _check_sizes(fields)  # before the flags build anything per layer
            # The architecture's flags may restate common fields (Gemma 3's rotary tables).
            flags = ARCHITECTURE_FLAGS[arch](raw)
            if "rope_scaling" not in flags:
                fields["rope_scaling"] = _rope_scaling(raw)
            cfg = cls(**(fields | flags))
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required key {exc.args[0]!r}") from None
        except ValueError as exc:  # a value fusegen cannot run, named by its key
            raise ModelLoadError(f"{source}: {exc}") from None
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads ({cfg.num_heads}) is not a "
                                 f"multiple of num_key_value_heads ({cfg.num_kv_heads})")
        return cfg


def _check_sizes(fields: dict) -> None:
    """ValueError naming the config.json key of a size that is not positive or past
    the bounds, or a rotary base or norm epsilon that is not a finite number."""
    for name in _SIZES:
        if fields[name] <= 0:
            raise ValueError(f"{_KEYS.get(name, name)} is {fields[name]}; expected a "
                             "positive integer")
    for name, bound in (("num_layers", MAX_LAYERS), ("max_position_embeddings", MAX_CONTEXT)):
        if fields[name] > bound:
            raise ValueError(f"{_KEYS.get(name, name)} is {fields[name]}; expected at most "
                             f"{bound}; no model in circulation comes near it")
    for name, positive in (("rope_theta", True), ("rms_norm_eps", False)):
        value = fields[name]
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ValueError(f"{name} is {value}; expected a finite number "
                             f"{'above' if positive else 'at least'} 0")


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _rope_param(raw: dict, key: str, default):
    # transformers 5 moved rope settings into `rope_parameters`.
    params = raw.get("rope_parameters") or {}
    return raw.get(key, params.get(key, default))


def _rope_scaling(raw: dict) -> dict | None:
    return rope_scaling_of(raw.get("rope_scaling") or raw.get("rope_parameters"), "rope_scaling")


def rope_scaling_of(scaling: dict | None, key: str) -> dict | None:
    """The scaling one rotary table uses: None for plain rotary, else a dict with its
    `rope_type`. `key` names where config.json holds it, for the error."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ValueError(f"{key} type {kind!r} not supported (fusegen supports llama3 "
                         "and linear)")
    return {**scaling, "rope_type": kind}


SLIDING, FULL = "sliding_attention", "full_attention"  # config.json `layer_types` entries


def check_layer_types(layer_types, num_layers: int) -> list[str]:
    """config.json's `layer_types`, checked: one known entry per layer."""
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must list one entry per layer ({num_layers}), "
                         f"got {layer_types!r}")
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"layer_types entry {unknown[0]!r} not supported (fusegen runs "
                         f"{SLIDING!r} and {FULL!r} layers)")
    return list(layer_types)
