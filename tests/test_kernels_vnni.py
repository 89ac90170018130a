"""bf16 x against GGUF blocks by int8 products (kernels/quant_vnni.py,
kernels/csrc/quant_vnni.c): x's quantization is the reference's bit for bit; the kernel
equals the exact int8 product within its fp32 sums' rounding and one bf16 rounding, for
every type, odd shapes and row counts; each row's bits are its own whatever the batch
and the thread count; against dequantize-then-matmul it is within the activations'
int8 rounding; the dispatcher takes it for bf16 x only."""
import pytest
import torch

from fusegen.kernels import native
from fusegen.kernels import quant_linear as ql
from fusegen.kernels import quant_vnni as qv
from quant_helpers import OTHER_CPU_BUILDS, build_for_other_cpu, make_blocks

QTYPES = sorted(ql.SUPPORTED)
needs_vnni = pytest.mark.skipif(not qv.q8_available(ql.Q4_1),
                                reason="no AVX512_VNNI or AVX2 build on this machine")


def bf16_rows(rows: int, k: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def kernel(x, blocks, qtype, n, k, threads=2):
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return qv.quant_linear_q8_native(x, blocks, qtype, n, k)
    finally:
        torch.set_num_threads(saved)


def magnitudes(x, blocks, qtype, k):
    """sum |q d| |w| per output (the fp32 sums' rounding scale) and sum (d / 2) |w| (the
    most the activations' int8 rounding can move an output), fp64 [T, N]"""
    q, d = qv.quantize_rows(x)
    w = ql.dequantize_rows(blocks, qtype, k).double().abs()
    dq = d.double().repeat_interleave(qv.BLOCK, dim=1)
    return (q.double().abs() * dq) @ w.T, (dq / 2) @ w.T


def assert_near_exact(got, x, blocks, qtype, n, k):
    """Within one bf16 rounding (2^-8 of |value|) and the fp32 block sums' rounding (2e-5
    of sum |q d| |w|: a few dozen blocks a lane, each a few fp32 roundings)."""
    ref = qv.quant_linear_q8_reference(x, blocks, qtype, n, k)
    scale, _ = magnitudes(x, blocks, qtype, k)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert torch.isfinite(got.float()).all()
    excess = (got.double() - ref).abs() - (2 ** -8 * ref.abs() + 2e-5 * scale + 1e-30)
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3g}"


@needs_vnni
def test_quantization_is_the_references():
    x = bf16_rows(40, 4096, seed=1)
    x[3] = 0  # d = 0: codes 0, not NaN
    x[5, :64] = torch.tensor([1e30, -3e29] * 32).bfloat16()
    x[7, 32:64] = torch.linspace(-1, 1, 32).bfloat16()  # ties of x / d
    q, d = qv.quantize_rows_native(x)
    ref_q, ref_d = qv.quantize_rows(x)
    assert torch.equal(q, ref_q) and torch.equal(d, ref_d)
    assert (q[3] == 0).all() and (d[3] == 0).all()
    assert q.abs().max() == 127 and q.min() >= -127
    with pytest.raises(ValueError, match="48 is not a multiple"):
        qv.quantize_rows(x[:, :48])


@needs_vnni
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_kernel_is_the_exact_int8_product(qtype):
    """n = 1, 7 (within one chunk of columns), 37 (a chunk's tail); one block and several;
    every row-count form of the micro-kernel; 1 and 2 threads."""
    block = ql.BLOCK_SIZES[qtype][0]
    for n, nb in [(1, 1), (7, 3), (37, 1), (37, 5 if block == 32 else 3)]:
        k = nb * block
        blocks = make_blocks(qtype, n, k, seed=n + nb)
        x = bf16_rows(300, k, seed=qtype)
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64, 300):
            for threads in (1, 2):
                got = kernel(x[:rows], blocks, qtype, n, k, threads)
                assert_near_exact(got, x[:rows], blocks, qtype, n, k)
    assert qv.quant_linear_q8_native(x[:0], blocks, qtype, n, k).shape == (0, n)


@needs_vnni
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_rows_are_batch_and_thread_invariant(qtype):
    """Row r alone, at one thread, has the bits it has inside a 37-row call at two."""
    block = ql.BLOCK_SIZES[qtype][0]
    n, k = 45, 2 * block
    blocks = make_blocks(qtype, n, k, seed=5)
    x = bf16_rows(37, k, seed=9)
    together = kernel(x, blocks, qtype, n, k, threads=2)
    alone = torch.cat([kernel(x[r:r + 1], blocks, qtype, n, k, threads=1) for r in range(37)])
    assert torch.equal(together, alone)
    for rows in (2, 5, 9, 17):  # other tilings of the same rows
        assert torch.equal(kernel(x[:rows], blocks, qtype, n, k, threads=3), alone[:rows])
    # a row among others starting elsewhere (x rows with a stride larger than k)
    wide = torch.zeros(37, k + 64, dtype=torch.bfloat16)
    wide[:, :k] = x
    assert torch.equal(kernel(wide[:, :k], blocks, qtype, n, k), together)


