"""Compressed weights through the memory pool (issue 29): a quantized model's layers that
do not stay on the device stream as their compressed components (GGUF blocks, uint8;
int4 codes, fp16 scales and uint8 zero points), from host memory or the file's memory
map, into staging slots sized for them; greedy tokens equal the all-resident compressed
run, and the plan, the slots and the memory report count the compressed bytes exactly."""
import pytest
import torch
from safetensors import safe_open

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.config import EngineConfig
from fusegen.engine.memory.placement import (budget_for_resident_layers, format_bytes,
                                             minimum_device_budget)
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights.groupquant import GroupQuantExpertLinear, GroupQuantLinear
from fusegen.engine.weights.gguf import GGUFFile
from fusegen.engine.weights.quantize import QuantizeSpec, quantize_checkpoint
from fusegen.engine.weights.quantized import GGUFLinear

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10",
           " leading spaces\nand a newline"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
               max_num_batched_tokens=64)
NUM_LAYERS = 6
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HIDDEN = 64  # make_hf_checkpoint's hidden size: each layer's two norms, fp32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    hf_dir = make_hf_checkpoint(root / "hf", "llama", "bpe", seed=7,
                                num_hidden_layers=NUM_LAYERS, max_position_embeddings=128)
    # GGUF: Q4_1 blocks, but layer 0's down in Q8_0: layer 0 is the largest, the layers
    # after it all one smaller size. int4: asymmetric groups of 32 (three components).
    gguf = write_gguf(hf_dir, root / "tiny.gguf", qtype=Q.Q4_1,
                      types={"blk.0.ffn_down": Q.Q8_0})
    spec = QuantizeSpec(bits=4, group_size=32, symmetric=False)
    quantize_checkpoint(hf_dir, root / "int4", spec)
    # a mixture of experts: every expert's gate/up and down in int4, the router dense
    moe_dir = make_hf_checkpoint(root / "moe", "mixtral", "bpe", seed=9,
                                 num_hidden_layers=NUM_LAYERS, max_position_embeddings=128)
    quantize_checkpoint(moe_dir, root / "moe-int4", spec)
    return {"gguf": gguf, "int4": root / "int4", "moe": root / "moe-int4"}


def layer_bytes(kind: str, path) -> list[int]:
    """Each layer's bytes as the file stores them, from its tensor table alone: GGUF
    linears' blocks and two fp32 norms; an int4 checkpoint's codes, scales, zero
    points and fp32 norms (and router)."""
    if kind == "gguf":
        tensors = GGUFFile.open(path).tensors
        return [sum(tensors[f"blk.{i}.{name}.weight"].nbytes for name in LINEARS)
                + 2 * HIDDEN * 4 for i in range(NUM_LAYERS)]
    sizes = [0] * NUM_LAYERS
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if name.startswith("model.layers."):
                tensor = f.get_tensor(name)
                sizes[int(name.split(".")[2])] += tensor.numel() * tensor.element_size()
    return sizes


def _run(path, **options):
    with LLM(str(path), **OPTIONS, **options) as llm:
        outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        runner = llm.engine.runner
        return outs, runner, llm.memory_report(), llm.stats()


@pytest.fixture(scope="module")
def reference(models):
    out = {}
    for kind, path in models.items():
        outs, runner, report, _ = _run(path)
        assert runner.config.quantization == ("gguf" if kind == "gguf" else "int4")
        assert report["layers"] == {"device": NUM_LAYERS, "host": 0, "disk": 0}
        # the embedding, final norm and head, as this run holds them
        fixed = report["device"]["weights"] - sum(layer_bytes(kind, path))
        out[kind] = outs, runner.plan.sizes, fixed
    return out


def test_plan_counts_compressed_bytes(models, reference):
    for kind, path in models.items():
        per_layer, sizes = layer_bytes(kind, path), reference[kind][1]
        if kind == "gguf":
            assert per_layer[0] > per_layer[1] and len(set(per_layer[1:])) == 1
        assert sizes.layer_bytes == max(per_layer)  # the largest layer's components
        dense = EngineConfig.build(path, EngineOptions(**OPTIONS, quantization="dequantize")
                                   ).placement.sizes
        assert dense.dense_layer_bytes is None and sizes.dense_layer_bytes == dense.layer_bytes
        table = EngineConfig.build(path, EngineOptions(**OPTIONS)).placement.table()
        assert table.endswith(f"layer {format_bytes(sizes.layer_bytes)}, KV block "
                              f"{format_bytes(sizes.kv_block_bytes)}, streamed 0/{NUM_LAYERS} "
                              f"layers, compressed ({format_bytes(dense.layer_bytes)} a layer "
                              "dense)")
        # at one budget the compressed layers stay on the device, the dense ones not:
        # the smallest budget the dequantized model runs in streams its every layer
        budget = minimum_device_budget(dense)
        tiers = {q: EngineConfig.build(path, EngineOptions(
            **OPTIONS, quantization=q, device_memory=budget, host_memory=0)
        ).placement.layer_tiers for q in (None, "dequantize")}
        assert tiers["dequantize"] == ["disk"] * NUM_LAYERS
        assert tiers[None] == ["device"] * NUM_LAYERS


