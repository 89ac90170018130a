"""Model FLOPs and bytes: the work the model needs for a workload, whoever runs it.

FLOPs of one request with `p` prompt tokens and `n` generated tokens (n >= 1):

- The model runs T = p + n - 1 tokens through its layers: the whole prompt, then every
  generated token but the last (it is sampled and returned, never fed back).
- Linear layers: 2 FLOPs (a multiply and an add) per weight per token, over the
  matrices of a decoder layer as its architecture's tensor table lists them
  (`engine/models`: q, k, v, o, gate, up, down for Llama). The embedding lookup is a
  gather (no FLOPs); norms and biases (vectors, < 0.1%) are left out.
      2 * T * num_layers * (h*nh*d + 2*h*nkv*d + nh*d*h + 3*h*i)   (Llama)
  (a mixture of experts: the MLP's tensors hold all E experts; a token runs through the
  router and k of them: 3*h*i becomes h*E + k*3*h*i_expert.)
- Attention: the token at position t (0-based) attends to its context c = t + 1 (itself
  and everything before, causal). Per layer and head, q.K^T is c dot products of length
  d (2*c*d FLOPs) and P.V the same again: 4*c*d. Over positions t = 0..T-1 the contexts
  sum to T(T+1)/2, so
      4 * num_layers * nh * d * T(T+1)/2
  (grouped-query attention shares K/V between heads but not the dot products, so nh, not
  nkv.) Only the causal half counts: work on masked or padded positions is waste.
- LM head: 2*h*V per sampled token, n of them (logits at other prompt positions are not
  needed for generation).

This is what PaLM calls model FLOPs (2N + attention per token, forward only); dividing
it by the wall time gives the "achieved FLOP/s" of every engine on the same requests,
so engines that pad or recompute get no credit for it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

from fusegen.jobs.bench.presets import PresetModel

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A mixture of experts' MLP parameters: each holds every expert's tensors (models/moe.py).
_EXPERT_PARAMS = ("gate_up.weight", "down.weight")


@lru_cache(maxsize=64)
def _counts(shape: PresetModel) -> tuple[int, int]:
    """(every weight of the checkpoint, the weights of one layer's matrices a token
    passes through), from the architecture's tensor tables."""
    from fusegen.engine.models import get_architecture

    cfg = shape.model_config()
    arch = get_architecture(cfg.architecture)
    linear = experts = 0
    for _, dims, param in arch.layer_tensors(cfg):
        if len(dims) != 2:
            continue  # a norm or a bias: no matmul
        if cfg.num_experts and param in _EXPERT_PARAMS:
            experts += math.prod(dims)
        else:
            linear += math.prod(dims)
    linear += experts * cfg.num_experts_per_tok // max(cfg.num_experts, 1)
    total = cfg.num_layers * arch.layer_numel(cfg) + arch.fixed_numel(cfg)
    return total, linear


def layer_linear_params(shape: PresetModel) -> int:
    """Weights of one decoder layer's projections that a token passes through (no norms,
    no biases; of a mixture of experts, the router and the experts it picks)."""
    return _counts(shape)[1]


def lm_head_params(shape: PresetModel) -> int:
    return shape.hidden_size * shape.vocab_size


def num_params(shape: PresetModel) -> int:
    """Every weight of the checkpoint its architecture's tensor tables list: norms
    included, every expert; biases as `model_config` sets them (none)."""
    return _counts(shape)[0]


def request_flops(shape: PresetModel, num_prompt: int, num_output: int) -> int:
    if num_output < 1:
        return 0
    tokens = num_prompt + num_output - 1
    linear = 2 * tokens * shape.num_layers * layer_linear_params(shape)
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * tokens * (tokens + 1) // 2
    head = 2 * lm_head_params(shape) * num_output
    return linear + attention + head


def workload_flops(shape: PresetModel, counts: Iterable[tuple[int, int]]) -> int:
    """counts: (prompt tokens, generated tokens) per request."""
    return sum(request_flops(shape, p, n) for p, n in counts)


# --- bytes: the memory side of the roofline -------------------------------------------

def weight_bytes(shape: PresetModel, dtype: str) -> int:
    """Weights every step reads: all but the embedding table (a step gathers a few rows;
    of a mixture of experts, every expert: a batch's tokens pick most of them)."""
    streamed = num_params(shape) - shape.vocab_size * shape.hidden_size
    if shape.tie_word_embeddings:
        streamed += lm_head_params(shape)  # the tied table is read whole as the LM head
    return streamed * DTYPE_BYTES[dtype]


def kv_bytes_per_token(shape: PresetModel, dtype: str) -> int:
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]


def request_kv_bytes(shape: PresetModel, dtype: str, num_prompt: int, num_output: int) -> int:
    """KV bytes a request must read at least: its prompt's once (prefill), then for each
    generated token fed back (contexts p+1 .. p+n-1) its whole context."""
    fed_back = max(num_output - 1, 0)
    entries = num_prompt + fed_back * num_prompt + fed_back * (fed_back + 1) // 2
    return entries * kv_bytes_per_token(shape, dtype)


def memory_bound_seconds(shape: PresetModel, dtype: str, counts: list[tuple[int, int]],
                         num_steps: int, bandwidth: float, step_bytes: int | None = None) -> float:
    """The decode roofline: every step streams the weights once (`step_bytes`, as the
    engine holds them where it reported them: compressed weights read fewer; else the
    dense count), every token its context's KV. An engine that ran in this time would be
    limited by memory bandwidth alone."""
    kv = sum(request_kv_bytes(shape, dtype, p, n) for p, n in counts)
    weights = weight_bytes(shape, dtype) if step_bytes is None else step_bytes
    return (num_steps * weights + kv) / bandwidth
