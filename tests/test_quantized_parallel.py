"""Compressed weights in device groups (issue 29): tensor-parallel ranks hold their slice
of each compressed weight (GGUF blocks, fusegen int4 groups) as compressed components,
narrowed from the file without reading it; pipeline stages hold their layers compressed;
ranks stream their compressed slices like one process does. Greedy fp32 tokens equal
the single-process compressed run; a split inside a block is refused before any rank
starts."""
from __future__ import annotations

import psutil
import pytest
import torch

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from fusegen import LLM, SamplingParams
from fusegen.engine.config import EngineConfig
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.memory.placement import budget_for_resident_layers
from fusegen.engine.models import get_architecture
from fusegen.engine.options import EngineOptions
from fusegen.engine.parallel.shard import rank_layer_nbytes, rank_model_config, shard_kept
from fusegen.engine.weights.loader import checkpoint_tensors
from fusegen.engine.weights.quantize import QuantizeSpec, quantize_checkpoint
from fusegen.engine.weights.quantized import fuse_components, split_kept

PROMPTS = [list(range(5, 14)), [20, 21, 22], list(range(30, 70)), [7] * 17]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# every engine here a CPU one, also on a machine with a GPU (gloo ranks)
LIMITS = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64)
NORM_BYTES = 2 * 64 * 4  # a layer's two fp32 norms of the hidden size, whole on every rank


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "fusegen.engine.parallel" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny llamas (hidden 64, 4 heads of 16, 2 KV heads, intermediate 128): a GGUF file
    in Q8_0 blocks (of 32 columns), an int4 checkpoint in asymmetric groups of 32
    (codes, fp16 scales and zero points) with four layers, and a Mixtral in int4."""
    root = tmp_path_factory.mktemp("quantized_parallel")
    hf_dir = make_hf_checkpoint(root / "hf", "llama", "bpe", seed=3)
    deep = make_hf_checkpoint(root / "deep", "llama", "bpe", seed=5, num_hidden_layers=4,
                              max_position_embeddings=128)
    spec = QuantizeSpec(bits=4, group_size=32, symmetric=False)
    quantize_checkpoint(deep, root / "int4", spec)
    # a mixture of experts (8 experts of intermediate 128) in int4: its experts' slices
    moe = make_hf_checkpoint(root / "moe", "mixtral", "bpe", seed=9)
    quantize_checkpoint(moe, root / "moe-int4", spec)
    return {"gguf": write_gguf(hf_dir, root / "tiny.gguf", qtype=Q.Q8_0),
            "int4": root / "int4", "moe": root / "moe-int4"}


@pytest.fixture(scope="module")
def reference(models):
    out = {}
    for kind, path in models.items():
        with LLM(str(path), **LIMITS) as llm:
            out[kind] = tokens(llm)
    return out


@pytest.mark.parametrize("kind, quantization", [("gguf", "gguf"), ("int4", "int4")])
def test_rank_slices_stack_into_the_whole_components(models, kind, quantization):
    """Two ranks' compressed slices of layer 1, loaded, give the whole layer's
    components: q/k/v and gate/up rows stacked, o and down columns (whole blocks or
    groups) side by side; a rank's bytes are half the linears' and the norms'."""
    path = models[kind]
    cfg = EngineConfig.build(path, EngineOptions(**LIMITS)).model_config
    sources = get_architecture(cfg.architecture).layer_sources(
        checkpoint_tensors(path, cfg, torch.float32, quantization), 1, cfg)
    kept, dense = split_kept(sources)
    assert sorted(kept) == ["down.weight", "gate_up.weight", "o.weight", "qkv.weight"]
    assert sorted(dense) == ["input_norm", "post_norm"]
    whole = {p: fuse_components(parts, "cpu") for p, parts in kept.items()}
    ranks = [{p: fuse_components(parts, "cpu") for p, parts in
              shard_kept(cfg, kept, r, 2, 1).items()} for r in range(2)]
    local = rank_model_config(cfg, 2)
    d = cfg.head_dim
    q_rows, kv_rows = local.num_heads * d, local.num_kv_heads * d
    inter = cfg.intermediate_size // 2
    for name in whole["qkv.weight"]:  # "blocks", or "qweight", "scales", "zeros"
        qkv = [r["qkv.weight"][name] for r in ranks]
        q, k, v = whole["qkv.weight"][name].split([cfg.num_heads * d, cfg.num_kv_heads * d,
                                                   cfg.num_kv_heads * d])
        assert torch.equal(torch.cat([t[:q_rows] for t in qkv]), q)
        assert torch.equal(torch.cat([t[q_rows:q_rows + kv_rows] for t in qkv]), k)
        assert torch.equal(torch.cat([t[q_rows + kv_rows:] for t in qkv]), v)
        gate_up = torch.cat([r["gate_up.weight"][name].view(2, inter, -1) for r in ranks], 1)
        assert torch.equal(gate_up.reshape(2 * cfg.intermediate_size, -1),
                           whole["gate_up.weight"][name])
        for param in ("o.weight", "down.weight"):
            assert torch.equal(torch.cat([r[param][name] for r in ranks], dim=1),
                               whole[param][name])
    linear_bytes = sum(t.numel() * t.element_size() for c in whole.values() for t in c.values())
    assert rank_layer_nbytes(cfg, sources, 2, 4, 1) == linear_bytes // 2 + NORM_BYTES


