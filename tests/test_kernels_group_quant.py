"""x @ W.T on a group-quantized int8 / int4 weight (kernels/group_linear.py,
kernels/csrc/quant_group.c, layout in docs/quantization.md): the format's round trip,
the reference (dequantize a tile, fp32 product) and the C kernel against it for every
(bits, symmetric, group_size, dtype) over odd shapes, row counts and thread counts."""
import pytest
import torch

from quant_helpers import OTHER_CPU_BUILDS, OTHER_CPU_IDS, assert_close, build_for_other_cpu
from fusegen.kernels import group_linear as gl
from fusegen.kernels import group_vnni
from fusegen.kernels import native, use_native

FORMATS = [(bits, sym, g) for bits in (8, 4) for sym in (True, False) for g in (32, 64, 128)]
FORMAT_IDS = [f"int{b}-{'sym' if s else 'asym'}-g{g}" for b, s, g in FORMATS]


def make_weight(bits, symmetric, group_size, out_features, in_features, seed=0):
    """Random codes over the whole code range (0 included for asymmetric groups), random
    zero points and fp16 scales of about 0.01: (qweight, scales, zeros | None)."""
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    top = gl.MAX_CODE[bits]
    codes = torch.randint(0 if not symmetric else 1, top + 1, (out_features, in_features),
                          generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_features, groups, generator=gen) * 0.02 + 1e-3).half()
    zeros = None if symmetric else torch.randint(0, top + 1, (out_features, groups),
                                                 generator=gen, dtype=torch.uint8)
    qweight = gl.pack_int4(codes) if bits == 4 else codes
    return qweight, scales, zeros


# ---- the format ---------------------------------------------------------------------

