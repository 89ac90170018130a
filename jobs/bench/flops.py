"""Model FLOPs and bytes: the work the model needs for a workload, whoever runs it.

FLOPs of one request with `p` prompt tokens and `n` generated tokens (n >= 1):

- The model runs T = p + n - 1 tokens through its layers: the whole prompt, then every
  generated token but the last (it is sampled and returned, never fed back).
- Linear layers: 2 FLOPs (a multiply and an add) per weight per token, over the
  weights of the decoder layers' projections q, k, v, o, gate, up, down. The embedding
  lookup is a gather (no FLOPs); norms and biases (< 0.1%) are left out.
      2 * T * num_layers * (h*nh*d + 2*h*nkv*d + nh*d*h + 3*h*i)
  (a mixture of experts: 3*h*i becomes the router's h*E and k experts' k*3*h*i_expert.)
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

from collections.abc import Iterable

from fusegen.jobs.bench.presets import PresetModel

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _attention_params(shape: PresetModel) -> int:
    h, d = shape.hidden_size, shape.head_dim
    return h * shape.num_heads * d + 2 * h * shape.num_kv_heads * d + shape.num_heads * d * h


def _mlp_params(shape: PresetModel, num_experts: int) -> int:
    """A dense MLP's weights; of a mixture of experts, the router's and `num_experts`
    experts'."""
    h = shape.hidden_size
    if not shape.num_experts:
        return 3 * h * shape.intermediate_size
    return h * shape.num_experts + num_experts * 3 * h * shape.moe_intermediate_size


def layer_linear_params(shape: PresetModel) -> int:
    """Weights of one decoder layer's projections that a token passes through (no norms,
    no biases; of a mixture of experts, the router and the experts it picks)."""
    return _attention_params(shape) + _mlp_params(shape, shape.num_experts_per_tok)


def lm_head_params(shape: PresetModel) -> int:
    return shape.hidden_size * shape.vocab_size


def num_params(shape: PresetModel) -> int:
    """Every weight of the checkpoint, norms included (biases: Llama presets have none;
    a real model's biases and extra norms, < 0.1%, are left out)."""
    h = shape.hidden_size
    # every expert, + input and post-attention RMSNorm
    per_layer = _attention_params(shape) + _mlp_params(shape, shape.num_experts) + 2 * h
    embed = shape.vocab_size * h
    head = 0 if shape.tie_word_embeddings else lm_head_params(shape)
    return shape.num_layers * per_layer + embed + head + h  # + final norm


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
