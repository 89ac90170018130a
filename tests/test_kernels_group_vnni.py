"""bf16 x against a group-quantized int8 / int4 weight by int8 products
(kernels/group_vnni.py, kernels/csrc/quant_group_vnni.c): the kernel equals the torch
reference of its numerics (x quantized per 32 values, integer block dots, fp32 scaling
by fused multiply-adds in ascending block order, one bf16 rounding) bit for bit, for
every bits / symmetric / group size, odd shapes, row and thread counts; each row's bits
are its own whatever the batch; against dequantize-then-matmul it is within the
activations' int8 rounding; the dispatcher takes it for bf16 x only, and a build without
VNNI declines."""
import pytest
import torch

from fusegen.kernels import group_linear as gl
from fusegen.kernels import group_vnni as gv
from fusegen.kernels import quant_vnni as qv
from quant_helpers import build_for_other_cpu
from test_kernels_group_quant import FORMAT_IDS, FORMATS, make_weight

needs_vnni = pytest.mark.skipif(not (gv.q8_available(8) and gv.q8_available(4)),
                                reason="no AVX512_VNNI build on this machine")


def bf16_rows(rows: int, k: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def kernel(x, weight, fmt, n, k, threads=2):
    bits, _, group_size = fmt
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return gv.group_linear_q8_native(x, *weight, bits, group_size, n, k)
    finally:
        torch.set_num_threads(saved)


def reference(x, weight, fmt, n, k):
    bits, _, group_size = fmt
    return gv.group_linear_q8_reference(x, *weight, bits, group_size, n, k)


def test_fma_reference_rounds_once():
    """fma_f32 rounds a * b + c once: not the product first (mul-then-add's answer), and
    not through the fp64 sum where that lands on a tie of fp32 that the exact value is
    above."""
    f32 = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    a, b, c = f32(1 + 2 ** -12), f32(1 + 2 ** -12), f32(-1.0)
    assert gv.fma_f32(a, b, c) == 2 ** -11 + 2 ** -24  # exact in fp32
    assert a * b + c == 2 ** -11  # the product rounded first loses 2^-24
    # exact: 1 + 2^-24 + 2^-70, just above the tie between 1 and 1 + 2^-23; the fp64 sum
    # is the tie itself, which rounds to even (1.0)
    a, b, c = f32(-(2 ** -24) * (1 + 2 ** -23)), f32(1 - 2 ** -23), f32(1 + 2 ** -23)
    assert (a.double() * b.double() + c.double()).float() == 1.0
    assert gv.fma_f32(a, b, c) == 1 + 2 ** -23
    assert gv.fma_f32(f32(2 ** -24), f32(1.0), f32(1.0)) == 1.0  # an exact tie: to even


@needs_vnni
@pytest.mark.parametrize("bits,symmetric,group_size", FORMATS, ids=FORMAT_IDS)
def test_kernel_is_the_reference_bit_for_bit(bits, symmetric, group_size):
    """n = 1, 7 (within one chunk of 16 columns), 37 and 45 (a chunk's tail); in_features
    one group up to 1,536 channels; every row-count form (in registers up to 4 rows,
    through the scratch past 4, tails of 4); 1 and 2 threads."""
    fmt = (bits, symmetric, group_size)
    for n, k in [(1, group_size), (7, 3 * group_size), (37, 384), (45, 1536)]:
        weight = make_weight(bits, symmetric, group_size, n, k, seed=n + k)
        x = bf16_rows(300, k, seed=n)
        for rows in (1, 2, 3, 4, 5, 17, 64, 65, 300):
            want = reference(x[:rows], weight, fmt, n, k)
            for threads in (1, 2):
                got = kernel(x[:rows], weight, fmt, n, k, threads)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                assert torch.equal(got, want), (n, k, rows, threads)
        assert kernel(x[:0], weight, fmt, n, k).shape == (0, n)


@needs_vnni
def test_large_in_features_and_zero_scales():
    """A few thousand channels, groups whose scale is 0 (all-zero weights), rows of x that
    are 0 (d = 0: zeros, not NaN) and huge: still the reference's bits."""
    for bits, symmetric, group_size in [(8, False, 32), (4, True, 128), (4, False, 64)]:
        fmt = (bits, symmetric, group_size)
        n, k = 19, 4096
        qweight, scales, zeros = make_weight(bits, symmetric, group_size, n, k, seed=bits)
        scales[3] = 0
        scales[5, 7] = 0
        x = bf16_rows(6, k, seed=3)
        x[1] = 0
        x[2] *= 1e30
        got = kernel(x, (qweight, scales, zeros), fmt, n, k)
        assert torch.equal(got, reference(x, (qweight, scales, zeros), fmt, n, k))
        assert torch.equal(got[1], torch.zeros(n, dtype=torch.bfloat16))
        assert torch.equal(got[:, 3], torch.zeros(6, dtype=torch.bfloat16))
        assert torch.isfinite(got.float()).all()


@needs_vnni
@pytest.mark.parametrize("bits,symmetric,group_size", [(8, True, 128), (8, False, 32),
                                                       (4, True, 64), (4, False, 128)])
def test_rows_are_batch_and_thread_invariant(bits, symmetric, group_size):
    """Row r alone, at one thread, has the bits it has inside a 65-row call at two, and
    in other tilings of the same rows; x rows further apart than in_features too."""
    fmt = (bits, symmetric, group_size)
    n, k = 45, 512
    weight = make_weight(bits, symmetric, group_size, n, k, seed=5)
    x = bf16_rows(65, k, seed=9)
    together = kernel(x, weight, fmt, n, k, threads=2)
    alone = torch.cat([kernel(x[r:r + 1], weight, fmt, n, k, threads=1) for r in range(65)])
    assert torch.equal(together, alone)
    for rows in (2, 5, 9, 17, 64):
        assert torch.equal(kernel(x[:rows], weight, fmt, n, k, threads=3), alone[:rows])
    assert torch.equal(kernel(x[30:47], weight, fmt, n, k), alone[30:47])
    wide = torch.zeros(65, k + 64, dtype=torch.bfloat16)
    wide[:, 32:32 + k] = x
    assert torch.equal(kernel(wide[:, 32:32 + k], weight, fmt, n, k), together)


@needs_vnni
@pytest.mark.parametrize("bits,symmetric,group_size", FORMATS, ids=FORMAT_IDS)
def test_close_to_dequantize_then_matmul(bits, symmetric, group_size):
    """Against x @ dequantize(W).T in fp64: within the int8 rounding of x (at most d / 2 a
    value, times |w|), the fp32 sums' rounding and one bf16 rounding; and that int8 error
    is real but well under a percent of sum |x| |w|."""
    n, k = 37, 512
    weight = make_weight(bits, symmetric, group_size, n, k, seed=4)
    x = bf16_rows(9, k, seed=6)
    got = kernel(x, weight, (bits, symmetric, group_size), n, k).double()
    w = gl.dequantize_group(*weight, bits, group_size, k).double()
    want = x.double() @ w.T
    _, d = qv.quantize_rows(x)
    rounding = (d.double().repeat_interleave(qv.BLOCK, dim=1) / 2) @ w.abs().T
    scale = x.double().abs() @ w.abs().T
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + rounding + 1e-5 * scale).all()
    assert 0 < (got - want).abs().max() < 0.01 * scale.max()