def test_int4_nibble_order_is_gguf_q4_0():
    """In each run of 32 channels byte k holds channel k (low nibble) and k + 16 (high): a
    symmetric int4 weight in groups of 32 is GGUF Q4_0 (d = scale, codes minus 8), so gguf's
    own dequantize of the same bytes gives the same weight."""
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    codes = (torch.arange(64) * 7 + torch.arange(64) // 16).remainder(16).to(torch.uint8)
    codes = codes.reshape(1, 64)
    packed = gl.pack_int4(codes)
    assert packed.shape == (1, 32)
    for run in range(2):
        for k in range(16):
            byte = packed[0, 16 * run + k].item()
            assert byte & 0xF == codes[0, 32 * run + k] and byte >> 4 == codes[0, 32 * run + k + 16]
    assert torch.equal(gl.unpack_int4(packed), codes)

    qweight, scales, _ = make_weight(4, True, 32, 3, 128, seed=2)
    blocks = np.concatenate([scales.numpy().reshape(3, 4, 1).view(np.uint8),
                             qweight.numpy().reshape(3, 4, 16)], axis=2)  # [d, q[16]] x 4
    expected = dequantize(blocks.reshape(3, -1), GGMLQuantizationType.Q4_0).reshape(3, 128)
    assert torch.equal(gl.dequantize_group(qweight, scales, None, 4, 32, 128),
                       torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_is_code_minus_zero_times_scale(bits):
    qweight, scales, zeros = make_weight(bits, False, 32, 3, 64)
    codes = gl.unpack_int4(qweight) if bits == 4 else qweight
    w = gl.dequantize_group(qweight, scales, zeros, bits, 32, 64)
    for o, i in [(0, 0), (1, 31), (2, 32), (2, 63)]:
        expected = (float(codes[o, i]) - float(zeros[o, i // 32])) * float(scales[o, i // 32])
        assert w[o, i].item() == expected
    w_sym = gl.dequantize_group(qweight, scales, None, bits, 32, 64)
    mid = gl.SYMMETRIC_ZERO[bits]
    assert w_sym[1, 40].item() == (float(codes[1, 40]) - mid) * float(scales[1, 1])


@pytest.mark.parametrize("bits,symmetric,group_size", FORMATS, ids=FORMAT_IDS)
def test_quantize_dequantize_round_trip_exact_on_grid(bits, symmetric, group_size):
    """Values n * s (s fp16, integers n spanning the code range) come back bit for bit,
    with the same codes and scales."""
    gen = torch.Generator().manual_seed(bits + group_size)
    out_features, in_features = 6, 2 * group_size
    groups = in_features // group_size
    top = gl.MAX_CODE[bits]
    s = (torch.rand(out_features, groups, generator=gen) * 0.05 + 1e-3).half()
    if symmetric:
        steps = top // 2
        n = torch.randint(-steps, steps + 1, (out_features, groups, group_size), generator=gen)
        n[:, :, 0] = steps * torch.where(torch.rand(out_features, groups, generator=gen) < 0.5,
                                         -1, 1)  # the extreme, either sign
    else:
        zero = torch.randint(0, top + 1, (out_features, groups, 1), generator=gen)
        n = torch.randint(0, top + 1, (out_features, groups, group_size), generator=gen) - zero
        n[:, :, 0], n[:, :, 1] = -zero[:, :, 0], top - zero[:, :, 0]  # codes 0 and top
    w = (n.float() * s.float()[:, :, None]).reshape(out_features, in_features)
    qweight, scales, zeros = gl.quantize_group(w, bits, group_size, symmetric)
    assert torch.equal(scales, s)
    assert (zeros is None) == symmetric
    back = gl.dequantize_group(qweight, scales, zeros, bits, group_size, in_features)
    assert torch.equal(back, w)
    again = gl.quantize_group(back, bits, group_size, symmetric)
    assert torch.equal(again[0], qweight)


def test_quantize_rounding_rules():
    # int8 symmetric: scale max|w| / 127 in fp16, codes round(w / scale) + 128
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([1.27, -0.5, 0.015, 0.025])
    qweight, scales, zeros = gl.quantize_group(w, 8, 32, True)
    s = torch.tensor(1.27 / 127).half()
    assert zeros is None and scales[0, 0] == s
    expected = torch.round(w[0, :4] / s.float()) + 128
    assert qweight[0, :4].tolist() == expected.tolist() and qweight[0, 4] == 128
    # asymmetric int4, a group of positive values only: the range still holds 0 (zero 0)
    w = torch.linspace(1.0, 3.0, 32).reshape(1, 32)
    qweight, scales, zeros = gl.quantize_group(w, 4, 32, False)
    assert zeros[0, 0] == 0 and scales[0, 0] == torch.tensor(3.0 / 15).half()
    assert gl.unpack_int4(qweight)[0, -1] == 15
    # all-zero groups: scale 0, codes at the zero point, zeros back
    for bits, symmetric in [(8, True), (4, True), (8, False), (4, False)]:
        qweight, scales, zeros = gl.quantize_group(torch.zeros(2, 64), bits, 32, symmetric)
        codes = gl.unpack_int4(qweight) if bits == 4 else qweight
        assert (scales == 0).all()
        mid = gl.SYMMETRIC_ZERO[bits] if symmetric else 0
        assert (codes == mid).all() and (zeros is None or (zeros == 0).all())
        assert torch.equal(gl.dequantize_group(qweight, scales, zeros, bits, 32, 64),
                           torch.zeros(2, 64))


def test_quantize_errors_name_the_problem():
    with pytest.raises(ValueError, match="group_size=48: must be one of"):
        gl.quantize_group(torch.randn(2, 96), 8, 48, True)
    with pytest.raises(ValueError, match="bits=3"):
        gl.quantize_group(torch.randn(2, 64), 3, 32, True)
    with pytest.raises(ValueError, match="in_features=40 is not a positive multiple"):
        gl.quantize_group(torch.randn(2, 40), 8, 32, True)
    with pytest.raises(ValueError, match="expected a float"):
        gl.quantize_group(torch.ones(64, dtype=torch.int32), 8, 32, True)
    bad = torch.randn(3, 64)
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match="weight row 2 holds inf or NaN"):
        gl.quantize_group(bad, 4, 32, False)
    big = torch.zeros(2, 64)
    big[1, 40] = 1e8
    with pytest.raises(ValueError, match=r"weight row 1, channels 32..63: .*exceeds fp16"):
        gl.quantize_group(big, 8, 32, True)


def test_check_errors_name_the_tensor():
    qweight, scales, zeros = make_weight(4, False, 32, 5, 64)
    x = torch.randn(2, 64)
    call = dict(bits=4, group_size=32, out_features=5, in_features=64)

    def run(**changes):
        args = dict(qweight=qweight, scales=scales, zeros=zeros, **call)
        args.update(changes)
        return gl.group_linear(changes.pop("x", x), **args)

    with pytest.raises(ValueError, match="bits=2"):
        run(bits=2)
    with pytest.raises(ValueError, match="group_size=16"):
        run(group_size=16)
    with pytest.raises(ValueError, match=r"in_features=96 is not a positive multiple of "
                                         r"group_size=64"):
        run(in_features=96, group_size=64)
    with pytest.raises(ValueError, match=r"int4 qweight .* is torch.uint8 \[5, 32\]; got "
                                         r"torch.uint8 \[5, 64\]"):
        run(qweight=torch.zeros(5, 64, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"int4 scales .* is torch.float16 \[5, 2\]; got "
                                         r"torch.float32 \[5, 2\]"):
        run(scales=scales.float())
    with pytest.raises(ValueError, match=r"int4 zeros .* is torch.uint8 \[5, 2\]; got "
                                         r"torch.uint8 \[5, 1\]"):
        run(zeros=zeros[:, :1])
    with pytest.raises(ValueError, match=r"x \[2, 32\] does not end in in_features=64"):
        gl.group_linear(torch.randn(2, 32), qweight, scales, zeros, **call)
    with pytest.raises(ValueError, match="x is torch.float64"):
        gl.group_linear(x.double(), qweight, scales, zeros, **call)
    with pytest.raises(ValueError, match=r"int8 qweight .* \[5, 64\]; got torch.uint8 \[5, 32\]"):
        gl.dequantize_group(qweight, scales, zeros, 8, 32, 64)
    assert not gl.has_kernel(3, torch.float32) and not gl.has_kernel(4, torch.float16)
    with pytest.raises(RuntimeError, match="no C kernel for int4 with torch.float16 x"):
        gl.group_linear_native(x.half(), qweight, scales, zeros, **call)


# ---- the reference --------------------------------------------------------------------

@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, False)])
def test_reference_is_dequantize_then_matmul(bits, symmetric):
    """Tiled over output rows, each tile's product one fp32 mm; bf16 and fp16 x rounded
    once at the end; 0 rows give [0, out]; leading dimensions are kept."""
    qweight, scales, zeros = make_weight(bits, symmetric, 64, 600, 128)
    w = gl.dequantize_group(qweight, scales, zeros, bits, 64, 128)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(1))
    got = gl.group_linear_reference(x, qweight, scales, zeros, bits, 64, 600, 128)
    for first in range(0, 600, gl.REFERENCE_TILE_ROWS):
        tile = slice(first, first + gl.REFERENCE_TILE_ROWS)
        assert torch.equal(got[:, tile], x @ w[tile].T)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        assert torch.equal(gl.group_linear_reference(xd, qweight, scales, zeros, bits, 64, 600,
                                                     128), (xd.float() @ w.T).to(dtype))
    assert torch.equal(gl.group_linear(x.half(), qweight, scales, zeros, bits, 64, 600, 128),
                       (x.half().float() @ w.T).half())  # fp16: the reference serves it
    empty = gl.group_linear(x[:0], qweight, scales, zeros, bits, 64, 600, 128)
    assert empty.shape == (0, 600) and empty.dtype == torch.float32
    x3 = x[:6].reshape(2, 3, 128)
    got3 = gl.group_linear(x3, qweight, scales, zeros, bits, 64, 600, 128)
    assert got3.shape == (2, 3, 600)
    assert torch.equal(got3.reshape(6, 600),
                       gl.group_linear(x[:6], qweight, scales, zeros, bits, 64, 600, 128))


# ---- the C kernel -----------------------------------------------------------------------

needs_library = pytest.mark.skipif(native.library() is None, reason="no C compiler here")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@needs_library
@pytest.mark.parametrize("bits,symmetric,group_size", FORMATS, ids=FORMAT_IDS)
def test_kernel_equals_reference(bits, symmetric, group_size, restore_threads):
    """Odd shapes (one output row, out not a multiple of the 4-row groups or the threads, in
    one group), decode calls (expanded in registers) and prefill calls (through scratch),
    1-3 threads. The plain-C expansion gives the vector path's result bit for bit: both
    expand to the same exact fp32 (or bf16-rounded) weights, and the product after them is
    one code path, so the sums are the same in the same order."""
    assert gl.has_kernel(bits, torch.float32) and gl.has_kernel(bits, torch.bfloat16)
    gen = torch.Generator().manual_seed(bits * group_size)
    g = group_size
    for n, k in [(1, g), (7, 3 * g), (37, 2 * g)]:
        qweight, scales, zeros = make_weight(bits, symmetric, g, n, k, seed=n)
        w = gl.dequantize_group(qweight, scales, zeros, bits, g, k)
        for rows, threads in [(1, 1), (3, 2), (5, 3), (64, 2)]:
            torch.set_num_threads(threads)
            x = torch.randn(rows, k, generator=gen)
            for dtype in DTYPES:
                xd = x.to(dtype)
                got = gl.group_linear_native(xd, qweight, scales, zeros, bits, g, n, k)
                ref = gl.group_linear_reference(xd, qweight, scales, zeros, bits, g, n, k)
                assert_close(got, ref, xd, w)
                assert torch.equal(got, gl.group_linear_native(xd, qweight, scales, zeros, bits,
                                                               g, n, k, plain=True))


@needs_library
@pytest.mark.parametrize("bits,symmetric,group_size", [(8, True, 32), (8, False, 128),
                                                       (4, True, 64), (4, False, 32)])
def test_expansion_is_dequantize_group(bits, symmetric, group_size):
    qweight, scales, zeros = make_weight(bits, symmetric, group_size, 9, 4 * group_size)
    expected = gl.dequantize_group(qweight, scales, zeros, bits, group_size, 4 * group_size)
    for plain in (False, True):
        assert torch.equal(gl.dequantize_native(qweight, scales, zeros, bits, group_size,
                                                4 * group_size, plain=plain), expected)


@needs_library
@pytest.mark.parametrize("bits,symmetric", [(8, False), (4, True), (4, False)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_is_batch_and_thread_invariant(bits, symmetric, dtype, restore_threads):
    """Row r's result is the same bits alone (a decode call, expanded in registers), in a
    batch of 13 (through scratch), in the second 64-row call of 130 rows, whatever the
    thread count (the engine's deterministic mode relies on it)."""
    n, k = 37, 192
    qweight, scales, zeros = make_weight(bits, symmetric, 64, n, k)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    call = (qweight, scales, zeros, bits, 64, n, k)
    torch.set_num_threads(1)
    alone = torch.cat([gl.group_linear(x[i:i + 1], *call) for i in range(130)])
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        assert torch.equal(gl.group_linear(x, *call), alone)
        assert torch.equal(gl.group_linear(x[60:73], *call), alone[60:73])
        assert torch.equal(gl.group_linear(x[:3], *call), alone[:3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [0, 1, 63, 64, 65, 130])
def test_dispatcher(dtype, rows, monkeypatch):
    """Every row count gives the reference's answer (several 64-row calls past 64);
    FUSEGEN_KERNELS=reference gives the reference itself."""
    qweight, scales, zeros = make_weight(4, False, 32, 33, 64)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(dtype)
    call = (qweight, scales, zeros, 4, 32, 33, 64)
    ref = gl.group_linear_reference(x, *call)
    got = gl.group_linear(x, *call)
    assert got.shape == (rows, 33) and got.dtype == dtype
    assert_close(got, ref, x, gl.dequantize_group(qweight, scales, zeros, 4, 32, 64))
    if use_native(x) and rows and x.dtype == torch.bfloat16 and gl.q8_available(4):
        # bf16 x on VNNI CPUs: the int8 product (tests/test_kernels_group_vnni.py)
        assert torch.equal(got, group_vnni.group_linear_q8_native(x, *call))
    elif use_native(x) and rows:
        assert torch.equal(got, torch.cat([gl.group_linear_native(x[i:i + 64], *call)
                                           for i in range(0, rows, 64)]))
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    assert torch.equal(gl.group_linear(x, *call), ref)


@needs_library
@pytest.mark.parametrize("flags,available", OTHER_CPU_BUILDS, ids=OTHER_CPU_IDS)
def test_other_cpus_builds(flags, available, tmp_path):
    """The builds for AVX-512 without AVX512_BF16 (bf16 x widened, weights rounded to bf16
    precision), AVX2 and baseline x86-64 (plain C, GCC vector products; the form other
    CPUs compile) of quant_group.c, compiled here, against the reference: both dtypes,
    decode and prefill calls, plain and vector expansions bit for bit."""
    lib = build_for_other_cpu("quant_group.c", flags, tmp_path,
                              ("quant_group_available", "quant_group_f32", "quant_group_bf16"))
    assert lib.quant_group_available(4) == available == lib.quant_group_available(8)
    gen = torch.Generator().manual_seed(5)
    for bits, symmetric, g in [(8, False, 64), (4, True, 32), (4, False, 128)]:
        n, k = 13, 256
        qweight, scales, zeros = make_weight(bits, symmetric, g, n, k)
        w = gl.dequantize_group(qweight, scales, zeros, bits, g, k)
        for rows in (1, 2, 9):  # decode calls (in registers) and prefill (scratch)
            for dtype, kernel in [(torch.float32, lib.quant_group_f32),
                                  (torch.bfloat16, lib.quant_group_bf16)]:
                x = torch.randn(rows, k, generator=gen).to(dtype)
                results = []
                for plain in (0, 1):
                    out = torch.empty(rows, n, dtype=dtype)
                    assert kernel(bits, g, x.data_ptr(), rows, k, qweight.data_ptr(),
                                  scales.data_ptr(), None if zeros is None else zeros.data_ptr(),
                                  n, k, out.data_ptr(), n, 2, plain) == 0
                    results.append(out)
                assert torch.equal(results[0], results[1])
                assert_close(results[0],
                             gl.group_linear_reference(x, qweight, scales, zeros, bits, g, n, k),
                             x, w)


@needs_library
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_apart_in_memory(bits, dtype):
    """x whose rows lie further apart than in_features (a slice of a wider tensor) gives
    the contiguous copy's result to the bit, in decode calls and past 64 rows."""
    qweight, scales, zeros = make_weight(bits, False, 32, 9, 64)
    wide = torch.randn(70, 96, generator=torch.Generator().manual_seed(7)).to(dtype)
    for rows in (1, 70):
        x = wide[:rows, 16:80]
        assert x.stride() == (96, 1)
        assert torch.equal(gl.group_linear(x, qweight, scales, zeros, bits, 32, 9, 64),
                           gl.group_linear(x.contiguous(), qweight, scales, zeros, bits, 32, 9,
                                           64))
