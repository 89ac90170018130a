"""What Gemma 2 and Gemma 3 share: the decoder layer, the model around it and the
weight names (transformers' `modeling_gemma2.py`, `modeling_gemma3.py`).

Gemma differs from Llama in
- RMSNorm weights stored as w and applied as (1 + w), multiplied in fp32 before the one
  rounding to the run's dtype;
- four norms per layer: before attention, on the attention's output, before the MLP and
  on the MLP's output (each output is normed before it joins the residual stream);
- the embedding scaled by sqrt(hidden_size), the scale rounded to the run's dtype;
- GeGLU: gelu(gate, tanh approximation) * up;
- attention scaled by query_pre_attn_scalar ** -0.5, and optional soft-capping of the
  attention scores and of the final logits (c * tanh(s / c));
- sliding-window layers alternating with global ones (`layer_types`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fusegen.engine.models.architecture import Architecture
from fusegen.engine.models.config import FULL, SLIDING, check_layer_types
from fusegen.engine.models.decoder import CausalLM, DecoderLayer, empty_param, set_weights
from fusegen.engine.models.llama import _linear
from fusegen.kernels.rms_norm import rms_norm

if TYPE_CHECKING:
    from fusegen.engine.models.architecture import TensorSpec
    from fusegen.engine.models.config import ModelConfig

# The layer's norm parameters: loaded as w, kept as 1 + w in fp32.
_NORMS = frozenset({"input_norm", "post_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm",
                    "k_norm"})


def gemma_rms_norm(x, weight, eps: float, residual=None):
    """RMSNorm with `weight` = 1 + w in fp32; with a residual, h = x + residual in x's
    dtype is normed and returned too (as `rms_norm` does). In fp32 this is Llama's
    arithmetic, so the rms_norm kernels serve; other dtypes take Gemma's one rounding
    after the product here."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps, residual=residual)
    if residual is None:
        return _norm_fp32(x, weight, eps)
    h = x + residual
    return _norm_fp32(h, weight, eps), h


def _norm_fp32(x, weight, eps: float):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def gelu_tanh_and_mul(x) -> torch.Tensor:
    # x [..., 2I] = gate, up -> [..., I]
    gate, up = x.chunk(2, dim=-1)
    # gelu over a contiguous gate, as transformers' gate_proj output is: torch's vector
    # loop (32 floats a step with AVX-512) and its scalar tail differ in the last bit, and
    # on strided rows the tail would fall in each row, not where the reference's falls.
    return F.gelu(gate.contiguous(), approximate="tanh") * up


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    # transformers' order: divide, tanh, multiply
    return torch.tanh(x / cap) * cap


def softcap_flag(raw: dict, key: str, default: float | None) -> float:
    """A soft-capping value from config.json (absent: transformers' `default`); 0: off."""
    value = raw.get(key, default)
    if value is not None and float(value) <= 0:
        raise ValueError(f"{key} must be positive or null, got {value!r}")
    return float(value or 0.0)


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        # input_norm: before attention; post_norm: on the attention's output
        self.pre_mlp_norm = empty_param()  # [h]
        self.post_mlp_norm = empty_param()  # [h]

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        # Streamed layers come through here every step: the norms are small.
        set_weights(self, {name: 1.0 + t.float() if name in _NORMS else t
                           for name, t in weights.items()})

    def forward(self, positions, x, residual, rope, kv_cache, meta):
        # x [T, h] is the previous layer's output, not yet in the residual stream.
        if residual is None:
            residual, h = x, gemma_rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = gemma_rms_norm(x, self.input_norm, self.eps, residual=residual)
        h = self._attention(positions, h, rope, kv_cache, meta)
        h = gemma_rms_norm(h, self.post_norm, self.eps)
        h, residual = gemma_rms_norm(h, self.pre_mlp_norm, self.eps, residual=residual)
        return gemma_rms_norm(self._mlp(h), self.post_mlp_norm, self.eps), residual

    def _mlp(self, x):
        return self.down(gelu_tanh_and_mul(self.gate_up(x)))  # [T, 2I] -> [T, I] -> [T, h]


class GemmaCausalLM(CausalLM):
    layer_cls = GemmaDecoderLayer

    def load_fixed(self, sources, device, dtype) -> None:
        super().load_fixed(sources, device, dtype)
        self.norm.data = 1.0 + self.norm.data.float()
        # sqrt(hidden) rounded to the run's dtype once, as transformers' buffer is
        self.embed_scale = torch.tensor(self.cfg.hidden_size ** 0.5, dtype=dtype, device=device)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids) * self.embed_scale  # [T, h]

    def logits(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h, _ = gemma_rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual=residual)
        logits = self.lm_head(h)  # [N, V] in the run's dtype, capped there
        return (softcap(logits, self.cfg.final_softcap) if self.cfg.final_softcap
                else logits).float()


class GemmaFamily(Architecture):
    """Gemma 2 and 3's weight names and config keys; each states its own flags."""
    has_qk_norm = False  # Gemma 3 norms each query and key head

    def common_flags(self, raw: dict, default_pattern: int) -> dict:
        """The flags both read alike, with transformers' defaults for absent keys.
        `default_pattern`: every n-th layer is global when config.json lists no
        `layer_types`."""
        if raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is true: fusegen runs causal "
                             "decoders only")
        activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {activation!r} not supported (fusegen runs "
                             "gelu_pytorch_tanh)")
        num_layers = int(raw["num_hidden_layers"])
        layer_types = raw.get("layer_types")
        if layer_types is None:
            layer_types = [FULL if (i + 1) % default_pattern == 0 else SLIDING
                           for i in range(num_layers)]
        layer_types = check_layer_types(layer_types, num_layers)
        window = int(raw.get("sliding_window", 4096) or 0)
        if SLIDING in layer_types and not window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window "
                             "is not set")
        bias = bool(raw.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "sliding_window": window,
                "layer_types": layer_types, "head_dim": int(raw.get("head_dim") or 256),
                "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
                "attn_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5}

    def layer_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv, bias = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.qkv_bias
        head_norms = [("self_attn.q_norm.weight", (d,), "q_norm"),
                      ("self_attn.k_norm.weight", (d,), "k_norm")] if self.has_qk_norm else []
        return [
            *_linear("self_attn.q_proj", q, h, "qkv", bias),
            *_linear("self_attn.k_proj", kv, h, "qkv", bias),
            *_linear("self_attn.v_proj", kv, h, "qkv", bias),
            *_linear("self_attn.o_proj", h, q, "o", bias),
            *head_norms,
            ("mlp.gate_proj.weight", (inter, h), "gate_up.weight"),
            ("mlp.up_proj.weight", (inter, h), "gate_up.weight"),
            ("mlp.down_proj.weight", (h, inter), "down.weight"),
            ("input_layernorm.weight", (h,), "input_norm"),
            ("post_attention_layernorm.weight", (h,), "post_norm"),
            ("pre_feedforward_layernorm.weight", (h,), "pre_mlp_norm"),
            ("post_feedforward_layernorm.weight", (h,), "post_mlp_norm"),
        ]

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        return {"attention_bias": bool(attention_bias), "hidden_activation": "gelu_pytorch_tanh",
                "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)],
                "query_pre_attn_scalar": 16, "sliding_window": 8}
