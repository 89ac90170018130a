"""Rotary position embedding tables, computed as Hugging Face computes them."""
from __future__ import annotations

import math

import torch

from fusegen.engine.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """[rotary_dim // 2] float32: the model's table, or with `local` the sliding-window
    layers' own (`cfg.local_rope_theta`, Gemma 3)."""
    if local:
        return _inv_frequencies(rotary_dim(cfg), cfg.local_rope_theta, cfg.local_rope_scaling)
    return _inv_frequencies(rotary_dim(cfg), cfg.rope_theta, cfg.rope_scaling)


def rotary_dim(cfg: ModelConfig) -> int:
    """How many of each head's dims rotate (the first ones; the rest pass through)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def _inv_frequencies(dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "longrope":  # the short factors; see _longrope_table
        return _longrope(dim, theta, scaling["short_factor"])
    return _llama3(inv_freq, scaling)


def _longrope(dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    # LongRoPE (Phi-3): each frequency slowed by its own factor.
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape)


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama 3.1).
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def recompute_length(cfg: ModelConfig, max_len: int) -> int:
    """LongRoPE's switch: a request whose sequence grows past this many tokens is
    computed again with the long factors, as transformers' Phi-3 `generate` recomputes
    its cache there (models/phi3.py); 0 where no request can cross it."""
    scaling = cfg.rope_scaling
    if scaling is None or scaling["rope_type"] != "longrope":
        return 0
    original = scaling["original_max_position_embeddings"]
    return original if max_len > original else 0


def cos_sin_tables(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device
                   ) -> list[torch.Tensor]:
    """One [max_len, rotary_dim] table (cos of the half-width angles, then sin) per
    rotary base the layers use; layer i reads table `cfg.layer_rope(i)`."""
    if cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope":
        return [_longrope_table(cfg, max_len, dtype, device)]
    tables = [False] if cfg.local_rope_theta is None else [False, True]
    return [_cos_sin(inv_frequencies(cfg, local), max_len, dtype, device) for local in tables]


def _longrope_table(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """LongRoPE's one table: the short factors' rows for positions below the original
    length, then, when `max_len` passes it, the long factors' rows for every position
    (position p's at row original + p; models/phi3.py picks each token's row). cos and
    sin scaled by the attention factor before the cast, as transformers scales them."""
    scaling, dim = cfg.rope_scaling, rotary_dim(cfg)
    original, scale = scaling["original_max_position_embeddings"], scaling["attention_factor"]
    short = _cos_sin(_longrope(dim, cfg.rope_theta, scaling["short_factor"]),
                     min(max_len, original), dtype, device, scale)
    if max_len <= original:
        return short
    long = _cos_sin(_longrope(dim, cfg.rope_theta, scaling["long_factor"]), max_len, dtype,
                    device, scale)
    return torch.cat([short, long])


def _cos_sin(inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype, device,
             scale: float = 1.0) -> torch.Tensor:
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_len, rotary_dim // 2]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return (table if scale == 1.0 else table * scale).to(dtype=dtype, device=device)
