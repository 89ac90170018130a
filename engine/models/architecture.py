"""What fusegen knows about one architecture family, in one object.

An architecture module (`llama.py`, ...) subclasses `Architecture`, states its
config.json flags, its checkpoint tensors and the decoder parameter each one goes
into, its decoder, and the config.json keys a synthetic checkpoint of it carries; it
registers itself (`fusegen.engine.models.register`). Everything else — the loader's
expected shapes, the per-layer weight sources, a layer's size for the placement
plan, the synthetic checkpoint's tensors — is derived here from those tables, so
that the names and shapes are written once.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from fusegen.engine.models.config import ModelConfig

# One checkpoint tensor: (its name, its shape, the decoder parameter it goes into).
# Several tensors naming one parameter are stacked along dim 0 in the order listed
# (q, k, v into "qkv.weight").
TensorSpec = tuple[str, tuple[int, ...], str]


class Architecture:
    hf_names: tuple[str, ...] = ()  # config.json `architectures` entries it serves
    model_type: str = ""  # config.json `model_type`; the synthetic builder's name for it
    layer_prefix = "model.layers.{}."  # layer i's checkpoint names start with this

    # -- what each architecture states ---------------------------------------------

    def config_flags(self, raw: dict) -> dict:
        """The `ModelConfig` fields config.json sets differently per architecture:
        qkv_bias, o_bias, mlp_bias, sliding_window."""
        raise NotImplementedError

    def fixed_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        """The tensors outside the layers, the embedding first, then those after the
        layers: Hugging Face's names for the final norm and the LM head (unless tied: the
        embedding serves as the head). An architecture that names them otherwise
        overrides this."""
        vocab, h = cfg.vocab_size, cfg.hidden_size
        tensors = [("model.embed_tokens.weight", (vocab, h), "embed"),
                   ("model.norm.weight", (h,), "norm")]
        if not cfg.tie_word_embeddings:
            tensors.append(("lm_head.weight", (vocab, h), "lm_head.weight"))
        return tensors

    def layer_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        """One layer's tensors (names after `layer_prefix`) in the order transformers
        writes them."""
        raise NotImplementedError

    def build_model(self, cfg: ModelConfig) -> nn.Module:
        """The decoder with empty parameters: `forward`, `logits`, `load_fixed`,
        `fixed_nbytes`, `layers` (each with `set_weights`) and `streamer`, as
        `decoder.CausalLM` has them."""
        raise NotImplementedError

    def uses_request_lengths(self, cfg: ModelConfig) -> bool:
        """Whether the decoder reads each request's whole length in a step
        (`AttentionMetadata.num_tokens`): a model whose rotation depends on it (LongRoPE)
        overrides this; the runners fill the lengths only then."""
        return False

    def synthetic_config(self, num_layers: int, attention_bias: bool | None) -> dict:
        """config.json keys transformers writes for this class beyond the common ones
        (`attention_bias` None: the class's default). ValueError for what the class
        cannot express."""
        raise NotImplementedError

    # -- derived -------------------------------------------------------------------

    def checkpoint_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its shape: the fixed ones, then
        layer by layer."""
        shapes = {name: shape for name, shape, _ in self.fixed_tensors(cfg)}
        for i in range(cfg.num_layers):
            prefix = self.layer_prefix.format(i)
            shapes |= {prefix + name: shape for name, shape, _ in self.layer_tensors(cfg)}
        return shapes

    def fixed_sources(self, state: dict[str, torch.Tensor], cfg: ModelConfig
                      ) -> dict[str, list[torch.Tensor]]:
        return _sources(state, "", self.fixed_tensors(cfg))

    def layer_sources(self, state: dict[str, torch.Tensor], index: int, cfg: ModelConfig
                      ) -> dict[str, list[torch.Tensor]]:
        """Layer `index`'s parameters as lists of checkpoint tensors that, stacked along
        dim 0, give the fused parameter (q/k/v into qkv, gate/up into gate_up)."""
        return _sources(state, self.layer_prefix.format(index), self.layer_tensors(cfg))

    def layer_numel(self, cfg: ModelConfig) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.layer_tensors(cfg))

    def fixed_numel(self, cfg: ModelConfig) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.fixed_tensors(cfg))


def _sources(state, prefix: str, specs: list[TensorSpec]) -> dict[str, list[torch.Tensor]]:
    sources: dict[str, list[torch.Tensor]] = {}
    for name, _, param in specs:
        sources.setdefault(param, []).append(state[prefix + name])
    return sources
