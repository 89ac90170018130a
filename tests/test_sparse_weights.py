"""Sparse (bitmap-tile) checkpoints through the engine (weights/sparse.py): a pruned
model stored sparse generates the same greedy fp32 tokens as the same pruned weights
stored dense, on every architecture, resident and streamed; the plan and staging slots
hold the tiles' exact bytes; damaged tile tables and declarations are named."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import ARCHS
from quant_helpers import cached_checkpoint, compressible_names, generate_tokens, write_rewritten
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.memory.placement import budget_for_resident_layers
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.weights.compressed import CompressedSource
from fusegen.engine.weights.sparse import SparseExpertLinear, SparseLinear, segment_tiles
from fusegen.kernels import sparse_format as codec

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10",
           " leading spaces\nand a newline"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=96, max_num_seqs=4)
# hidden 96, intermediate 160: row- and column-tiles cut at the matrix's edge
SIZES = dict(hidden_size=96, intermediate_size=160)
OVERRIDES = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                               norm_topk_prob=True)}
LINEARS = ("qkv", "o", "gate_up", "down")


def prune(w: torch.Tensor, sparsity: float = 0.5) -> torch.Tensor:
    """w with the `sparsity` share of each row's smallest |w| set to zero."""
    drop = int(w.shape[1] * sparsity)
    order = w.abs().argsort(dim=1, stable=True)[:, :drop]
    return w.clone().scatter_(1, order, 0.0)


def write_pruned(src: Path, dst: Path, values: str | None, edit=None,
                 config_edit=None) -> Path:
    """`src` with its decoder linears pruned to 50% per row, written to `dst`: dense
    (values None; int8 values' dequantized weights where `values` is "int8-dense") or
    sparse with `values`. `edit(tensors)` / `config_edit(sparsity_config)` damage them."""

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        pruned = prune(tensor.float())
        if values is None:
            return {name: pruned}
        if values == "int8-dense":  # what int8 tiles hold, stored dense
            return {name: codec.decode(codec.encode(pruned, "int8"))}
        return codec.tensors(name, codec.encode(pruned, values))

    entry = None
    if values not in (None, "int8-dense"):
        entry = ("sparsity_config", {
            "format": "fusegen-bitmap-tiles", "version": 1, "tile": [64, 64],
            "values": values, "sparsity": 0.5, "method": "magnitude",
            "modules": sorted(compressible_names(src))})
        if config_edit is not None:
            config_edit(entry[1])
    return write_rewritten(src, dst, convert, edit, entry)


_SOURCES: dict[str, Path] = {}


def source(arch: str, tmp_path_factory, **extra) -> Path:
    return cached_checkpoint(_SOURCES, arch, tmp_path_factory, **SIZES,
                             **OVERRIDES.get(arch, {}), **extra)


def generate(path, **options):
    tokens, runner, report, _ = generate_tokens(path, PROMPTS, PARAMS, **OPTIONS, **options)
    return tokens, runner, report


def check_sparse(runner, moe: bool) -> None:
    for layer in runner.model.layers:
        for name in LINEARS:
            want = SparseExpertLinear if moe and name in ("gate_up", "down") else SparseLinear
            assert type(getattr(layer, name)) is want
        if moe:
            assert type(layer.router) is not SparseLinear  # routers stay dense
    assert not isinstance(runner.model.lm_head, SparseLinear)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_sparse_checkpoint_generates_like_pruned_dense(arch, tmp_path, tmp_path_factory):
    src = source(arch, tmp_path_factory)
    values = ("float32", "bfloat16")[list(ARCHS).index(arch) % 2]
    dense = write_pruned(src, tmp_path / "d", None)
    sparse = write_pruned(src, tmp_path / "s", values)
    want, _, _ = generate(dense)
    got, runner, _ = generate(sparse)  # the checkpoint says what it is: no option
    assert runner.config.quantization == "sparse"
    check_sparse(runner, moe=arch in OVERRIDES)
    if values == "bfloat16":  # the pruned weights rounded to bf16, stored dense
        bf16 = write_pruned(src, tmp_path / "b", None, edit=_round_bf16(src))
        want, _, _ = generate(bf16)
    assert got == want
    got, _, _ = generate(sparse, quantization="dequantize")  # decoded as it loads
    assert got == want


