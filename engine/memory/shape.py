"""The model's sizes the plan works over (`ModelShape`, engine/memory/plan.py), from
config.json and the architecture's tensor tables; nothing is read but the headers of a
checkpoint whose linears stay compressed (their components' bytes). A device group's
ranks each get their slice of the layers and the stages' split."""
from __future__ import annotations

import dataclasses

import torch

from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.plan import ModelShape
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights.packed import can_pack
from fusegen.engine.weights.quantized import gguf_kernel_types

# The resolved forms whose decoder linears stay compressed (weights/quantized.py).
COMPRESSED = ("gguf", "int8", "int4", "fp8", "sparse")


def plan_shape(model, cfg: ModelConfig, dtype: torch.dtype, quantization: str,
               options: EngineOptions, device: str) -> tuple[ModelShape, tuple[range, ...]]:
    """The sizes one rank plans with, and a device group's pipeline stages (() alone).
    `quantization`: the resolved form (`resolve_quantization`)."""
    # A head tied to the embedding is packed as a copy on CPUs (weights/packed.py).
    packed_head = device == "cpu" and cfg.tie_word_embeddings and can_pack(dtype)
    tp, pp = options.tensor_parallel_size, options.pipeline_parallel_size
    if tp * pp > 1:  # the plan is one rank's: every rank gets the same KV blocks
        from fusegen.engine.parallel.plan import check_grid, check_parallel

        tp = check_grid(cfg, options, quantization)  # a Tesseract grid: its q
        check_parallel(cfg, tp, pp)
        if options.tensor_parallel_mode != "1d":  # dense weights, one stage (check_grid)
            return (grid_rank_shape(model, cfg, dtype, tp, packed_head, options),
                    (range(cfg.num_layers),))
        layer_bytes = None
        if quantization in COMPRESSED:  # a rank's slice of each layer, compressed
            layer_bytes = compressed_layer_bytes(model, cfg, dtype, quantization, options,
                                                 device, tp)
        stages = group_stages(cfg, dtype, tp, pp, layer_bytes)
        shape = rank_shape(cfg, dtype, tp, pp, packed_head, stages)
        if layer_bytes is not None:
            shape = dataclasses.replace(shape, layer_bytes=max(layer_bytes))
        return shape, tuple(stages)
    fixed_bytes = (compressed_fixed_bytes(model, cfg, dtype, options, device)
                   if quantization == "gguf" else None)
    # A tied head kept as the embedding's blocks is no packed copy (quantized_fixed.py).
    shape = model_shape(cfg, dtype, packed_head=packed_head and fixed_bytes is None)
    if quantization in COMPRESSED:
        shape = dataclasses.replace(shape, layer_bytes=max(compressed_layer_bytes(
            model, cfg, dtype, quantization, options, device)), fixed_bytes=fixed_bytes)
    return shape, ()