@needs_vnni
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_zero_blocks_zero_rows_and_large_values(qtype):
    block = ql.BLOCK_SIZES[qtype][0]
    n, k = 9, 2 * block
    zero = torch.zeros(n, ql.BLOCK_SIZES[qtype][1] * 2, dtype=torch.uint8)
    x = bf16_rows(3, k, seed=2)
    assert torch.equal(kernel(x, zero, qtype, n, k), torch.zeros(3, n, dtype=torch.bfloat16))
    blocks = make_blocks(qtype, n, k, seed=3)
    x[1] = 0
    x[2] *= 1e25
    got = kernel(x, blocks, qtype, n, k)
    assert torch.equal(got[1], torch.zeros(n, dtype=torch.bfloat16))  # d = 0: 0, not NaN
    assert_near_exact(got, x, blocks, qtype, n, k)


@needs_vnni
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_close_to_dequantize_then_matmul(qtype):
    """Against the exact path (gguf's dequantize, fp32 matmul): within the int8 rounding
    of x (at most d / 2 a value, times |w|) and the bf16 rounding."""
    block = ql.BLOCK_SIZES[qtype][0]
    n, k = 37, 4 * block
    blocks = make_blocks(qtype, n, k, seed=4)
    x = bf16_rows(9, k, seed=6)
    got = kernel(x, blocks, qtype, n, k).double()
    ref = x.double() @ ql.dequantize_rows(blocks, qtype, k).double().T
    scale, rounding = magnitudes(x, blocks, qtype, k)
    assert ((got - ref).abs() <= 2 ** -8 * ref.abs() + rounding + 2e-5 * scale).all()
    # and the int8 error is real but small: well under a percent of sum |x| |w|
    assert 0 < (got - ref).abs().max() < 0.01 * scale.max()


@needs_vnni
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_dispatcher_takes_int8_for_bf16_only(batch_invariant, monkeypatch):
    """bf16 x: every row count through the int8 kernel (prefill-sized calls too); fp32 x:
    the exact kernel; FUSEGEN_KERNELS=reference: the reference."""
    blocks = make_blocks(ql.Q4_1, 33, 64)
    for rows in (1, 5, ql.DENSE_FROM_ROWS + 1):
        x = bf16_rows(rows, 64, seed=rows)
        got = ql.quant_linear(x, blocks, ql.Q4_1, 33, 64, batch_invariant=batch_invariant)
        assert torch.equal(got, kernel(x, blocks, ql.Q4_1, 33, 64, torch.get_num_threads()))
        xf = x.float()
        assert torch.equal(ql.quant_linear(xf, blocks, ql.Q4_1, 33, 64),
                           torch.cat([ql.quant_linear_native(xf[i:i + 64], blocks, ql.Q4_1, 33, 64)
                                      for i in range(0, rows, 64)]))
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    assert torch.equal(ql.quant_linear(x, blocks, ql.Q4_1, 33, 64),
                       ql.quant_linear_reference(x, blocks, ql.Q4_1, 33, 64))


def test_bad_calls_are_clear_errors():
    blocks = make_blocks(ql.Q8_0, 4, 32)
    with pytest.raises(ValueError, match=r"x must be bf16 rows \[T, 32\]; got torch.float32"):
        qv.quant_linear_q8_native(torch.randn(2, 32), blocks, ql.Q8_0, 4, 32)
    with pytest.raises(ValueError, match=r"uint8 \[4, 34\]"):
        qv.quant_linear_q8_native(torch.randn(2, 32).bfloat16(), make_blocks(ql.Q8_0, 4, 64),
                                  ql.Q8_0, 4, 32)
    assert not qv.q8_available(10)  # Q2_K


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """quant_vnni.c built for an AVX2 CPU (its vpmaddubsw form), where this CPU runs it"""
    if "avx2" not in native._cpu_flags().split() or "fma" not in native._cpu_flags().split():
        pytest.skip("this CPU cannot run an AVX2 build")
    return build_for_other_cpu("quant_vnni.c", OTHER_CPU_BUILDS[1][0],
                               tmp_path_factory.mktemp("avx2"),
                               ("quant_gguf_q8_available", "quant_gguf_q8_bf16",
                                "quant_gguf_q8_quantize_bf16", "quant_gguf_q8_packed_available",
                                "quant_gguf_q8_packed_bf16"))