@pytest.mark.parametrize("kind, what", [
    ("gguf", "blk.0.attn_output.weight): it is kept compressed (GGUF Q8_0) in blocks of 32"),
    ("int4", "model.layers.0.self_attn.o_proj.weight): it is kept compressed (int4, groups "
             "of 32, asymmetric) in blocks of 32")], ids=["gguf", "int4"])
def test_a_split_inside_a_block_is_refused_before_any_rank_starts(models, kind, what):
    # four ranks would take 16 of o's 64 input columns each: half a block
    with pytest.raises(EngineConfigError) as info:
        LLM(str(models[kind]), tensor_parallel_size=4, **LIMITS)
    assert str(info.value) == (
        f"tensor_parallel_size 4 cannot split layer 0's o.weight ({what} input columns, and "
        "each rank would take 16 of its 64, which cuts a block; use a tensor_parallel_size "
        "that leaves each rank a multiple of 32 columns, or quantization='dequantize'")
    assert _children() == []
    dense = EngineConfig.build(models[kind], EngineOptions(tensor_parallel_size=4,
                                                          quantization="dequantize", **LIMITS))
    assert dense.quantization == "dequantize"  # dequantized, the split is a dense one


def test_gguf_ranks_and_stages_give_single_process_tokens(models, reference):
    path = str(models["gguf"])
    whole = EngineConfig.build(path, EngineOptions(**LIMITS)).placement.sizes.layer_bytes
    for split, layer_bytes in [(dict(tensor_parallel_size=2), (whole - NORM_BYTES) // 2
                                + NORM_BYTES), (dict(pipeline_parallel_size=2), whole)]:
        with LLM(path, **split, **LIMITS) as llm:
            assert tokens(llm) == reference["gguf"], split
            assert llm.placement.sizes.layer_bytes == layer_bytes  # the rank's, compressed
            ranks = llm.memory_report()["ranks"]
        assert sorted(ranks) == [0, 1]
    assert _children() == []


def test_moe_ranks_split_every_expert_compressed(models, reference):
    with LLM(str(models["moe"]), tensor_parallel_size=2, **LIMITS) as llm:
        assert tokens(llm) == reference["moe"]
    assert _children() == []