def model_shape(cfg: ModelConfig, dtype: torch.dtype, packed_head: bool = False) -> ModelShape:
    """The sizes the plan works over, from config.json alone (no weights are read).
    `packed_head`: a tied head also kept as a packed copy."""
    arch = get_architecture(cfg.architecture)
    layer_params, fixed_params = arch.layer_numel(cfg), arch.fixed_numel(cfg)
    if packed_head:
        fixed_params += cfg.vocab_size * cfg.hidden_size
    # Alive at once inside a layer, per token: the hidden stream, residual and norms,
    # q/k/v, and the MLP's gate/up; in a mixture of experts (models/moe.py), three
    # copies of the token's k routed rows, one expert's gate/up, the router's logits.
    mlp = (3 * cfg.num_experts_per_tok * cfg.hidden_size + 3 * cfg.moe_intermediate_size
           + cfg.num_experts if cfg.num_experts else 3 * cfg.intermediate_size)
    width = 4 * cfg.hidden_size + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + mlp
    return ModelShape(num_layers=cfg.num_layers, layer_params=layer_params,
                      fixed_params=fixed_params, kv_width=2 * cfg.num_kv_heads * cfg.head_dim,
                      activation_width=width, vocab_size=cfg.vocab_size,
                      max_position_embeddings=cfg.max_position_embeddings,
                      dtype_bytes=torch.finfo(dtype).bits // 8)


def group_stages(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int,
                 layer_bytes: list[int] | None = None) -> list[range]:
    """A device group's pipeline stages, balanced by each layer's bytes as one rank
    loads them (`layer_bytes`: a rank's compressed slices, `compressed_layer_bytes`; None:
    dense, every layer the same) with the LM head (a rank's slice of it) on the last."""
    from fusegen.engine.parallel.plan import layer_stages, model_stages

    head = cfg.vocab_size * cfg.hidden_size
    if layer_bytes is None:
        whole = get_architecture(cfg.architecture).layer_numel(cfg)  # as the runner splits
        return model_stages(whole, cfg.num_layers, head, pp)
    return layer_stages(layer_bytes, head * dtype.itemsize // tp, pp)


def rank_shape(cfg: ModelConfig, dtype: torch.dtype, tp: int, pp: int,
               packed_head: bool, stages: list[range] | None = None) -> ModelShape:
    """What one rank of a device group holds: its stage's layers (the stage of most
    layers, of `stages` or the dense split), its slice of each layer and of the
    embedding and head; the logits stay whole (the last stage gathers them). Refuses a
    split the model cannot take."""
    from fusegen.engine.parallel.plan import check_parallel
    from fusegen.engine.parallel.shard import rank_model_config

    check_parallel(cfg, tp, pp)
    local = model_shape(rank_model_config(cfg, tp), dtype, packed_head=packed_head)
    stages = stages or group_stages(cfg, dtype, tp, pp)
    return dataclasses.replace(local, num_layers=max(len(s) for s in stages),
                               fixed_params=-(-local.fixed_params // tp))


def grid_rank_shape(model, cfg: ModelConfig, dtype: torch.dtype, q: int, packed_head: bool,
                    options: EngineOptions) -> ModelShape:
    """What one rank of a [q, q, d] grid holds, counted exactly: its q x q block of every
    layer (1/q^2 of each linear; norms, o's and down's biases whole, as
    `shard.grid_layer_sources` narrows them), the most vocabulary rows any of the depth
    layer's q^2 ranks holds of the embedding and head (and of a tied head's packed copy
    on CPUs), the KV and activations of its heads block (`shard.grid_model_config`).
    Shapes from the checkpoint's tensor tables; nothing read."""
    from fusegen.engine.parallel.shard import (dense_numel, grid_layer_sources,
                                               grid_model_config, shard_fixed_sources,
                                               vocab_range)
    from fusegen.engine.weights.loader import checkpoint_tensors

    state = checkpoint_tensors(model, cfg, dtype, "dequantize", options.allow_pickle)
    arch = get_architecture(cfg.architecture)
    layer_params = max(dense_numel(grid_layer_sources(
        cfg, arch.layer_sources(state, i, cfg), q, 0, 0)) for i in range(cfg.num_layers))
    ranks = q * q

    def rows(rank: int) -> int:
        start, end = vocab_range(cfg.vocab_size, ranks, rank)
        return end - start

    widest = max(range(ranks), key=rows)
    fixed_params = dense_numel(shard_fixed_sources(cfg, arch.fixed_sources(state, cfg),
                                                   widest, ranks))
    if packed_head:
        fixed_params += rows(widest) * cfg.hidden_size
    local = model_shape(grid_model_config(cfg, q), dtype)
    return dataclasses.replace(local, layer_params=layer_params, fixed_params=fixed_params)


def compressed_layer_bytes(model, cfg: ModelConfig, dtype: torch.dtype, quantization: str,
                           options: EngineOptions, device: str, tp: int = 1) -> list[int]:
    """Each decoder layer's weight bytes with its linears kept compressed: their
    components, the other weights dense in `dtype` (from the tensor tables; nothing
    read); with `tp` > 1 one rank's slice (a split inside a block is refused,
    engine/parallel/shard.py). Explicit quantization="gguf" on a file with a layer
    linear in a type no kernel takes is refused here, naming the tensor."""
    from fusegen.engine.parallel.shard import rank_layer_nbytes
    from fusegen.engine.weights.loader import checkpoint_tensors
    from fusegen.engine.weights.quantized import layer_nbytes

    state = checkpoint_tensors(model, cfg, dtype, quantization, options.allow_pickle)
    arch = get_architecture(cfg.architecture)
    sizes = []
    for i in range(cfg.num_layers):
        sources = arch.layer_sources(state, i, cfg)
        if options.quantization == "gguf":
            _check_kernels(sources, model, device)
        if quantization in ("int8", "int4"):
            _check_groups(sources, model, device, quantization)
        sizes.append(layer_nbytes(sources, dtype.itemsize, device) if tp == 1 else
                     rank_layer_nbytes(cfg, sources, tp, dtype.itemsize, i, device))
    return sizes


def compressed_fixed_bytes(model, cfg: ModelConfig, dtype: torch.dtype,
                           options: EngineOptions, device: str) -> int | None:
    """The embedding, final norm and LM head's bytes where a GGUF file's embedding (and a
    head tied to it) or untied head stay as their blocks on `device`
    (weights/quantized_fixed.py, as `CausalLM.load_fixed` keeps them); None where none
    does (the dense count, `model_shape`, holds)."""
    from fusegen.engine.weights.loader import checkpoint_tensors
    from fusegen.engine.weights.quantized_fixed import fixed_blocks

    state = checkpoint_tensors(model, cfg, dtype, "gguf", options.allow_pickle)
    sources = get_architecture(cfg.architecture).fixed_sources(state, cfg)
    embed = fixed_blocks(sources["embed"][0], device, dtype)
    head = sources.get("lm_head.weight")
    head = None if head is None or cfg.tie_word_embeddings else fixed_blocks(head[0], device,
                                                                              dtype)
    if embed is None and head is None:
        return None
    total = 0
    for name, parts in sources.items():
        if name == "embed" and embed is not None:
            total += embed.nbytes
        elif name == "lm_head.weight" and head is not None:
            total += head.nbytes
        else:
            total += sum(part.numel() for part in parts) * dtype.itemsize
    return total


def _check_groups(sources: dict, model, device: str, quantization: str) -> None:
    """Quantized on load: each linear's input channels must fill whole groups."""
    for parts in sources.values():
        for part in parts:
            source = getattr(part, "compressed", None)
            if source is not None and source.shape[1] % source.params[1]:
                raise EngineConfigError(
                    f"quantization={quantization!r} on {model} (device {device}): tensor "
                    f"{source.name!r} has {source.shape[1]} input channels, not a multiple of "
                    f"the on-load group size {source.params[1]}; pass "
                    "quantization='dequantize', or quantize it with `fusegen quantize` and a "
                    "group size that divides it")


def _check_kernels(sources: dict, model, device: str) -> None:
    from fusegen.kernels.quant_linear import SUPPORTED

    types = gguf_kernel_types(device)
    for param, parts in sources.items():
        for part in parts:
            source = getattr(part, "compressed", None)
            if param.endswith(".weight") and source is not None \
                    and source.params[0] not in types:
                from gguf import GGMLQuantizationType

                raise EngineConfigError(
                    f"quantization='gguf' on {model} (device {device}): tensor "
                    f"{source.name!r} is {GGMLQuantizationType(source.params[0]).name}, which "
                    f"no kernel on {device} multiplies as blocks (kept: "
                    f"{', '.join(SUPPORTED[t] for t in sorted(types))}); leave quantization "
                    "out to keep the blocks it can and dequantize the rest, or pass "
                    "quantization='dequantize'")
