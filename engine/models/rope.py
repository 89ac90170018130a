"""Rotary position embedding tables, computed as Hugging Face computes them."""
from __future__ import annotations

import math

import torch

from fusegen.engine.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    # [head_dim // 2] float32
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3(inv_freq, scaling)


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


def cos_sin_table(cfg: ModelConfig, max_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[max_len, head_dim] = cos of the half-width angles, then sin."""
    positions = torch.arange(max_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_frequencies(cfg)[None, :]  # [max_len, head_dim // 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)
