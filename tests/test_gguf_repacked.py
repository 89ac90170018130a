"""GGUF blocks repacked for the int8 product (kernels/quant_vnni.py's pack_blocks,
csrc/quant_vnni.c's quant_gguf_q8_packed_bf16): groups of 16 rows interleaved field by
field, the same bytes; the C repacking is the torch reference's layout and undoes
exactly; the product over the repacked blocks has the stored blocks' bits for every
type, odd row counts (a last group of fewer than 16 rows stays as stored), every
micro-kernel row count and thread count, calls of several tiles of rows (each row's bits
its own); a resident GGUFLinear repacks at its first bf16 call and unpacks for good at a
call another kernel serves; the head tied to the embedding repacks the shared table and
the lookup reads the stored rows back from it; an engine in bf16 generates the same
tokens with its blocks (the head's included) repacked as without."""
import pytest
import torch

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from quant_helpers import OTHER_CPU_BUILDS, build_for_other_cpu, generate_tokens, make_blocks
from fusegen.engine import SamplingParams
from fusegen.engine.weights import quantized
from fusegen.engine.weights.linear import Linear
from fusegen.engine.weights.quantized import GGUFLinear
from fusegen.engine.weights.quantized_fixed import GGUFEmbedding, GGUFHead
from fusegen.kernels import native
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
        for rows in (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 64, 300):
            for threads in (1, 2):
                want = product(xk[:rows], blocks, qtype, n, k, threads, packed=False)
                got = product(xk[:rows], packed, qtype, n, k, threads, packed=True)
                assert torch.equal(got, want), (n, rows, threads)
    assert qv.quant_linear_q8_native(x[:0, :k], packed, qtype, n, k, packed=True).shape == (0, n)


@needs_packed
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_rows_across_tiles_are_each_rows_own(qtype):
    """Wide rows (k = 8,192: a tile of rows is a few dozen) in calls of several tiles:
    each row has the bits it has alone, over the blocks as stored and repacked, at 1 and
    2 threads."""
    block = ql.BLOCK_SIZES[qtype][0]
    n, k = 37, 8192
    blocks = make_blocks(qtype, n, k, seed=7)
    packed = blocks.clone()
    qv.pack_blocks(packed, qtype, k)
    x = bf16_rows(150, k, seed=qtype + block)
    alone = torch.cat([product(x[r:r + 1], blocks, qtype, n, k, 1, packed=False)
                       for r in range(0, 150, 7)])
    for threads in (1, 2):
        for w, is_packed in ((blocks, False), (packed, True)):
            got = product(x, w, qtype, n, k, threads, packed=is_packed)
            assert torch.equal(got[::7], alone), (threads, is_packed)
            assert torch.equal(product(x[:49], w, qtype, n, k, threads, packed=is_packed),
                               got[:49])


@needs_packed
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_rows_of_repacked_blocks_are_the_stored_rows(qtype):
    """packed_rows: every row of whole groups and of the tail, repeated and in any order,
    as stored; no ids, no rows; an id outside the blocks is an error naming it."""
    block, row_bytes = ql.BLOCK_SIZES[qtype][0], 2 * ql.BLOCK_SIZES[qtype][1]
    for n in (5, 16, 37, 48):
        blocks = make_blocks(qtype, n, 2 * block, seed=n)
        packed = blocks.clone()
        qv.pack_blocks(packed, qtype, 2 * block)
        ids = torch.cat([torch.arange(n).flip(0), torch.tensor([0, n - 1, 0])])
        assert torch.equal(qv.packed_rows(packed, qtype, 2 * block, ids), blocks[ids])
        assert torch.equal(qv.packed_rows(packed, qtype, 2 * block, ids.reshape(-1, 1)),
                           blocks[ids])
        assert qv.packed_rows(packed, qtype, 2 * block, ids[:0]).shape == (0, row_bytes)
        for bad in (n, -1):
            with pytest.raises(IndexError, match=f"row {bad} is outside the {n} rows"):
                qv.packed_rows(packed, qtype, 2 * block, torch.tensor([0, bad]))


