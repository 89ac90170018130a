"""The model's shape, parsed from a Hugging Face config.json."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models import SUPPORTED_ARCHITECTURES, get_architecture


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
    rope_scaling: dict | None  # {"rope_type": "llama3" | "linear", ...} or None
    tie_word_embeddings: bool
    # Set per architecture (its module's `config_flags`):
    qkv_bias: bool  # biases on q/k/v projections (Qwen2; Llama with attention_bias)
    o_bias: bool  # bias on the output projection (Llama with attention_bias)
    mlp_bias: bool
    sliding_window: int  # 0: full attention
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None  # the checkpoint's own dtype, when the config says

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
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: architectures {archs} not supported; fusegen runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_param(raw, "rope_theta", 10000.0)),
                rope_scaling=_rope_scaling(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                **get_architecture(arch).config_flags(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_list(raw.get("eos_token_id")),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing required key {exc.args[0]!r}") from None
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads ({cfg.num_heads}) is not a "
                                 f"multiple of num_key_value_heads ({cfg.num_kv_heads})")
        return cfg


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _rope_param(raw: dict, key: str, default):
    # transformers 5 moved rope settings into `rope_parameters`.
    params = raw.get("rope_parameters") or {}
    return raw.get(key, params.get(key, default))


def _rope_scaling(raw: dict) -> dict | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"config.json: rope_scaling type {kind!r} not supported "
                             "(fusegen supports llama3 and linear)")
    return {**scaling, "rope_type": kind}
