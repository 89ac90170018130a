"""The Llama-style decoder (Llama, Mistral, Qwen2) over one ragged token stream; the
other families (Qwen3, Gemma, Phi-3, the MoE ones) subclass its layer and model.

A step's tokens from all requests are packed into one sequence of T tokens with no
padding (ByteTransformer's idea); the attention metadata says where each request's
tokens start and where its keys and values live in the paged cache.
Shapes: T tokens, B requests, H query heads, K kv heads, D head_dim, h hidden size,
I intermediate size, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fusegen.engine.weights.linear import Linear
from fusegen.kernels.paged_attention import paged_attention
from fusegen.kernels.rms_norm import rms_norm
from fusegen.kernels.rotary import rotary_and_cache
from fusegen.kernels.silu_mul import silu_and_mul

if TYPE_CHECKING:
    from fusegen.engine.models.config import ModelConfig


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    query_start_loc: torch.Tensor  # [B+1] int32
    max_query_len: int
    max_seq_len: int
    # [B] int32, each request's whole length (prompt and generated tokens, computed or
    # not); filled only where `Architecture.uses_request_lengths` (LongRoPE picks
    # its factors by it, models/phi3.py)
    num_tokens: torch.Tensor | None = None
    # a step whose KV lies partly in the host pool (engine/cooperative.py): it caches and
    # attends in each layer's place
    cooperative: object | None = None


def empty_param() -> nn.Parameter:
    # Empty until loading points it at the real tensor (`.data =`).
    return nn.Parameter(torch.empty(0), requires_grad=False)


def set_weights(module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Point `module`'s tensors at `weights`, no copy. Names as in the weight-name
    maps: "input_norm" is the module's own parameter, "qkv.weight" a Linear's."""
    for name, tensor in weights.items():
        owner, _, attr = name.rpartition(".")
        if owner:
            getattr(module, owner).set_weight(attr, tensor)
        else:
            getattr(module, attr).data = tensor


class DecoderLayer(nn.Module):
    """Llama's layer. Architectures that differ subclass it and override `_qkv` (q/k
    norms), `_mlp` (another activation, experts) or `forward` (other norms)."""
    # No host sync in forward, so a decode step can be recorded as a CUDA graph
    # (engine/graphs.py); a layer that reads device values on the host sets False.
    graphable = True

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.head_counts = [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads]  # q, k, v
        self.eps = cfg.rms_norm_eps
        self.sliding_window = cfg.layer_window(index)
        self.rope_index = cfg.layer_rope(index)  # which of the model's rotary tables
        self.scale = cfg.attn_scale or d ** -0.5
        self.softcap = cfg.attn_softcap
        self.deterministic = False  # batch-invariant attention (CausalLM.make_deterministic)
        self.input_norm = empty_param()  # [h]
        self.qkv = Linear(bias=cfg.qkv_bias)  # [(H + 2K) * D, h]: q, k, v stacked
        self.o = Linear(bias=cfg.o_bias)  # [h, H * D]
        self.post_norm = empty_param()  # [h]
        self.gate_up = Linear(bias=cfg.mlp_bias)  # [2I, h]: gate, up stacked
        self.down = Linear(bias=cfg.mlp_bias)  # [h, I]

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        set_weights(self, weights)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward  # each architecture's own forward (see `__call__`)

    def forward(self, positions, x, residual, rope, kv_cache, meta: AttentionMetadata):
        # x [T, h] is the previous layer's output, not yet added to the residual
        # stream (the add is fused into the norm); residual is None at the first layer.
        if residual is None:
            residual, h = x, rms_norm(x, self.input_norm, self.eps)
        else:
            h, residual = rms_norm(x, self.input_norm, self.eps, residual=residual)
        h = self._attention(positions, h, rope, kv_cache, meta)
        h, residual = rms_norm(h, self.post_norm, self.eps, residual=residual)
        return self._mlp(h), residual

    # `layer(...)` is `forward` itself: nn.Module's hook dispatch skipped, as Linear does
    # (a decode step on a CPU is short enough for it to count); no hooks on layers
    __call__ = forward

    def _qkv(self, x):
        qkv = self.qkv(x).view(x.shape[0], -1, self.head_dim)  # [T, H + 2K, D]
        return qkv.split_with_sizes(self.head_counts, dim=1)  # [T, H, D], [T, K, D] x2

    def _attention(self, positions, x, rope, kv_cache, meta):
        num_tokens = x.shape[0]
        q, k, v = self._qkv(x)
        k_cache, v_cache = kv_cache  # [num_blocks, block_size, K, D] each
        if meta.cooperative is not None:
            out = meta.cooperative.attention(self, positions, q, k, v, rope, kv_cache)
            return self.o(out.reshape(num_tokens, self.q_size))
        # q, k rotated in place; k, v stored in their slots
        rotary_and_cache(positions, q, k, v, *rope, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                              meta.query_start_loc, max_query_len=meta.max_query_len,
                              max_seq_len=meta.max_seq_len, scale=self.scale,
                              sliding_window=self.sliding_window, softcap=self.softcap,
                              deterministic=self.deterministic)  # [T, H, D]
        return self.o(out.reshape(num_tokens, self.q_size))  # [T, h]

    def _mlp(self, x):
        gate_up = self.gate_up(x)  # [T, 2I]
        return self.down(silu_and_mul(gate_up))  # [T, I] -> [T, h]


