"""`HeadNorms`: a decoder layer that norms each query and key head (one weight [D] for
all query heads, one for all key heads) after the q/k/v projection, before the rotary
embedding, as Qwen3 and Gemma 3 do. Mixed in before the family's layer class, whose
`_qkv` it extends; `head_norm` is the family's RMSNorm."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fusegen.engine.models.decoder import empty_param
from fusegen.kernels.rms_norm import rms_norm

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig


class HeadNorms:
    head_norm = staticmethod(rms_norm)  # (x, weight, eps) -> x normed over its last dim

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.q_norm = empty_param()  # [D], shared by every query head
        self.k_norm = empty_param()  # [D], shared by every key head

    def _qkv(self, x):
        q, k, v = super()._qkv(x)  # [T, H, D], [T, K, D], [T, K, D]
        return self.head_norm(q, self.q_norm, self.eps), self.head_norm(k, self.k_norm, self.eps), v
