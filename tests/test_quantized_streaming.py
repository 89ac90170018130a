"""Compressed weights through the memory pool (issue 29): a quantized model's layers that
do not stay on the device stream as their compressed components (GGUF blocks, uint8),
from host memory or the file's memory map, into staging slots sized for them; greedy
tokens equal the all-resident compressed run, and the plan, the slots and the memory
report count the compressed bytes exactly."""
import pytest
import torch

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.config import EngineConfig
from fusegen.engine.memory.placement import budget_for_resident_layers, minimum_device_budget
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights.gguf import GGUFFile
from fusegen.engine.weights.quantized import GGUFLinear

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10",
           " leading spaces\nand a newline"]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
               quantization="gguf")
NUM_LAYERS = 6
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HIDDEN = 64  # make_hf_checkpoint's hidden size: each layer's two norms, fp32


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    hf_dir = make_hf_checkpoint(root / "hf", "llama", "bpe", seed=7,
                                num_hidden_layers=NUM_LAYERS, max_position_embeddings=128)
    # Q4_1 blocks, but layer 0's down in Q8_0: layer 0 is the largest, the streamed
    # layers after it all one smaller size
    return write_gguf(hf_dir, root / "tiny.gguf", qtype=Q.Q4_1,
                      types={"blk.0.ffn_down": Q.Q8_0})


def layer_bytes(path) -> list[int]:
    """Each layer's bytes as the file stores its linears (their blocks), and its two
    norms in fp32: from the tensor table alone."""
    tensors = GGUFFile.open(path).tensors
    return [sum(tensors[f"blk.{i}.{name}.weight"].nbytes for name in LINEARS) + 2 * HIDDEN * 4
            for i in range(NUM_LAYERS)]


def _run(path, **options):
    with LLM(str(path), **OPTIONS, **options) as llm:
        outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        runner = llm.engine.runner
        return outs, runner, llm.memory_report(), llm.stats()


@pytest.fixture(scope="module")
def reference(gguf_path):
    outs, runner, report, _ = _run(gguf_path)
    assert report["layers"] == {"device": NUM_LAYERS, "host": 0, "disk": 0}
    # the embedding, final norm and head, as this run holds them
    fixed = report["device"]["weights"] - sum(layer_bytes(gguf_path))
    return outs, runner.plan.sizes, fixed


def test_plan_counts_compressed_bytes(gguf_path, reference):
    _, sizes, _ = reference
    per_layer = layer_bytes(gguf_path)
    assert per_layer[0] > per_layer[1] and len(set(per_layer[1:])) == 1
    assert sizes.layer_bytes == max(per_layer)  # the largest layer's blocks
    assert f"streamed 0/{NUM_LAYERS} layers" in EngineConfig.build(
        gguf_path, EngineOptions(**OPTIONS)).placement.table()
    # at one budget the blocks keep more layers on the device than dense weights do:
    # the smallest budget the dequantized model runs in streams its every layer
    dense = dict(OPTIONS, quantization="dequantize")
    budget = minimum_device_budget(EngineConfig.build(gguf_path, EngineOptions(**dense))
                                   .placement.sizes)
    tiers = {q: EngineConfig.build(gguf_path, EngineOptions(**dict(OPTIONS, quantization=q),
                                                             device_memory=budget, host_memory=0)
                                   ).placement.layer_tiers for q in ("gguf", "dequantize")}
    assert tiers["dequantize"] == ["disk"] * NUM_LAYERS
    assert tiers["gguf"] == ["device"] * NUM_LAYERS


@pytest.mark.parametrize("resident, tier", [(2, "host"), (3, "disk"), (0, "disk")])
def test_streamed_compressed_layers_generate_like_resident(gguf_path, reference, resident,
                                                           tier):
    want, sizes, fixed = reference
    kv = sizes.min_kv_blocks * sizes.kv_block_bytes  # no KV share beyond one request's
    budget = budget_for_resident_layers(sizes, resident, kv_reserve=kv)
    host = "1GiB" if tier == "host" else 0
    got, runner, report, stats = _run(gguf_path, device_memory=budget, host_memory=host,
                                      kv_cache_memory=kv)
    assert got == want
    tiers = runner.plan.layer_tiers
    assert tiers == ["device"] * resident + [tier] * (NUM_LAYERS - resident)
    per_layer = layer_bytes(gguf_path)
    streamed = range(resident, NUM_LAYERS)
    # every layer's linears are compressed: the resident ones holding their blocks,
    # the streamed ones shells pointed at a staging slot's bytes each step
    streamer = runner.model.streamer
    slots = {b.untyped_storage().data_ptr() for b in streamer.buffers}
    for i in range(NUM_LAYERS):
        layer = runner.model.layers[i]
        assert all(type(m) is GGUFLinear for m in (layer.qkv, layer.o, layer.gate_up,
                                                   layer.down))
        on_slot = layer.qkv.blocks.untyped_storage().data_ptr() in slots
        assert on_slot == (i in streamed)
    view = streamer.views[0][streamed[0]]
    assert view["qkv.blocks"].dtype == torch.uint8 and view["input_norm"].dtype == torch.float32
    # exact accounting: a slot is the largest streamed layer's bytes, the tier holds
    # the streamed layers' blocks and norms, the device the resident ones'
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
