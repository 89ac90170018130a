"""quantization="gguf": a GGUF file's decoder linears kept as their blocks (`GGUFLinear`,
engine/weights/quantized.py) generate, greedy in fp32, the tokens the same file gives
dequantized on load; the memory report and the placement plan count the blocks' bytes;
the option is refused, before anything loads, where it cannot run."""
import numpy as np
import pytest
import torch

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, gemma3_path, smollm2_path, write_gguf
from quant_helpers import generate_tokens, kept_like_dequantized
from fusegen.engine import LLM, EngineConfigError, SamplingParams
from fusegen.engine.config import EngineConfig
from fusegen.engine.memory.placement import format_bytes, minimum_device_budget
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights.gguf import GGUFFile
from fusegen.engine.weights.gguf_names import value_transform
from fusegen.engine.weights.linear import ROW_TILE, Linear
from fusegen.engine.weights.quantized import GGUFLinear, kept_as_blocks
from fusegen.kernels.quant_linear import quant_linear_reference

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "日本語 🎉 text",
           " leading spaces\nand a newline", "1 2 3 4 5 6 7 8 9 10"]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=8)
# a llama layer's parameters and the GGUF tensors stacked into each
LLAMA_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
               "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", "bpe", seed=3,
                              num_hidden_layers=3, max_position_embeddings=128)


def _generate(path, **options):
    tokens, runner, report, stats = generate_tokens(path, PROMPTS, PARAMS, **OPTIONS, **options)
    assert stats["num_steps"] == PARAMS.max_tokens  # the prompts fused in one batch
    return tokens, runner, report


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_llama_kept_generates_like_dequantized(llama_dir, tmp_path, qtype, deterministic):
    path = write_gguf(llama_dir, tmp_path / "tiny.gguf", qtype=qtype)
    dense, kept, _ = kept_like_dequantized(_generate, path, deterministic=deterministic)
    for layer in kept.model.layers:
        assert all(type(getattr(layer, name)) is GGUFLinear for name in LLAMA_PARTS)
        assert layer.qkv.row_tile == (ROW_TILE if deterministic else None)
    assert isinstance(kept.model.lm_head, GGUFLinear)  # the head too (weights/quantized_fixed.py)
    assert not any(isinstance(m, GGUFLinear) for m in dense.model.modules())


@pytest.mark.parametrize("arch, tokenizer, qtype", [("qwen2", "bpe", Q.Q4_0),
                                                    ("gemma3", "sentencepiece", Q.Q8_0)],
                         ids=["qwen2-Q4_0", "gemma3-Q8_0"])
def test_other_architectures_kept_generate_like_dequantized(arch, tokenizer, qtype, tmp_path):
    # Qwen2: q/k/v biases stay dense beside the kept blocks; Gemma 3: norms stored as
    # 1 + w (a value transform: they stay dense), no q/k row permutation.
    hf_dir = make_hf_checkpoint(tmp_path / "hf", arch, tokenizer, seed=5)
    path = write_gguf(hf_dir, tmp_path / f"{arch}.gguf", qtype=qtype, arch=arch,
                      tokenizer="gpt2" if tokenizer == "bpe" else "llama")
    _, kept, _ = kept_like_dequantized(_generate, path)
    qkv = kept.model.layers[0].qkv
    assert type(qkv) is GGUFLinear and (qkv.bias is not None) == (arch == "qwen2")


def test_block_rows_are_the_files(llama_dir, tmp_path):
    # o and down hold the file's bytes as they are; q and k their rows un-permuted for
    # Hugging Face's rotary layout (whole rows moved), then v, stacked along the output.
    path = write_gguf(llama_dir, tmp_path / "tiny.gguf", qtype=Q.Q4_1)
    file = GGUFFile.open(path)
    with LLM(str(path), quantization="gguf", **OPTIONS) as llm:
        layer = llm.engine.runner.model.layers[1]
        cfg = llm.engine.runner.config.model_config

        def blocks(name):
            return file.blocks(file.tensors[f"blk.1.{name}.weight"])

        assert torch.equal(layer.o.blocks, blocks("attn_output"))
        assert torch.equal(layer.down.blocks, blocks("ffn_down"))
        assert torch.equal(layer.gate_up.blocks, torch.cat([blocks("ffn_gate"), blocks("ffn_up")]))
        assert torch.equal(layer.qkv.blocks[-cfg.num_kv_heads * cfg.head_dim:], blocks("attn_v"))
        q = layer.qkv.blocks[:cfg.num_heads * cfg.head_dim]
        assert not torch.equal(q, blocks("attn_q"))  # permuted in the file
        assert sorted(map(bytes, q.numpy())) == sorted(map(bytes, blocks("attn_q").numpy()))
        # the kept q rows expand to exactly the rows the dequantizing reader gives
        dense = file.read(file.tensors["blk.1.attn_q.weight"], torch.float32,
                          value_transform("llama", "blk.1.attn_q.weight", cfg.num_heads,
                                          cfg.num_kv_heads))
        x = torch.eye(cfg.hidden_size)
        assert torch.equal(quant_linear_reference(x, q, Q.Q4_1, q.shape[0], cfg.hidden_size),
                           dense.T.contiguous())