def _round_bf16(src):
    names = compressible_names(src)

    def edit(tensors):
        for name in names:
            tensors[name] = tensors[name].to(torch.bfloat16).float()
    return edit


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_int8_values_generate_like_their_dense_weights(arch, tmp_path, tmp_path_factory):
    src = source(arch, tmp_path_factory)
    want, _, _ = generate(write_pruned(src, tmp_path / "d", "int8-dense"))
    got, runner, report = generate(write_pruned(src, tmp_path / "s", "int8"))
    assert got == want
    layer = runner.model.layers[0]
    assert layer.qkv.values.dtype == torch.int8 and layer.qkv.scales.dtype == torch.float32


@pytest.mark.parametrize("kernels, deterministic", [("reference", False), ("auto", True)])
def test_torch_path_and_deterministic_mode(kernels, deterministic, monkeypatch, tmp_path,
                                           tmp_path_factory):
    """The torch path (bands of row-tiles expanded, FUSEGEN_KERNELS=reference) and
    deterministic mode (row-tiled calls) give the pruned dense weights' tokens too."""
    src = source("qwen2", tmp_path_factory)
    want, _, _ = generate(write_pruned(src, tmp_path / "d", None))
    sparse = write_pruned(src, tmp_path / "s", "float32")
    monkeypatch.setenv("FUSEGEN_KERNELS", kernels)
    got, runner, _ = generate(sparse, deterministic=deterministic)
    assert got == want
    assert (runner.model.layers[0].qkv.row_tile is not None) == deterministic


NUM_LAYERS = 5


@pytest.mark.parametrize("arch, resident, host", [
    ("llama", 2, "1GiB"), ("llama", 0, 0), ("mixtral", 1, 0), ("qwen3", 0, "1GiB")])
def test_streamed_sparse_layers_generate_like_resident(arch, resident, host, tmp_path,
                                                      tmp_path_factory):
    src = source(arch, tmp_path_factory, num_hidden_layers=NUM_LAYERS)
    sparse = write_pruned(src, tmp_path / "s", "bfloat16")
    want, ref, ref_report = generate(sparse)
    sizes = ref.plan.sizes
    layer_bytes = layer_file_bytes(sparse)
    assert sizes.layer_bytes == max(layer_bytes)  # the tiles' exact bytes, the largest
    assert ref_report["layers"] == {"device": NUM_LAYERS, "host": 0, "disk": 0}
    for i, layer in enumerate(ref.model.layers):  # resident: the tiles as stored, exactly
        held = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
        held += sum(getattr(layer, n).nbytes for n in (*LINEARS, "router")
                    if hasattr(layer, n))  # a mixture of experts' router: dense
        assert held == layer_bytes[i]
    kv = sizes.min_kv_blocks * sizes.kv_block_bytes
    budget = budget_for_resident_layers(sizes, resident, kv_reserve=kv)
    got, runner, report = generate(sparse, device_memory=budget, host_memory=host,
                                   kv_cache_memory=kv)
    assert got == want
    tier = "host" if host else "disk"
    assert runner.plan.layer_tiers == ["device"] * resident + [tier] * (NUM_LAYERS - resident)
    streamer = runner.model.streamer
    slots = {b.untyped_storage().data_ptr() for b in streamer.buffers}
    for i, layer in enumerate(runner.model.layers):
        on_slot = layer.qkv.values.untyped_storage().data_ptr() in slots
        assert on_slot == (i >= resident)
    view = streamer.views[0][resident]
    assert view["qkv.bitmap"].dtype == torch.uint64
    assert view["qkv.offsets"].dtype == torch.int64
    assert view["qkv.values"].dtype == torch.bfloat16
    largest = max(layer_bytes[resident:])
    assert streamer.slot_bytes == largest
    assert report["streamed"]["bytes_per_load"] == largest


