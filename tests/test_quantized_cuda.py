"""GGUF blocks on CUDA GPUs (issue 29), checked on the CPU: which types keep their blocks
on "cuda" (the Triton kernel's, none without Triton), what quantization= resolves to or
refuses there, and a GGUFLinear's forward through `gguf_linear_triton` (run under
Triton's interpreter in kernels/testing.py's child) against the kernel's torch reference,
batch-invariant in deterministic mode. What still needs a GPU: the compiled kernel inside
a whole engine run (tests/gpu)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from quant_helpers import config_error, make_blocks, run_interpreted
from fusegen.engine.config import read_model_config, resolve_quantization
from fusegen.engine.memory.shape import compressed_layer_bytes
from fusegen.engine.models import get_architecture
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights import quantized
from fusegen.engine.weights.linear import ROW_TILE, Linear
from fusegen.engine.weights.loader import checkpoint_tensors
from fusegen.engine.weights.quantized import (TRITON_GGUF_TYPES, GGUFLinear, gguf_kernel_types,
                                              kept_as_blocks, split_kept)
from fusegen.kernels import quant_linear as ql

pytest.importorskip("triton")
from fusegen.kernels import triton_quant as tq  # noqa: E402
from fusegen.kernels.testing import interpreted  # noqa: E402

ALL_EIGHT = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setattr(quantized, "_triton_available", lambda: False)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    hf_dir = make_hf_checkpoint(tmp_path_factory.mktemp("hf"), "llama", "bpe", seed=2)
    return write_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", qtype=Q.Q4_1)


def test_types_kept_as_blocks_per_device(monkeypatch):
    assert TRITON_GGUF_TYPES == ALL_EIGHT
    assert gguf_kernel_types("cpu") == set(ql.SUPPORTED)
    for device in ("cuda", "cuda:1", "cuda:0,1"):
        assert gguf_kernel_types(device) == ALL_EIGHT
    assert gguf_kernel_types("mps") == set()
    shape = (64, 256)
    assert kept_as_blocks("qkv.weight", [(Q.Q4_K, shape)] * 3, "cuda")
    assert not kept_as_blocks("down.weight", [(Q.Q2_K, shape)], "cuda")
    # a type the C kernels take but the Triton kernel does not decode: dense on GPUs only
    monkeypatch.setattr(quantized, "TRITON_GGUF_TYPES", ALL_EIGHT - {Q.Q4_K})
    assert kept_as_blocks("o.weight", [(Q.Q4_K, shape)], "cpu")
    assert not kept_as_blocks("o.weight", [(Q.Q4_K, shape)], "cuda")
    monkeypatch.setattr(quantized, "_triton_available", lambda: False)
    assert gguf_kernel_types("cuda") == set() and gguf_kernel_types("cpu") == set(ql.SUPPORTED)
    assert not kept_as_blocks("o.weight", [(Q.Q8_0, shape)], "cuda:0")


def test_what_quantization_resolves_to_on_cuda(gguf_path):
    assert resolve_quantization(None, gguf_path, "cuda") == "gguf"
    assert resolve_quantization(None, gguf_path, "cuda:0,1") == "gguf"
    assert resolve_quantization("gguf", gguf_path, "cuda:0") == "gguf"
    assert resolve_quantization("dequantize", gguf_path, "cuda") == "dequantize"
    assert config_error(resolve_quantization, "int4", gguf_path, "cuda:0") == (
        f"quantization='int4' on {gguf_path} (device cuda:0): a GGUF file is already quantized "
        "in its own types; on cuda:0 this model runs with quantization=None (its blocks kept "
        "where a kernel takes them), 'dequantize', 'gguf'")


def test_without_triton_gguf_files_dequantize_on_cuda(gguf_path, no_triton):
    assert resolve_quantization(None, gguf_path, "cuda") == "dequantize"
    assert resolve_quantization(None, gguf_path, "cpu") == "gguf"
    assert config_error(resolve_quantization, "gguf", gguf_path, "cuda:0") == (
        f"quantization='gguf' on {gguf_path} (device cuda:0): kept GGUF blocks run on CPUs, "
        "and on CUDA GPUs through fusegen's Triton kernel, and Triton is not installed here; "
        "on cuda:0 this model runs with quantization=None, 'dequantize'")


def test_layer_bytes_and_refusals_follow_the_devices_types(gguf_path, monkeypatch):
    cfg = read_model_config(gguf_path)
    options = EngineOptions(quantization="gguf")
    on_cpu = compressed_layer_bytes(gguf_path, cfg, torch.float32, "gguf", options, "cpu")
    assert compressed_layer_bytes(gguf_path, cfg, torch.float32, "gguf", options,
                                  "cuda") == on_cpu
    # a type the Triton kernel does not decode: explicitly asked, refused by name on GPUs;
    # left out, those linears count (and load) dense there
    monkeypatch.setattr(quantized, "TRITON_GGUF_TYPES", ALL_EIGHT - {Q.Q4_1})
    assert config_error(compressed_layer_bytes, gguf_path, cfg, torch.float32, "gguf", options,
                        "cuda:0") == (
        f"quantization='gguf' on {gguf_path} (device cuda:0): tensor 'blk.0.attn_q.weight' is "
        "Q4_1, which no kernel on cuda:0 multiplies as blocks (kept: Q4_0, Q5_0, Q5_1, Q8_0, "
        "Q4_K, Q5_K, Q6_K); leave quantization out to keep the blocks it can and dequantize "
        "the rest, or pass quantization='dequantize'")
    dense = compressed_layer_bytes(gguf_path, cfg, torch.float32, "gguf", EngineOptions(),
                                   "cuda")
    arch = get_architecture(cfg.architecture)
    assert dense == [arch.layer_numel(cfg) * 4] * cfg.num_layers
    sources = arch.layer_sources(checkpoint_tensors(gguf_path, cfg, torch.float32, "gguf"),
                                 0, cfg)
    assert split_kept(sources, "cuda")[0] == {}
    assert sorted(split_kept(sources, "cpu")[0]) == ["down.weight", "gate_up.weight",
                                                      "o.weight", "qkv.weight"]


@pytest.fixture
def triton_linear(monkeypatch):
    """GGUFLinear's CUDA path on CPU tensors: `on_triton` says yes, and the launcher runs
    under the interpreter; every call's keyword arguments are recorded."""
    calls = []
    launcher = interpreted(tq.gguf_linear_triton)

    def gguf_linear_triton(*args, **kwargs):
        calls.append(kwargs)
        return launcher(*args, **kwargs)

    monkeypatch.setattr(quantized, "on_triton", lambda x, qtype: True)
    monkeypatch.setattr(quantized, "_triton",
                        lambda: SimpleNamespace(gguf_linear_triton=gguf_linear_triton))
    return calls