@pytest.mark.parametrize("kind, resident, tier", [
    ("gguf", 2, "host"), ("gguf", 3, "disk"), ("gguf", 0, "disk"), ("int4", 2, "host"),
    ("int4", 0, "disk"), ("moe", 1, "host"), ("moe", 0, "disk")])
def test_streamed_compressed_layers_generate_like_resident(models, reference, kind,
                                                           resident, tier):
    want, sizes, fixed = reference[kind]
    kv = sizes.min_kv_blocks * sizes.kv_block_bytes  # no KV share beyond one request's
    budget = budget_for_resident_layers(sizes, resident, kv_reserve=kv)
    host = "1GiB" if tier == "host" else 0
    got, runner, report, stats = _run(models[kind], device_memory=budget, host_memory=host,
                                      kv_cache_memory=kv)
    assert got == want
    tiers = runner.plan.layer_tiers
    assert tiers == ["device"] * resident + [tier] * (NUM_LAYERS - resident)
    per_layer = layer_bytes(kind, models[kind])
    streamed = range(resident, NUM_LAYERS)
    # every layer's linears are compressed: the resident ones holding their
    # components, the streamed ones shells pointed at a staging slot's bytes each step
    streamer = runner.model.streamer
    slots = {b.untyped_storage().data_ptr() for b in streamer.buffers}
    linear, codes = (GGUFLinear, "blocks") if kind == "gguf" else (GroupQuantLinear, "qweight")
    mlp = GroupQuantExpertLinear if kind == "moe" else linear  # every expert's, stacked
    for i in range(NUM_LAYERS):
        layer = runner.model.layers[i]
        assert type(layer.qkv) is linear and type(layer.o) is linear
        assert type(layer.gate_up) is mlp and type(layer.down) is mlp
        on_slot = getattr(layer.qkv, codes).untyped_storage().data_ptr() in slots
        assert on_slot == (i in streamed)
    view = streamer.views[0][streamed[0]]
    assert view[f"qkv.{codes}"].dtype == torch.uint8
    assert view["input_norm"].dtype == torch.float32
    if kind != "gguf":
        assert view["qkv.scales"].dtype == torch.float16
        assert view["qkv.zeros"].dtype == torch.uint8
    # exact accounting: a slot is the largest streamed layer's bytes, the tier holds
    # the streamed layers' components and norms, the device the resident ones'
    largest = max(per_layer[i] for i in streamed)
    assert streamer.slot_bytes == largest
    assert report["device"]["staging"] == 2 * largest
    assert report["streamed"]["bytes_per_load"] == largest
    assert report[tier]["weights"] == sum(per_layer[i] for i in streamed)
    assert report["device"]["weights"] == fixed + sum(per_layer[:resident])
    assert report["device"]["peak"] <= budget
    assert report["streamed"]["loads"] == 2 + stats["num_steps"] * len(streamed)
    # the copies ran over the streamed layers in order, each its own bytes
    assert streamer.bytes_copied == sum(per_layer[streamed[k % len(streamed)]]
                                        for k in range(streamer.num_loads))


def test_slot_layout_packs_each_dtype_aligned_without_padding():
    """A slot's bytes hold a layer's tensors widest element first: every offset a
    multiple of its tensor's element size, the total the tensors' bytes exactly (odd
    byte counts of uint8 codes come last)."""
    from fusegen.engine.memory.offload import Stream, slot_layout

    streams = {"qkv.qweight": Stream([torch.empty(3, 5, dtype=torch.uint8)], torch.uint8),
               "qkv.scales": Stream([torch.empty(3, 1, dtype=torch.float16),
                                     torch.empty(2, 1, dtype=torch.float16)], torch.float16),
               "input_norm": Stream([torch.empty(3, dtype=torch.bfloat16)], torch.float32)}
    layout = slot_layout(streams)
    assert [(name, offset) for name, (offset, _) in layout.items()] == [
        ("input_norm", 0), ("qkv.scales", 12), ("qkv.qweight", 22)]
    assert streams["qkv.scales"].shape == (5, 1) and streams["input_norm"].nbytes == 12
    assert sum(s.nbytes for s in streams.values()) == 22 + 15