@needs_packed
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_tied_head_repacks_and_the_embedding_reads_the_same_rows(qtype):
    """A 40-row table (two groups of 16 and a tail of 8) tied to its head: the head
    repacks the one copy at its first bf16 call and multiplies as the stored head does;
    the lookup's rows are the stored table's before, while and after it is repacked (an
    fp32 product unpacks it for good)."""
    block = ql.BLOCK_SIZES[qtype][0]
    vocab, dim = 40, 2 * block
    blocks = make_blocks(qtype, vocab, dim, seed=2)
    stored = GGUFEmbedding(blocks.clone(), qtype, dim, torch.bfloat16)
    stored_head = GGUFHead.from_blocks(Linear(), blocks.clone(), qtype, dim)
    embedding = GGUFEmbedding(blocks.clone(), qtype, dim, torch.bfloat16)
    head = embedding.tied_head(Linear())
    assert head.blocks.data_ptr() == embedding.blocks.data_ptr() and head.may_repack
    ids = torch.tensor([[0, 17, 39], [15, 16, 32]])
    assert torch.equal(embedding(ids), stored(ids))
    x = bf16_rows(16, dim, seed=1)
    assert torch.equal(head(x), stored_head(x)) and head.packed
    assert not torch.equal(embedding.blocks, blocks)  # repacked in place: one copy
    for rows in (ids, torch.arange(vocab), torch.tensor([38]), ids[:0]):
        got = embedding(rows)
        assert torch.equal(got, stored(rows)) and got.shape == (*rows.shape, dim)
    assert torch.equal(head.argmax(x), stored_head.argmax(x))
    with pytest.raises(IndexError, match="token id 40 is outside the embedding's 40 rows"):
        embedding(torch.tensor([3, 40]))
    assert torch.equal(head(x.float()), stored_head(x.float()))
    assert not head.packed and torch.equal(embedding.blocks, blocks)
    assert torch.equal(embedding(ids), stored(ids))


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """quant_vnni.c built for an AVX2 CPU, where this CPU runs it"""
    if not {"avx2", "fma", "f16c"} <= set(native._cpu_flags().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    return build_for_other_cpu("quant_vnni.c", OTHER_CPU_BUILDS[1][0],
                               tmp_path_factory.mktemp("avx2"),
                               ("quant_gguf_q8_bf16", "quant_gguf_q8_packed_bf16",
                                "quant_gguf_q8_packed_rows"))


@pytest.mark.parametrize("qtype", [ql.Q4_1, ql.Q8_0, ql.Q5_K], ids=lambda q: ql.SUPPORTED[q])
def test_avx2_build_across_tiles_and_its_rows(qtype, avx2_build):
    """The AVX2 build: wide rows in calls of several tiles, each row's bits its own, stored
    and repacked alike (and this machine's build's where it has the int8 product); its
    lookup of repacked rows gives the stored rows."""
    n, k = 37, 8192
    blocks = make_blocks(qtype, n, k, seed=3)
    packed = blocks.clone()
    qv.pack_blocks(packed, qtype, k)
    x = bf16_rows(90, k, seed=5)

    def call(w, rows, threads, is_packed):
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        fn = avx2_build.quant_gguf_q8_packed_bf16 if is_packed else avx2_build.quant_gguf_q8_bf16
        assert fn(qtype, rows.data_ptr(), rows.shape[0], rows.stride(0), w.data_ptr(), n, k,
                  out.data_ptr(), n, threads) == 0
        return out

    alone = torch.cat([call(blocks, x[r:r + 1], 1, False) for r in range(0, 90, 11)])
    for threads in (1, 2):
        for w, is_packed in ((blocks, False), (packed, True)):
            assert torch.equal(call(w, x, threads, is_packed)[::11], alone)
    if qv.q8_available(qtype):
        assert torch.equal(alone, product(x[::11], blocks, qtype, n, k, 1, packed=False))
    ids = torch.tensor([36, 0, 17, 31, 32, 5])
    rows = torch.empty(6, blocks.shape[1], dtype=torch.uint8)
    assert avx2_build.quant_gguf_q8_packed_rows(qtype, packed.data_ptr(), n, k, ids.data_ptr(),
                                                6, rows.data_ptr()) == 0
    assert torch.equal(rows, blocks[ids])


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
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_engine_generates_the_same_tokens_repacked(tmp_path, monkeypatch, tied):
    """bf16, blocks kept: every resident linear repacked, the head too (tied: the table
    the embedding looks its rows up in; the same bytes resident), the same tokens as the
    same run with repacking off."""
    hf_dir = make_hf_checkpoint(tmp_path / "hf", "llama", "bpe", seed=3, num_hidden_layers=2,
                                hidden_size=128, intermediate_size=256,
                                max_position_embeddings=128, tie_word_embeddings=tied)
    path = write_gguf(hf_dir, tmp_path / "tiny.gguf", qtype=Q.Q4_1)
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    options = dict(dtype="bfloat16", max_model_len=64, num_kv_blocks=32, max_num_seqs=4,
                   quantization="gguf")
    tokens, runner, report, _ = generate_tokens(path, prompts, params, **options)
    model = runner.model
    linears = [m for m in model.modules() if type(m) is GGUFLinear]  # the decoder layers'
    assert len(linears) == 8 and all(m.packed for m in linears)
    assert type(model.lm_head) is GGUFHead and model.lm_head.packed
    assert (model.lm_head.blocks.data_ptr() == model.embed_blocks.blocks.data_ptr()) == tied
    monkeypatch.setattr(quantized, "q8_packed_available", lambda qtype: False)
    tokens_stored, runner_stored, report_stored, _ = generate_tokens(path, prompts, params,
                                                                     **options)
    assert not any(m.packed for m in runner_stored.model.modules()
                   if isinstance(m, GGUFLinear))
    assert tokens == tokens_stored
    assert report["device"]["weights"] == report_stored["device"]["weights"]