def _module(qtype, out_features, in_features, seed=0) -> GGUFLinear:
    linear = Linear(bias=True)
    linear.set_weight("bias", torch.randn(out_features,
                                          generator=torch.Generator().manual_seed(seed)))
    return GGUFLinear.from_blocks(linear, make_blocks(qtype, out_features, in_features, seed),
                                  qtype, in_features)


def test_real_dispatch_on_a_cpu_tensor():
    assert not quantized.on_triton(torch.zeros(1, 64), Q.Q8_0)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda q: ql.SUPPORTED[q])
def test_forward_through_the_triton_kernel(qtype, triton_linear):
    module = _module(qtype, 48, 256)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    got = module(x)
    want = tq.gguf_linear_reference(x, module.blocks, qtype, 48, 256) + module.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert triton_linear == [{"batch_invariant": False}]
    xb = x.bfloat16()
    module.bias = module.bias.bfloat16()
    want = tq.gguf_linear_reference(xb, module.blocks, qtype, 48, 256) + module.bias
    torch.testing.assert_close(module(xb), want, rtol=2 ** -7, atol=2 ** -7)


def test_deterministic_forward_is_batch_invariant(triton_linear):
    # row_tile set (deterministic mode): the kernel's batch-invariant tiles, one call
    # whatever the row count (no row tiling), a row's bits the same alone and batched
    module = _module(Q.Q4_0, 48, 256, seed=3)
    module.row_tile = ROW_TILE
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    module.bias = module.bias.bfloat16()
    batched = module(x)
    for i in (0, 33, 69):
        assert torch.equal(module(x[i:i + 1])[0], batched[i])
    assert triton_linear == [{"batch_invariant": True}] * 4
    want = tq.gguf_linear_reference(x, module.blocks, Q.Q4_0, 48, 256) + module.bias
    torch.testing.assert_close(batched, want, rtol=2 ** -7, atol=2 ** -7)


ENGINE = """
import json, sys
from fusegen.kernels.testing import backport_interpreter_fixes
backport_interpreter_fixes()
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.weights.quantized import GGUFLinear
prompts = [[5, 9, 100, 7, 42, 17, 3], [300], list(range(30, 50))]
out = {}
for quantization in ("gguf", "dequantize"):
    with LLM(sys.argv[1], dtype="float32", quantization=quantization, deterministic=True,
             max_model_len=64, num_kv_blocks=32, max_num_seqs=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
        kept = sum(isinstance(m, GGUFLinear) for m in llm.engine.runner.model.modules())
        out[quantization] = [[o.token_ids for o in outs], kept]
print(json.dumps(out))
"""


def test_engine_keeps_blocks_through_the_triton_kernel(gguf_path):
    """The GPU path of a whole GGUF run on CPU tensors: FUSEGEN_KERNELS=triton and Triton's
    interpreter (a child process), deterministic mode; every layer linear a GGUFLinear
    multiplying through gguf_linear_triton; greedy fp32 tokens those of the file
    dequantized at load."""
    out = run_interpreted(ENGINE, str(gguf_path))
    # two layers' qkv, o, gate_up and down, and the LM head
    assert out["gguf"][1] == 2 * 4 + 1 and out["dequantize"][1] == 0
    assert out["gguf"][0] == out["dequantize"][0]