def test_resident_bytes_are_the_blocks(llama_dir, tmp_path):
    # Each kept layer: its linears' block bytes (exactly the file's tensors') and its
    # norms dense; the plan's layer size is that, and the memory report's weights are the
    # fixed tensors plus those layers.
    path = write_gguf(llama_dir, tmp_path / "tiny.gguf", qtype=Q.Q4_0)
    file = GGUFFile.open(path)
    _, dense, dense_report = _generate(path, quantization="dequantize")
    _, kept, report = _generate(path, quantization="gguf")
    hidden = kept.config.model_config.hidden_size
    for i, layer in enumerate(kept.model.layers):
        for param, names in LLAMA_PARTS.items():
            linear = getattr(layer, param)
            file_bytes = sum(file.tensors[f"blk.{i}.{n}.weight"].nbytes for n in names)
            assert linear.nbytes == linear.blocks.numel() == file_bytes
    layer_bytes = sum(getattr(kept.model.layers[0], p).nbytes for p in LLAMA_PARTS) \
        + 2 * hidden * 4  # two fp32 norms
    assert kept.plan.sizes.layer_bytes == layer_bytes
    fixed = kept.model.fixed_nbytes  # the embedding's blocks, the tied head counted once
    num_layers = len(kept.model.layers)
    assert report["device"]["weights"] == fixed + num_layers * layer_bytes
    assert kept.plan.device_bytes["weights"] == kept.plan.sizes.fixed_bytes \
        + num_layers * layer_bytes
    # dequantized: 4 bytes a value; Q4_0 keeps 18 bytes a 32 values
    assert dense.plan.sizes.layer_bytes > 7 * (layer_bytes - 2 * hidden * 4)
    assert report["device"]["weights"] < dense_report["device"]["weights"]
    assert f"layer {format_bytes(layer_bytes)}, " in kept.plan.table()


def test_mixed_types_keep_what_the_kernel_takes(llama_dir, tmp_path):
    # q in Q8_0 beside k, v in Q4_0: qkv's parts differ, so it is dequantized; down in
    # F16 (no blocks) likewise; o and gate_up keep theirs. Same tokens either way.
    path = write_gguf(llama_dir, tmp_path / "mixed.gguf", qtype=Q.Q4_0,
                      types={"attn_q": Q.Q8_0, "ffn_down": Q.F16})
    _, kept, _ = kept_like_dequantized(_generate, path)
    layer = kept.model.layers[0]
    assert [type(getattr(layer, p)) is GGUFLinear for p in LLAMA_PARTS] == \
        [False, True, True, False]
    assert isinstance(layer.qkv, Linear) and isinstance(layer.down, Linear)
    cfg = kept.config.model_config
    qkv_values = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * cfg.hidden_size
    down_values = cfg.hidden_size * cfg.intermediate_size
    norm_values = 2 * cfg.hidden_size
    assert kept.plan.sizes.layer_bytes == layer.o.nbytes + layer.gate_up.nbytes \
        + (qkv_values + down_values + norm_values) * 4


