"""GGUF blocks repacked for the int8 product (kernels/quant_vnni.py's pack_blocks,
csrc/quant_vnni.c's quant_gguf_q8_packed_bf16): groups of 16 rows interleaved field by
field, the same bytes; the C repacking is the torch reference's layout and undoes
exactly; the product over the repacked blocks has the stored blocks' bits for every
type, odd row counts (a last group of fewer than 16 rows stays as stored), every
micro-kernel row count and thread count; a resident GGUFLinear repacks at its first bf16
call and unpacks for good at a call another kernel serves; an engine in bf16 generates
the same tokens with its blocks repacked as without."""
import pytest
import torch

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from quant_helpers import generate_tokens, make_blocks
from fusegen.engine import SamplingParams
from fusegen.engine.weights import quantized
from fusegen.engine.weights.linear import Linear
from fusegen.engine.weights.quantized import GGUFLinear
from fusegen.kernels import quant_linear as ql
from fusegen.kernels import quant_vnni as qv

QTYPES = sorted(ql.SUPPORTED)
needs_packed = pytest.mark.skipif(not qv.q8_packed_available(ql.Q4_1),
                                  reason="no AVX512_VNNI or AVX2 build on this machine")


def bf16_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()


def product(x, blocks, qtype, n, k, threads, packed):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return qv.quant_linear_q8_native(x, blocks, qtype, n, k, packed=packed)
    finally:
        torch.set_num_threads(saved)


