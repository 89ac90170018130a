"""The embedding and LM head kept as a GGUF file's blocks (engine/weights/quantized_fixed.py):
greedy fp32 tokens equal the file dequantized on load, tied and untied; the lookup
expands exactly the dequantized table's rows; the memory report counts the blocks once;
a type without a kernel stays dense."""
import pytest
import torch

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from quant_helpers import generate_tokens, kept_like_dequantized, make_blocks
from fusegen.engine import SamplingParams
from fusegen.engine.config import PlanInputs
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights.gguf import GGUFFile
from fusegen.engine.weights.quantized_fixed import GGUFEmbedding, GGUFHead
from fusegen.kernels import native
from fusegen.kernels import quant_linear as ql

needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler here")
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10"]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=8)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_dir(request, tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", "bpe", seed=7,
                              num_hidden_layers=2, max_position_embeddings=128,
                              tie_word_embeddings=request.param)


def _generate(path, **options):
    return generate_tokens(path, PROMPTS, PARAMS, **OPTIONS, **options)[:3]


@needs_library
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("deterministic", [False, True], ids=["fast", "deterministic"])
def test_kept_head_generates_like_dequantized(hf_dir, tmp_path, qtype, deterministic):
    path = write_gguf(hf_dir, tmp_path / "tiny.gguf", qtype=qtype)
    _, kept, report = kept_like_dequantized(_generate, path, deterministic=deterministic)
    model, cfg = kept.model, kept.config.model_config
    assert type(model.lm_head) is GGUFHead and model.lm_head.qtype == qtype
    assert isinstance(model.embed_blocks, GGUFEmbedding) and model.embed.numel() == 0
    file = GGUFFile.open(path)
    embed_bytes = file.tensors["token_embd.weight"].nbytes
    assert model.embed_blocks.nbytes == embed_bytes
    if cfg.tie_word_embeddings:  # one copy of the blocks serves both
        assert model.lm_head.blocks.data_ptr() == model.embed_blocks.blocks.data_ptr()
        head_bytes = 0
    else:
        head_bytes = file.tensors["output.weight"].nbytes
        assert model.lm_head.nbytes == head_bytes
    assert model.fixed_nbytes == embed_bytes + head_bytes + cfg.hidden_size * 4  # fp32 norm
    layers = sum(t.nbytes for layer in model.layers for t in
                 (layer.qkv, layer.o, layer.gate_up, layer.down)) \
        + len(model.layers) * 2 * cfg.hidden_size * 4
    assert report["device"]["weights"] == model.fixed_nbytes + layers
    # the plan counts the same bytes before anything loads: the blocks, no packed head
    inputs = PlanInputs.gather(str(path), EngineOptions(quantization="gguf", **OPTIONS))
    assert inputs.shape.fixed_bytes == model.fixed_nbytes
    dense = PlanInputs.gather(str(path), EngineOptions(quantization="dequantize", **OPTIONS))
    assert dense.shape.fixed_bytes is None


@needs_library
def test_embedding_type_without_kernel_stays_dense(tmp_path):
    # token_embd in F16 (no blocks): the lookup and the tied head stay dense
    hf_dir = make_hf_checkpoint(tmp_path / "hf", "llama", "bpe", seed=7, num_hidden_layers=1,
                                max_position_embeddings=128, tie_word_embeddings=True)
    path = write_gguf(hf_dir, tmp_path / "f16.gguf", qtype=Q.Q8_0,
                      types={"token_embd": Q.F16})
    _, kept, _ = kept_like_dequantized(_generate, path)
    assert kept.model.embed_blocks is None and kept.model.embed.numel() > 0
    assert not isinstance(kept.model.lm_head, GGUFHead)


@pytest.mark.parametrize("qtype", sorted(ql.SUPPORTED), ids=lambda q: ql.SUPPORTED[q])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lookup_expands_the_table_rows(qtype, dtype):

    block = ql.BLOCK_SIZES[qtype][0]
    blocks = make_blocks(qtype, 37, 2 * block, seed=3)
    table = ql.dequantize_rows(blocks, qtype, 2 * block)  # gguf's dequantize, fp32
    embedding = GGUFEmbedding(blocks, qtype, 2 * block, dtype)
    ids = torch.tensor([[0, 36, 5], [5, 5, 17]])
    got = embedding(ids)
    assert got.shape == (2, 3, 2 * block) and got.dtype == dtype
    want = table[ids].to(dtype)
    if qtype == ql.Q8_0:  # d q: one rounding whichever way it is computed
        assert torch.equal(got, want)
    else:  # d q + m may be one fused rounding: within an fp32 ulp of the value's scale
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -7 if dtype ==
                              torch.bfloat16 else 1e-6, atol=1e-6)
    assert embedding(torch.tensor([], dtype=torch.int64)).shape == (0, 2 * block)


def test_lookup_out_of_range_names_the_limit():

    embedding = GGUFEmbedding(make_blocks(ql.Q8_0, 10, 32), ql.Q8_0, 32, torch.float32)
    with pytest.raises(IndexError, match="token id 10 is outside the embedding's 10 rows"):
        embedding(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match=r"10 x 64 weight are uint8 \[10, 68\]"):
        GGUFEmbedding(make_blocks(ql.Q8_0, 10, 32), ql.Q8_0, 64, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_argmax_is_the_products(dtype):
    from fusegen.engine.weights.linear import Linear

    blocks = make_blocks(ql.Q6_K, 300, 256, seed=5)
    head = GGUFHead.from_blocks(Linear(), blocks, ql.Q6_K, 256)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits = head(x)
    assert logits.shape == (7, 300) and logits.dtype == dtype
    assert torch.equal(head.argmax(x), logits.float().argmax(dim=-1))