def test_int4_ranks_stream_their_compressed_slices(models, reference):
    """Tensor parallel: each rank keeps one layer and streams three from host memory, the
    slots and the tier counting the rank's compressed bytes (half the linears')."""
    path = str(models["int4"])
    whole = EngineConfig.build(path, EngineOptions(**LIMITS)).placement.sizes.layer_bytes
    layer_bytes = (whole - NORM_BYTES) // 2 + NORM_BYTES
    split = dict(tensor_parallel_size=2)
    sizes = EngineConfig.build(path, EngineOptions(**split, **LIMITS)).placement.sizes
    assert sizes.layer_bytes == layer_bytes
    kv = sizes.min_kv_blocks * sizes.kv_block_bytes
    budget = budget_for_resident_layers(sizes, 1, kv_reserve=kv)
    with LLM(path, device_memory=budget, host_memory="1GiB", kv_cache_memory=kv, **split,
             **LIMITS) as llm:
        assert tokens(llm) == reference["int4"]
        ranks = llm.memory_report()["ranks"]
    assert sorted(ranks) == [0, 1]
    for report in ranks.values():
        assert report["layers"] == {"device": 1, "host": 3, "disk": 0}
        assert report["host"]["weights"] == 3 * layer_bytes
        assert report["device"]["staging"] == 2 * layer_bytes
        assert report["streamed"]["bytes_per_load"] == layer_bytes
    assert _children() == []


def test_pipeline_stages_balance_compressed_bytes(tmp_path):
    """Four layers, the last in Q8_0 blocks (34 bytes per 32 weights), the others in Q4_0
    (18): by parameter counts (every layer alike, the head at half on the last stage) two
    stages take 2 + 2 layers; by the bytes the layers load as, 3 + 1, and the group runs
    those stages and makes the single process's tokens."""
    from fusegen.engine.memory.shape import compressed_layer_bytes
    from fusegen.engine.parallel.plan import model_stages

    deep = make_hf_checkpoint(tmp_path / "deep", "llama", "bpe", seed=5, num_hidden_layers=4,
                              max_position_embeddings=128)
    path = write_gguf(deep, tmp_path / "mixed.gguf", qtype=Q.Q4_0, types={"blk.3.": Q.Q8_0})
    split = dict(pipeline_parallel_size=2, **LIMITS)
    config = EngineConfig.build(path, EngineOptions(**split))
    cfg = config.model_config
    assert config.quantization == "gguf"
    linears = get_architecture(cfg.architecture).layer_numel(cfg) - NORM_BYTES // 4
    small, large = linears * 18 // 32 + NORM_BYTES, linears * 34 // 32 + NORM_BYTES
    assert compressed_layer_bytes(path, cfg, torch.float32, "gguf", config.options,
                                  "cpu") == [small, small, small, large]
    assert model_stages(linears, 4, cfg.vocab_size * cfg.hidden_size, 2) == [range(0, 2),
                                                                            range(2, 4)]
    assert config.stages == (range(0, 3), range(3, 4))
    assert config.shape.num_layers == 3 and config.shape.layer_bytes == large
    with LLM(str(path), **LIMITS) as llm:
        want = tokens(llm)
    with LLM(str(path), **split) as llm:
        assert tokens(llm) == want
        assert llm.memory_report()["group"]["stages"] == [[0, 3], [3, 4]]
    assert _children() == []


def test_fp8_weights_split_along_any_columns():
    # FP8 keeps one scale per output row, so a row-parallel split may cut its columns
    # anywhere: a rank's slice is the weight's columns with every row's scale
    from fusegen.engine.parallel.shard import block_columns
    from fusegen.engine.weights.quantized import CompressedSource

    weight = torch.randn(6, 10).to(torch.float8_e4m3fn)
    scale = torch.rand(6) + 0.5
    src = CompressedSource.of("fp8", (), (6, 10), "o_proj.weight",
                              lambda: {"weight_fp8": weight, "weight_scale": scale})
    assert block_columns(src) == 1
    half = src.narrow(1, 5, 5)
    assert half.shape == (6, 5)
    got = half.load()
    assert torch.equal(got["weight_fp8"].view(torch.uint8), weight[:, 5:].view(torch.uint8))
    assert torch.equal(got["weight_scale"], scale)
    assert half.nbytes == 6 * 5 + 6 * 4