@needs_packed
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_repacking_is_the_references_and_undoes(qtype):
    block = ql.BLOCK_SIZES[qtype][0]
    for n, nb in [(5, 1), (16, 2), (37, 3), (48, 1)]:
        blocks = make_blocks(qtype, n, nb * block, seed=n)
        packed = blocks.clone()
        qv.pack_blocks(packed, qtype, nb * block)
        assert torch.equal(packed, qv.pack_blocks_reference(blocks, qtype))
        assert torch.equal(packed[n // 16 * 16:], blocks[n // 16 * 16:])  # the tail as stored
        if n >= 16:
            assert not torch.equal(packed, blocks)
            # a group's first block starts with its 16 rows' fp16 d side by side
            first = 208 if qtype == ql.Q6_K else 0
            group = packed[:16].reshape(-1)  # a group's bytes are one run
            assert torch.equal(group[16 * first:16 * first + 32].view(torch.int16),
                               blocks[:16, first:first + 2].contiguous().view(torch.int16)[:, 0])
        qv.unpack_blocks(packed, qtype, nb * block)
        assert torch.equal(packed, blocks)


@needs_packed
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_product_over_repacked_blocks_has_the_stored_blocks_bits(qtype):
    """n = 5 (no whole group), 16, 37 (two groups and a tail), 48; one block and several;
    every row-count form of the micro-kernel; 1 and 2 threads."""
    block = ql.BLOCK_SIZES[qtype][0]
    x = bf16_rows(300, 4 * block, seed=qtype)
    x[3] = 0
    for n, nb in [(5, 1), (16, 4), (37, 3), (48, 2)]:
        k = nb * block
        blocks = make_blocks(qtype, n, k, seed=n + nb)
        packed = blocks.clone()
        qv.pack_blocks(packed, qtype, k)
        xk = x[:, :k].contiguous()
        for rows in (1, 2, 3, 4, 5, 9, 17, 64, 300):
            for threads in (1, 2):
                want = product(xk[:rows], blocks, qtype, n, k, threads, packed=False)
                got = product(xk[:rows], packed, qtype, n, k, threads, packed=True)
                assert torch.equal(got, want), (n, rows, threads)
    assert qv.quant_linear_q8_native(x[:0, :k], packed, qtype, n, k, packed=True).shape == (0, n)


def test_repacking_refuses_bad_blocks():
    blocks = make_blocks(ql.Q4_1, 32, 64)
    with pytest.raises(ValueError, match=r"uint8 \[32, 40\]; got torch.uint8 \[32, 20\]"):
        qv.pack_blocks(blocks[:, :20].contiguous(), ql.Q4_1, 64)
    with pytest.raises(ValueError, match="contiguous: False"):
        qv.pack_blocks(make_blocks(ql.Q4_1, 32, 128)[:, :40], ql.Q4_1, 64)
    with pytest.raises(ValueError, match="GGUF quantization type 10 has no quant_linear"):
        qv.pack_blocks(blocks, 10, 64)


def _kept(qtype, out_features=40, in_features=256, seed=1):
    blocks = make_blocks(qtype, out_features, in_features, seed=seed)
    linear = Linear(bias=True)
    kept = GGUFLinear.from_blocks(linear, blocks.clone(), qtype, in_features)
    kept.set_weight("bias", torch.randn(out_features, generator=torch.Generator().manual_seed(0))
                    .bfloat16())
    return kept, blocks


@needs_packed
@pytest.mark.parametrize("qtype", [ql.Q4_1, ql.Q8_0, ql.Q6_K], ids=lambda q: ql.SUPPORTED[q])
def test_resident_linear_repacks_at_its_first_bf16_call(qtype):
    kept, blocks = _kept(qtype)
    stored, _ = _kept(qtype)  # never repacked (not resident)
    x = bf16_rows(7, 256, seed=3)
    kept.may_repack = True
    first = kept(x)
    assert kept.packed and not kept.may_repack
    assert not torch.equal(kept.blocks, blocks) and kept.nbytes == stored.nbytes
    assert torch.equal(first, stored(x)) and not stored.packed
    for rows in (1, 16, 64):  # 3-D x too
        assert torch.equal(kept(x[:rows % 7 + 1, None]), stored(x[:rows % 7 + 1, None]))
    assert kept(x[:0]).shape == (0, 40)
    # an fp32 call: the blocks as stored again, for good; the exact kernel's numbers
    xf = x.float()
    assert torch.equal(kept(xf), stored(xf))
    assert not kept.packed and torch.equal(kept.blocks, blocks)
    assert torch.equal(kept(x), first) and not kept.packed
    # a new tensor (a staging slot's) is taken as stored
    kept.may_repack = True
    kept.set_weight("blocks", blocks.clone())
    assert not kept.may_repack and not kept.packed


@needs_packed
def test_repacked_rows_do_not_depend_on_the_batch():
    """Deterministic mode (a row tile set): the repacked product serves every row count,
    and a row alone has the bits it has among 64 or 100."""
    kept, _ = _kept(ql.Q4_K, out_features=48, in_features=512)
    kept.row_tile = 64
    kept.may_repack = True
    x = bf16_rows(100, 512, seed=5)
    together = {n: kept(x[:n]) for n in (64, 100)}
    assert kept.packed
    for row in (0, 17, 63, 99):
        alone = kept(x[row:row + 1])[0]
        assert torch.equal(alone, together[100][row])
        if row < 64:
            assert torch.equal(alone, together[64][row])


@needs_packed
def test_reference_mode_unpacks(monkeypatch):
    kept, blocks = _kept(ql.Q4_1)
    kept.may_repack = True
    x = bf16_rows(5, 256, seed=4)
    kept(x)
    assert kept.packed
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    got = kept(x)
    assert not kept.packed and torch.equal(kept.blocks, blocks)
    want = ql.quant_linear_reference(x, blocks, ql.Q4_1, 40, 256) + kept.bias
    assert torch.equal(got, want)


@needs_packed
def test_engine_generates_the_same_tokens_repacked(tmp_path, monkeypatch):
    """bf16, blocks kept: every resident linear repacked (the same bytes resident), the
    same tokens as the same run with repacking off."""
    hf_dir = make_hf_checkpoint(tmp_path / "hf", "llama", "bpe", seed=3, num_hidden_layers=2,
                                hidden_size=128, intermediate_size=256,
                                max_position_embeddings=128)
    path = write_gguf(hf_dir, tmp_path / "tiny.gguf", qtype=Q.Q4_1)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    options = dict(dtype="bfloat16", max_model_len=64, num_kv_blocks=32, max_num_seqs=4,
                   quantization="gguf")
    tokens, runner, report, _ = generate_tokens(path, prompts, params, **options)
    # the decoder layers' linears (the head shares its blocks with the embedding's rows)
    linears = [m for m in runner.model.modules() if type(m) is GGUFLinear]
    assert len(linears) == 8 and all(m.packed for m in linears)
    monkeypatch.setattr(quantized, "q8_packed_available", lambda qtype: False)
    tokens_stored, runner_stored, report_stored, _ = generate_tokens(path, prompts, params,
                                                                     **options)
    assert not any(m.packed for m in runner_stored.model.modules() if type(m) is GGUFLinear)
    assert tokens == tokens_stored
    assert report["device"]["weights"] == report_stored["device"]["weights"]