class CausalLM(nn.Module):
    layer_cls = DecoderLayer  # an architecture's own layer: a subclass sets it

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = empty_param()  # [V, h]; empty where the table stays as its blocks
        # weights.quantized_fixed.GGUFEmbedding where it does (quantization="gguf")
        self.embed_blocks = None
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = empty_param()  # [h]
        self.lm_head = Linear()  # [V, h]; the embedding itself when tied
        self.streamer = None  # engine.memory.offload.WeightStreamer when some layers stream

    @property
    def graphable(self) -> bool:
        return all(layer.graphable for layer in self.layers)

    def make_deterministic(self, row_tile: int) -> None:
        """Batch-invariant from now on: every matmul in fixed row tiles, every query row's
        attention reduced in one order. Norms, rotary and SiLU already work row by row."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.row_tile = row_tile
            elif isinstance(module, DecoderLayer):
                module.deterministic = True

    def forward(self, input_ids, positions, cos_sin, kv_caches, meta: AttentionMetadata, *,
                layers: range | None = None, hidden=None):
        # input_ids, positions [T]; cos_sin: per rotary table [max_len, D] (cos halves,
        # sin halves), layer i reads table layers[i].rope_index. A pipeline stage runs
        # only its `layers` (kv_caches[i] is layer i's; the others may be None) and,
        # unless it starts the model, takes the previous stage's (x, residual) as
        # `hidden` in place of the embedding.
        ropes = [table.chunk(2, dim=-1) for table in cos_sin]
        x, residual = (self.embed_tokens(input_ids), None) if hidden is None else hidden
        all_layers = list(self.layers)  # a list indexes faster than the ModuleList
        for i in range(len(all_layers)) if layers is None else layers:
            layer = all_layers[i]
            if self.streamer is not None:
                self.streamer.acquire(i)
            x, residual = layer(positions, x, residual, ropes[layer.rope_index], kv_caches[i],
                                meta)
            if self.streamer is not None:
                self.streamer.release(i)
        return x, residual  # [T, h] each: the stream is x + residual

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids)  # [T] -> [T, h]

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding's rows [T, h]; a tensor-parallel rank, holding a slice of the
        vocabulary, replaces it with a lookup that sums the ranks' rows
        (engine/parallel)."""
        if self.embed_blocks is not None:
            return self.embed_blocks(input_ids)
        return F.embedding(input_ids, self.embed)

    def logits(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # rows [N, h] of the tokens that sample -> [N, V] fp32
        h, _ = rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual=residual)
        return self.lm_head(h).float()

    def greedy_tokens(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """rows [N, h] -> [N] int64, argmax(self.logits(x, residual)) to the bit, without
        the [N, V] logits, where the head computes its own argmax (fusegen's CPU GEMM) and
        the logits are the head's product itself; else None. A model whose `logits` does
        more (soft-capping) keeps the logits."""
        argmax = getattr(self.lm_head, "argmax", None)
        if argmax is None or type(self).logits is not CausalLM.logits:
            return None
        h, _ = rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual=residual)
        return argmax(h)

    def load_fixed(self, sources: dict[str, list[torch.Tensor]], device, dtype) -> None:
        """The tensors every step needs: embedding, final norm, LM head. A checkpoint
        tensor already on `device` in `dtype` is used as it is (memory-mapped). The
        embedding and an untied head that a GGUF file stores as blocks the CPU kernel
        takes stay as those blocks (`_keep_fixed_blocks`)."""
        kept = self._keep_fixed_blocks(sources, device, dtype)
        set_weights(self, {name: parts[0].to(device, dtype) for name, parts in sources.items()
                           if name not in kept})
        if self.cfg.tie_word_embeddings and self.embed_blocks is None:
            self.lm_head.set_weight("weight", self.embed.data)

    def _keep_fixed_blocks(self, sources, device, dtype) -> set[str]:
        """Keep "embed" (and the head tied to it) and an untied "lm_head.weight" as their
        blocks where the sources carry them (quantization="gguf") and the kernel serves
        the run (weights/quantized_fixed.py); the names kept. A tensor-parallel rank's
        lookup and head (vocabulary slices, engine/parallel) stay dense."""
        from fusegen.engine.weights import quantized_fixed as qf
        from fusegen.engine.weights.quantized import fuse_blocks

        if type(self.lm_head) is not Linear or "lookup" in vars(self):
            return set()
        kept = set()
        h = self.cfg.hidden_size
        embed = qf.fixed_blocks(sources["embed"][0], device, dtype)
        if embed is not None:
            blocks = fuse_blocks([embed], device)  # a copy, never a view of the map
            self.embed_blocks = qf.GGUFEmbedding(blocks, embed.params[0], h, dtype)
            kept.add("embed")
            if self.cfg.tie_word_embeddings:
                self.lm_head = self.embed_blocks.tied_head(self.lm_head)
        head = sources.get("lm_head.weight")
        head = None if head is None else qf.fixed_blocks(head[0], device, dtype)
        if head is not None and not self.cfg.tie_word_embeddings:
            self.lm_head = qf.GGUFHead.from_blocks(self.lm_head, fuse_blocks([head], device),
                                                   head.params[0], h)
            self.lm_head.may_repack = True  # resident, its own blocks (GGUFLinear)
            kept.add("lm_head.weight")
        return kept

    @property
    def fixed_nbytes(self) -> int:
        # A tied head is the embedding: counted once.
        embed = self.embed_blocks.nbytes if self.embed_blocks is not None else \
            self.embed.numel() * self.embed.element_size()
        head = 0 if self.cfg.tie_word_embeddings else self.lm_head.nbytes
        return embed + self.norm.numel() * self.norm.element_size() + head