@needs_vnni
@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, False)])
def test_dispatcher_takes_int8_for_bf16_only(bits, symmetric, monkeypatch):
    """bf16 x: every row count (0, decode, past 64) through the int8 kernel in one call;
    fp32 x: the exact kernel in 64-row calls; FUSEGEN_KERNELS=reference: the reference."""
    n, k, group_size = 33, 128, 32
    weight = make_weight(bits, symmetric, group_size, n, k)
    call = (*weight, bits, group_size, n, k)
    for rows in (1, 5, 64, 130):
        x = bf16_rows(rows, k, seed=rows)
        assert torch.equal(gl.group_linear(x, *call),
                           kernel(x, weight, (bits, symmetric, group_size), n, k,
                                  torch.get_num_threads()))
        xf = x.float()
        assert torch.equal(gl.group_linear(xf, *call),
                           torch.cat([gl.group_linear_native(xf[i:i + 64], *call)
                                      for i in range(0, rows, 64)]))
    assert gl.group_linear(x[:0], *call).shape == (0, n)
    three = x[:6].reshape(2, 3, k)  # [..., in] taken as rows
    assert torch.equal(gl.group_linear(three, *call), gl.group_linear(x[:6], *call).view(2, 3, n))
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    assert torch.equal(gl.group_linear(x, *call), gl.group_linear_reference(x, *call))


def test_bad_calls_are_clear_errors():
    weight = make_weight(8, True, 32, 4, 64)
    with pytest.raises(ValueError, match=r"x must be bf16 rows \[T, 64\]; got torch.float32"):
        gv.group_linear_q8_native(torch.randn(2, 64), *weight, 8, 32, 4, 64)
    with pytest.raises(ValueError, match=r"int8 scales .* is torch.float16 \[4, 2\]"):
        gv.group_linear_q8_native(torch.randn(2, 64).bfloat16(), weight[0], weight[1][:, :1],
                                  None, 8, 32, 4, 64)
    with pytest.raises(ValueError, match="group_size=48"):
        gv.group_linear_q8_native(torch.randn(2, 96).bfloat16(), *weight, 8, 48, 4, 96)
    assert not gv.q8_available(2) and not gv.q8_available(16)


def _build_without_vnni(tmp_path):
    return build_for_other_cpu("quant_group_vnni.c",
                               ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c"], tmp_path,
                               ("quant_group_q8_available", "quant_group_q8_bf16"))


def test_builds_without_vnni_refuse_and_the_bf16_kernel_serves(tmp_path, monkeypatch):
    """AVX-512 without VNNI: both widths unavailable and the product declines (-1); the
    dispatcher, given such a library, takes the bf16 kernel for bf16 x."""
    lib = _build_without_vnni(tmp_path)
    assert lib.quant_group_q8_available(8) == lib.quant_group_q8_available(4) == 0
    qweight, scales, _ = make_weight(8, True, 32, 1, 32)
    x, out = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)
    assert lib.quant_group_q8_bf16(8, 32, x.data_ptr(), 1, 32, qweight.data_ptr(),
                                   scales.data_ptr(), None, 1, 32, out.data_ptr(), 1, 1) == -1
    if not gl.has_kernel(4, torch.bfloat16):
        pytest.skip("no C kernels here")
    monkeypatch.setattr(gv, "_library", lambda: lib)
    gv.q8_available.cache_clear()
    try:
        assert not gv.q8_available(4)
        monkeypatch.setattr(gl, "q8_available", gv.q8_available)
        weight = make_weight(4, False, 64, 21, 128)
        x = bf16_rows(7, 128, seed=1)
        call = (*weight, 4, 64, 21, 128)
        assert torch.equal(gl.group_linear(x, *call), gl.group_linear_native(x, *call))
    finally:
        gv.q8_available.cache_clear()