def test_kept_as_blocks_policy():
    shape = (64, 64)
    assert kept_as_blocks("qkv.weight", [(Q.Q4_1, shape)] * 3)
    assert not kept_as_blocks("qkv.weight", [(Q.Q4_1, shape), (Q.Q8_0, shape)])
    assert not kept_as_blocks("qkv.bias", [(Q.Q4_1, shape)])
    assert not kept_as_blocks("input_norm", [(Q.Q4_1, (64,))])
    assert not kept_as_blocks("down.weight", [(Q.F16, shape)])
    assert not kept_as_blocks("down.weight", [(Q.Q2_K, (64, 256))])  # no kernel for it


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_rows_do_not_depend_on_the_batch(qtype, dtype, kernels, monkeypatch):
    # The C kernel sums each row in one order whatever the call (so GGUFLinear calls it
    # as it is); the reference GEMM orders its sums by the call's shape, so in
    # deterministic mode its calls are ROW_TILE rows. Either way a row is bit-identical
    # alone or among 64 (or 100) rows.
    monkeypatch.setenv("FUSEGEN_KERNELS", kernels)
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(1)
    out_features, in_features = 96, 256
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(weight, qtype))
    linear = Linear(bias=True)
    linear.row_tile = ROW_TILE
    kept = GGUFLinear.from_blocks(linear, blocks, qtype, in_features)
    kept.set_weight("bias", torch.randn(out_features, generator=torch.Generator().manual_seed(0))
                    .to(dtype))
    x = torch.randn(100, in_features, generator=torch.Generator().manual_seed(2)).to(dtype)
    together = {n: kept(x[:n]) for n in (64, 100)}
    for row in (0, 17, 63):
        alone = kept(x[row:row + 1])
        assert torch.equal(alone[0], together[64][row]) and torch.equal(alone[0],
                                                                         together[100][row])
    assert torch.equal(together[64], together[100][:64])
    want = quant_linear_reference(x.float(), blocks, qtype, out_features, in_features) \
        + kept.bias.float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(together[100].float(), want, rtol=tol, atol=tol * 8)
    assert kept.nbytes == blocks.numel() + out_features * dtype.itemsize
    with pytest.raises(ValueError, match="GGUFLinear holds blocks and bias; it has no 'weight'"):
        kept.set_weight("weight", torch.zeros(1))


def test_jobs_take_the_option_and_keep_old_fingerprints():
    from fusegen.jobs.errors import JobError
    from fusegen.jobs.flags import engine_flags
    from fusegen.jobs.spec import JobSpec

    def spec(**kw):
        return JobSpec(model="/m", input="in.parquet", output="out", **kw)

    assert "quantization" not in spec().output_config()  # old jobs' fingerprints hold
    assert spec(quantization="gguf").output_config()["quantization"] == "gguf"
    assert spec(quantization="gguf").engine_kwargs()["quantization"] == "gguf"  # to LLM(...)
    assert spec(quantization="dequantize").output_config()["quantization"] == "dequantize"
    with pytest.raises(JobError, match="quantization='awq': fusegen does not run"):
        spec(quantization="awq")
    assert len(engine_flags(("quantization",))) == 1  # --quantization on `fusegen run`


def test_smollm2_q4_1_kept_generates_like_dequantized():
    # The real file (Q4_1 linears, Q8_0 embedding): 4 chat prompts x 32 tokens, fused.
    path = smollm2_path()
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three colours, one per line.", "Explain in one sentence why the sky "
                 "is blue."]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results = {}
    for quantization in ("dequantize", "gguf"):
        with LLM(str(path), quantization=quantization, dtype="float32", max_model_len=256,
                 num_kv_blocks=64, max_num_seqs=8) as llm:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
                       for q in questions]
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[quantization] = ([o.token_ids for o in outs],
                                     llm.memory_report()["device"]["weights"],
                                     llm.engine.runner.plan.sizes.layer_bytes)
    (want, dense_bytes, dense_layer), (got, kept_bytes, kept_layer) = results.values()
    print(f"SmolLM2 Q4_1 resident weights: dequantized fp32 {dense_bytes} B "
          f"({dense_layer} B a layer), kept {kept_bytes} B ({kept_layer} B a layer)")
    assert got == want
    assert kept_layer * 6 < dense_layer  # Q4_1: 20 bytes a 32 values against 128


def test_gemma3_q4_k_m_kept_generates_like_dequantized():
    # llama.cpp's Q4_K_M mix: Q4_K, Q5_0, Q6_K and Q8_0 linears, their sizes differing
    # between layers (the plan takes the largest layer's: it reserves at least what loads).
    path = gemma3_path()
    prompts = [f"<bos><start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n"
               for q in ("What is the capital of France?", "Write a haiku about the sea.")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for quantization in ("dequantize", "gguf"):
        with LLM(str(path), quantization=quantization, dtype="float32", max_model_len=128,
                 num_kv_blocks=32, max_num_seqs=4) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runner = llm.engine.runner
            results[quantization] = [o.token_ids for o in outs]
            resident = llm.memory_report()["device"]["weights"]
    assert results["gguf"] == results["dequantize"]
    kinds = {layer.down.qtype for layer in runner.model.layers}
    assert len(kinds) > 1  # the mix kept as it is: no layer requantized
    assert runner.plan.device_bytes["weights"] >= resident