def layer_file_bytes(path: Path) -> list[int]:
    """Each decoder layer's bytes as the file stores them (tiles, norms, router)."""
    sizes = [0] * NUM_LAYERS
    for name, tensor in load_file(path / "model.safetensors").items():
        if name.startswith("model.layers."):
            sizes[int(name.split(".")[2])] += tensor.numel() * tensor.element_size()
    return sizes


def test_source_bytes_and_segments_are_exact():
    """A fused parameter's parts, each its own tile table: component shapes, bytes (the
    codec's `nbytes`) and the per-part views the linear multiplies through."""
    torch.manual_seed(0)
    weights = [prune(torch.randn(rows, 150)) for rows in (70, 64, 1)]
    for values in ("float16", "int8"):
        tiles = [codec.encode(w, values) for w in weights]
        parts = [CompressedSource.of("sparse", (values,), (w.shape[0], 150), f"w{i}",
                                     lambda t=t: codec.tensors("x", t),
                                     segments=((w.shape[0], t.nnz),))
                 for i, (w, t) in enumerate(zip(weights, tiles))]
        assert [p.nbytes for p in parts] == [codec.nbytes(t) for t in tiles]
        stacked = {n: torch.cat([getattr(t, n) for t in tiles])
                   for n in ("bitmap", "offsets", "values")}
        if values == "int8":
            stacked["scales"] = torch.cat([t.scales for t in tiles])
        shapes = CompressedSource.of("sparse", (values,), (135, 150), "qkv", None, segments=(
            (70, tiles[0].nnz), (64, tiles[1].nnz), (1, tiles[2].nnz))).components()
        assert {n: (t.dtype, tuple(t.shape)) for n, t in stacked.items()} == shapes
        views = segment_tiles(stacked, ((70, tiles[0].nnz), (64, tiles[1].nnz),
                                        (1, tiles[2].nnz)), 150)
        for view, w, t in zip(views, weights, tiles):
            assert torch.equal(codec.decode(view), codec.decode(t))
            if values == "float16":
                assert torch.equal(codec.decode(view), w.half().float())


def _set(name, make):
    def edit(tensors):
        tensors[name] = make(tensors[name])
    return edit


Q = "model.layers.1.self_attn.q_proj.weight"


def _bump_offsets(t):
    t = t.clone()
    t[3] += 1
    return t


@pytest.mark.parametrize("edit, message", [
    (_set(Q + ".sparse_offsets", _bump_offsets),
     "sparse_offsets: tile 2 spans"),
    (_set(Q + ".sparse_values", lambda t: t[:-1]),
     "sparse_values: "),
    (_set(Q + ".sparse_bitmap", lambda t: t[1:]),
     "sparse_bitmap: expected"),
])
def test_damaged_tile_tables_are_named(edit, message, tmp_path, tmp_path_factory):
    src = source("llama", tmp_path_factory)
    bad = write_pruned(src, tmp_path / "s", "float32", edit=edit)
    with pytest.raises(ModelLoadError) as info:
        generate(bad)
    text = str(info.value)
    assert "model.safetensors" in text and repr(Q) in text and message in text