def call_q8(lib, qtype, x, blocks, n, k, threads=2, packed=False):
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    fn = lib.quant_gguf_q8_packed_bf16 if packed else lib.quant_gguf_q8_bf16
    assert fn(qtype, x.data_ptr(), x.shape[0], x.stride(0), blocks.data_ptr(), n, k,
              out.data_ptr(), n, threads) == 0
    return out


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
def test_avx2_build_is_the_vnni_kernel_bit_for_bit(qtype, avx2_build):
    """The AVX2 form (8 columns a chunk, vpmaddubsw) gives the AVX-512 form's bits, and
    both the exact int8 product within the fp32 sums' rounding: odd column counts (within
    and across its chunks of 8 and repacked groups of 16), every micro-kernel row count,
    1 and 2 threads; over repacked blocks too (a group read as two chunks)."""
    assert avx2_build.quant_gguf_q8_available(qtype) == 1
    assert avx2_build.quant_gguf_q8_packed_available(qtype) == 1
    block = ql.BLOCK_SIZES[qtype][0]
    x = bf16_rows(300, 5 * block if block == 32 else 3 * block, seed=qtype)
    x[2] = 0
    q, d = torch.empty(300, x.shape[1], dtype=torch.int8), torch.empty(300, x.shape[1] // 32)
    assert avx2_build.quant_gguf_q8_quantize_bf16(x.data_ptr(), 300, x.stride(0), x.shape[1],
                                                  q.data_ptr(), d.data_ptr()) == 0
    ref_q, ref_d = qv.quantize_rows(x)
    assert torch.equal(q, ref_q) and torch.equal(d, ref_d)
    for n, nb in [(1, 1), (7, 2), (8, 1), (9, 3), (16, 2), (37, x.shape[1] // block)]:
        k = nb * block
        blocks = make_blocks(qtype, n, k, seed=n + nb)
        packed = blocks.clone()
        qv.pack_blocks(packed, qtype, k)
        xk = x[:, :k].contiguous()
        for rows in (1, 2, 3, 4, 5, 9, 17, 300):
            for threads in (1, 2):
                got = call_q8(avx2_build, qtype, xk[:rows], blocks, n, k, threads)
                assert torch.equal(
                    call_q8(avx2_build, qtype, xk[:rows], packed, n, k, threads, packed=True), got)
                if qv.q8_available(qtype):
                    assert torch.equal(got, kernel(xk[:rows], blocks, qtype, n, k, threads))
                else:
                    assert_near_exact(got, xk[:rows], blocks, qtype, n, k)


@pytest.mark.parametrize("code", [-128, 127, -127])
def test_q8_0_extreme_codes_are_exact_on_avx2(code, avx2_build):
    """Q8_0 codes -128 and 127 against x's codes +-127 (the AVX2 form's vpmaddubsw pairs
    at their largest, 2 * 128 * 127): the exact integer product, no saturation."""
    n, k = 9, 64
    blocks = make_blocks(ql.Q8_0, n, k, seed=1).reshape(n, 2, 34)
    blocks[:, :, 2:] = code & 0xff
    blocks[:, :, :2] = torch.tensor([0x00, 0x3c], dtype=torch.uint8)  # d = 1.0 (fp16)
    blocks = blocks.reshape(n, 68).contiguous()
    x = torch.full((3, k), 1.0).bfloat16()
    x[1] = -1.0
    x[2, 1::2] = -1.0  # alternating signs: no pair's products share a sign with x's
    got = call_q8(avx2_build, ql.Q8_0, x, blocks, n, k)
    # x's codes are +-127 with d = 1/127: each output is sum(sign(x)) * code * 127 * d
    expect = torch.tensor([k * code, -k * code, 0]).float()[:, None].expand(3, n)
    assert torch.equal(got.float(), expect.bfloat16().float())
    assert_near_exact(got, x, blocks, ql.Q8_0, n, k)
    if qv.q8_available(ql.Q8_0):
        assert torch.equal(got, kernel(x, blocks, ql.Q8_0, n, k))


def test_builds_without_avx2_refuse(tmp_path):
    """Baseline x86-64 and AVX-512 without VNNI or FMA: every type unavailable, the product
    declines (-1) and the dispatcher's reference serves."""
    names = ("quant_gguf_q8_available", "quant_gguf_q8_bf16")
    x, out = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)
    blocks = make_blocks(ql.Q8_0, 1, 32)
    no_fma = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c"]
    for i, flags in enumerate([OTHER_CPU_BUILDS[2][0], no_fma]):
        (tmp_path / str(i)).mkdir()
        lib = build_for_other_cpu("quant_vnni.c", flags, tmp_path / str(i), names)
        for qtype in QTYPES:
            assert lib.quant_gguf_q8_available(qtype) == 0
        assert lib.quant_gguf_q8_bf16(ql.Q8_0, x.data_ptr(), 1, 32, blocks.data_ptr(), 1, 32,
                                      out.data_ptr(), 1, 1) == -1