def test_tile_tables_are_checked_once_a_process(tmp_path, tmp_path_factory, monkeypatch):
    """The plan reads the checkpoint, then the runner: each weight's tile table is checked
    once; a file changed since is checked again."""
    src = source("llama", tmp_path_factory)
    sparse = write_pruned(src, tmp_path / "s", "float32")
    checked = []
    real = codec.check
    monkeypatch.setattr(codec, "check", lambda t, *shape: checked.append(shape) or real(t, *shape))
    want, _, _ = generate(sparse)
    modules = len(compressible_names(src))
    assert len(checked) == modules
    assert generate(sparse)[0] == want and len(checked) == modules
    stat = (sparse / "model.safetensors").stat()
    os.utime(sparse / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert generate(sparse)[0] == want and len(checked) == 2 * modules


@pytest.mark.parametrize("config_edit, message", [
    (lambda c: c.update(version=2), "sparsity_config.version is 2"),
    (lambda c: c.update(values="int4"), "sparsity_config.values is 'int4'"),
    (lambda c: c.update(tile=[32, 32]), "sparsity_config.tile is [32, 32]"),
    (lambda c: c.update(modules=c["modules"] + ["model.layers.0.input_layernorm.weight"]),
     "'model.layers.0.input_layernorm.weight', which is no linear weight"),
    (lambda c: c.update(values="float16"), "config.json's sparsity_config.values says float16"),
])
def test_bad_declarations_are_named(config_edit, message, tmp_path, tmp_path_factory):
    src = source("llama", tmp_path_factory)
    bad = write_pruned(src, tmp_path / "s", "float32", config_edit=config_edit)
    with pytest.raises(ModelLoadError) as info:
        generate(bad)
    assert message in str(info.value)


def test_missing_and_stray_components_are_named(tmp_path, tmp_path_factory):
    src = source("llama", tmp_path_factory)
    bad = write_pruned(src, tmp_path / "a", "float32",
                       edit=lambda t: t.pop(Q + ".sparse_values"))
    with pytest.raises(ModelLoadError, match=r"sparse_values' is missing"):
        generate(bad)

    def unlist(c):
        c["modules"].remove(Q)
    bad = write_pruned(src, tmp_path / "b", "float32", config_edit=unlist)
    with pytest.raises(ModelLoadError, match=r"belongs to no weight listed"):
        generate(bad)


@pytest.mark.parametrize("arch", ["mixtral"])  # attention and every expert split
def test_tensor_parallel_ranks_generate_like_one_process(arch, tmp_path, tmp_path_factory):
    """Two ranks each hold their slice of every sparse weight (q/k/v and gate/up rows, o
    and down columns; windows cut inside tiles re-tiled), as tiles; greedy fp32 tokens
    equal the pruned dense weights' in one process, and a rank's planned layer bytes are
    the larger rank's tiles exactly."""
    src = source(arch, tmp_path_factory)
    want, _, _ = generate(write_pruned(src, tmp_path / "d", None))
    sparse = write_pruned(src, tmp_path / "s", "float32")
    with LLM(str(sparse), tensor_parallel_size=2, **OPTIONS) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        layer_bytes = llm.placement.sizes.layer_bytes
    assert got == want
    cfg = ModelConfig.from_dir(str(sparse))
    from fusegen.engine.parallel.shard import shard_kept
    from fusegen.engine.weights.loader import checkpoint_tensors
    from fusegen.engine.weights.quantized import split_kept

    state = checkpoint_tensors(sparse, cfg, torch.float32, "sparse")
    arch_ = get_architecture(cfg.architecture)
    most = 0
    for i in range(cfg.num_layers):
        kept, dense = split_kept(arch_.layer_sources(state, i, cfg))
        assert sorted(kept) == ["down.weight", "gate_up.weight", "o.weight", "qkv.weight"]
        for rank in range(2):
            parts = shard_kept(cfg, kept, rank, 2, i)
            loaded = sum(codec.nbytes(codec.SparseTiles(
                c["bitmap"], c["offsets"], c["values"], None, *p.shape))
                for ps in parts.values() for p in ps for c in [p.load()])
            assert loaded == sum(p.nbytes for ps in parts.values() for p in ps)
            norms = sum(t.numel() * 4 for ts in dense.values() for t in ts
                        if t.dim() == 1)
            router = sum(t.numel() * 4 for ts in dense.values() for t in ts if t.dim() == 2)
            most = max(most, loaded + norms + router)
    assert layer_bytes == most


def test_another_quantization_is_refused_naming_the_forms(tmp_path, tmp_path_factory):
    from fusegen.engine.errors import EngineConfigError

    sparse = write_pruned(source("llama", tmp_path_factory), tmp_path / "s", "float32")
    with pytest.raises(EngineConfigError) as info:
        LLM(str(sparse), quantization="int8", **OPTIONS)
    assert str(info.value).endswith(
        "on cpu this model runs with quantization=None (its sparse tiles as stored), "
        "'dequantize'")
