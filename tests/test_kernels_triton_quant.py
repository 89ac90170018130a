"""The Triton linears over compressed weights (kernels/triton_quant.py) in Triton's
interpreter on CPU (compiled on CUDA where there is a GPU): each equals its torch
reference within one rounding of the output dtype, over odd row counts, 0 rows and
every GGUF block type; a row's result is bit-identical alone and inside batches of each
M bucket; group_linear.dequantize_group (the group reference's dequantizer) equals an
element-by-element reading of docs/quantization.md."""
import os

import pytest
import torch

from quant_helpers import make_blocks
from fusegen.kernels import quant_linear as ql
from fusegen.kernels.group_linear import dequantize_group
from fusegen.kernels import triton_quant as tq
from fusegen.kernels.testing import triton_on

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows, out_features, in_features)
SHAPES = [(1, 16, 64), (3, 48, 128), (17, 16, 256), (17, 48, 64), (3, 16, 256), (1, 48, 128)]
ULP = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def make_group(bits, symmetric, out_features, in_features, group_size, seed=0):
    """Codes as a quantizer writes them (symmetric: 1..2^bits - 1 around the middle),
    fp16 scales near 0.01, asymmetric zero points anywhere in the code range."""
    gen = torch.Generator().manual_seed(seed)
    top = 2 ** bits
    codes = torch.randint(1 if symmetric else 0, top, (out_features, in_features), generator=gen)
    if bits == 4:  # docs/quantization.md: byte k of a 32-run holds channel k low, k + 16 high
        runs = codes.reshape(out_features, -1, 2, 16)
        codes = runs[:, :, 0] | (runs[:, :, 1] << 4)
    qweight = codes.reshape(out_features, -1).to(torch.uint8)
    groups = in_features // group_size
    scales = (0.002 + 0.02 * torch.rand(out_features, groups, generator=gen)).half()
    zeros = None if symmetric else torch.randint(0, top, (out_features, groups),
                                                 generator=gen).to(torch.uint8)
    return qweight, scales, zeros


def dequantize_by_element(qweight, scales, zeros, bits, group_size, in_features):
    """docs/quantization.md read literally, one weight at a time."""
    out = torch.empty(qweight.shape[0], in_features)
    for o in range(qweight.shape[0]):
        for i in range(in_features):
            if bits == 8:
                q = int(qweight[o, i])
            else:
                byte = int(qweight[o, i // 32 * 16 + i % 16])
                q = byte & 0xF if i % 32 < 16 else byte >> 4
            g = i // group_size
            zero = int(zeros[o, g]) if zeros is not None else 2 ** (bits - 1)
            out[o, i] = (q - zero) * float(scales[o, g])
    return out


def assert_within_rounding(got, ref, x, w):
    """The kernel and the reference multiply the same rounded weights and differ only in
    the order of the fp32 sum: one rounding of the output dtype (ULP of the result) plus
    fp32 reordering (1e-5 of sum |x| |w|)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    scale = x.float().abs() @ w.abs().T
    bound = ULP[got.dtype] * ref.float().abs() + 1e-5 * scale + 1e-6
    diff = (got.float() - ref.float()).abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item()}"


def _x(rows, in_features, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_features, generator=gen).to(dtype).to(device)


# -- group int4 / int8 ---------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_group_reference_reads_the_layout(bits, symmetric, group_size):
    qweight, scales, zeros = make_group(bits, symmetric, 5, 128, group_size)
    want = dequantize_by_element(qweight, scales, zeros, bits, group_size, 128)
    got = dequantize_group(qweight, scales, zeros, bits, group_size, 128)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)],
                         ids=["int4-sym", "int4-asym", "int8-sym", "int8-asym"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_group_kernel_matches_reference(shape, bits, symmetric, dtype, device):
    rows, out_features, in_features = shape
    group_size = min(in_features, (32, 64, 128)[(rows + out_features) % 3])
    qweight, scales, zeros = make_group(bits, symmetric, out_features, in_features, group_size)
    x = _x(rows, in_features, dtype, device)
    args = [t if t is None else t.to(device) for t in (qweight, scales, zeros)]
    got = triton_on(device, tq.group_linear_triton)(
        x, *args, bits, group_size, out_features, in_features)
    ref = tq.group_linear_reference(x, *args, bits, group_size, out_features, in_features)
    w = dequantize_group(qweight, scales, zeros, bits, group_size, in_features).to(dtype).float()
    assert_within_rounding(got.cpu(), ref.cpu(), x.cpu(), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
def test_group_kernel_zero_rows(bits, device):
    qweight, scales, zeros = make_group(bits, False, 16, 64, 32)
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    got = triton_on(device, tq.group_linear_triton)(
        x, qweight.to(device), scales.to(device), zeros.to(device), bits, 32, 16, 64)
    assert got.shape == (0, 16) and got.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_group_kernel_row_is_batch_invariant(bits, dtype, device):
    # 1 row, 17 rows and 70 rows take the three M buckets' BLOCK_M (16, 32, 64)
    qweight, scales, zeros = make_group(bits, False, 48, 256, 64)
    args = [t.to(device) for t in (qweight, scales, zeros)]
    x = _x(70, 256, dtype, device)
    kernel = triton_on(device, tq.group_linear_triton)
    batched = {n: kernel(x[:n], *args, bits, 64, 48, 256) for n in (17, 70)}
    for i in (0, 5, 16):
        alone = kernel(x[i:i + 1], *args, bits, 64, 48, 256)
        assert torch.equal(alone[0], batched[17][i]) and torch.equal(alone[0], batched[70][i])
    assert torch.equal(batched[17], batched[70][:17])


def test_group_bad_inputs_are_named():
    qweight, scales, zeros = make_group(4, False, 16, 128, 64)
    x = torch.randn(2, 128)
    call = tq.group_linear_triton
    with pytest.raises(ValueError,
                       match=r"int4 qweight .*uint8 \[16, 64\]; got torch.uint8 \[16, 128\]"):
        call(x, torch.zeros(16, 128, dtype=torch.uint8), scales, zeros, 4, 64, 16, 128)
    with pytest.raises(ValueError, match=r"int4 scales .*float16 \[16, 2\]; got torch.float32"):
        call(x, qweight, scales.float(), zeros, 4, 64, 16, 128)
    with pytest.raises(ValueError,
                       match=r"int4 zeros .*uint8 \[16, 2\]; got torch.uint8 \[16, 4\]"):
        call(x, qweight, scales, torch.zeros(16, 4, dtype=torch.uint8), 4, 64, 16, 128)
    with pytest.raises(ValueError, match="bits=3"):
        call(x, qweight, scales, zeros, 3, 64, 16, 128)
    with pytest.raises(ValueError, match="group_size=48"):
        call(x, qweight, scales, zeros, 4, 48, 16, 128)
    with pytest.raises(ValueError, match=r"x \[2, 96\] does not end in in_features=128"):
        call(torch.randn(2, 96), qweight, scales, zeros, 4, 64, 16, 128)
    with pytest.raises(ValueError, match="x is torch.int32"):
        call(x.int(), qweight, scales, zeros, 4, 64, 16, 128)
    with pytest.raises(ValueError, match=r"x \[2, 1, 128\] is not rows \[M, in_features=128\]"):
        call(x[:, None], qweight, scales, zeros, 4, 64, 16, 128)


# -- GGUF blocks ---------------------------------------------------------------------

QTYPES = sorted(ql.SUPPORTED)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: ql.SUPPORTED[q])
@pytest.mark.parametrize("shape", [(1, 16, 256), (3, 48, 256), (17, 16, 512)], ids=str)
def test_gguf_kernel_matches_reference(shape, qtype, dtype, device):
    rows, out_features, in_features = shape
    blocks = make_blocks(qtype, out_features, in_features)
    x = _x(rows, in_features, dtype, device)
    got = triton_on(device, tq.gguf_linear_triton)(
        x, blocks.to(device), qtype, out_features, in_features)
    ref = tq.gguf_linear_reference(x, blocks, qtype, out_features, in_features)
    w = ql.dequantize_rows(blocks, qtype, in_features).to(dtype).float()
    assert_within_rounding(got.cpu(), ref.cpu(), x.cpu(), w)


@pytest.mark.parametrize("qtype", [ql.Q8_0, ql.Q4_0, ql.Q4_1, ql.Q5_0, ql.Q5_1],
                         ids=lambda q: ql.SUPPORTED[q])
def test_gguf_32_value_types_at_short_rows(qtype):
    # in_features 64 and 96: fewer channels than one k-tile (128), and not a multiple of it
    for in_features in (64, 96):
        blocks = make_blocks(qtype, 16, in_features, seed=in_features)
        x = _x(3, in_features, torch.float32, "cpu")
        got = triton_on("cpu", tq.gguf_linear_triton)(x, blocks, qtype, 16, in_features)
        ref = tq.gguf_linear_reference(x, blocks, qtype, 16, in_features)
        assert_within_rounding(got, ref, x, ql.dequantize_rows(blocks, qtype, in_features))


def test_gguf_reference_is_quant_linear_reference_in_fp32():
    # In fp32 no rounding of the weights: the same numbers as the engine's reference.
    blocks = make_blocks(ql.Q4_K, 16, 256)
    x = _x(3, 256, torch.float32, "cpu")
    torch.testing.assert_close(tq.gguf_linear_reference(x, blocks, ql.Q4_K, 16, 256),
                               ql.quant_linear_reference(x, blocks, ql.Q4_K, 16, 256))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [ql.Q4_0, ql.Q6_K], ids=lambda q: ql.SUPPORTED[q])
def test_gguf_kernel_zero_rows_and_batch_invariance(qtype, device):
    blocks = make_blocks(qtype, 48, 256).to(device)
    kernel = triton_on(device, tq.gguf_linear_triton)
    empty = kernel(torch.empty(0, 256, dtype=torch.bfloat16, device=device), blocks, qtype, 48, 256)
    assert empty.shape == (0, 48) and empty.dtype == torch.bfloat16
    x = _x(70, 256, torch.bfloat16, device)
    batched = {n: kernel(x[:n], blocks, qtype, 48, 256) for n in (17, 70)}
    for i in (0, 16):
        alone = kernel(x[i:i + 1], blocks, qtype, 48, 256)
        assert torch.equal(alone[0], batched[17][i]) and torch.equal(alone[0], batched[70][i])


def test_gguf_bad_inputs_are_named():
    blocks = make_blocks(ql.Q8_0, 16, 64)
    with pytest.raises(ValueError,
                       match=r"Q8_0 blocks .* uint8 \[16, 136\]; got torch.uint8 \[16, 34\]"):
        tq.gguf_linear_triton(torch.randn(1, 128), blocks[:, :34], ql.Q8_0, 16, 128)
    with pytest.raises(ValueError, match="type 99 has no quant_linear kernel"):
        tq.gguf_linear_triton(torch.randn(1, 64), blocks, 99, 16, 64)
    with pytest.raises(ValueError, match=r"x \[1, 32\] is not rows"):
        tq.gguf_linear_triton(torch.randn(1, 32), blocks, ql.Q8_0, 16, 64)


def test_interpreter_stays_out_of_this_process(monkeypatch):
    # The interpreter runs in testing.py's child; the CUDA tests of the same pytest run
    # need Triton's compiler, so TRITON_INTERPRET is never set here.
    before = os.environ.get("TRITON_INTERPRET")
    triton_on("cpu", tq.gguf_linear_triton)(torch.randn(1, 64), make_blocks(ql.Q8_0, 16, 64),
                                            ql.Q8_0, 16, 64)
    assert os.environ.get("TRITON_INTERPRET") == before
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert tq.has_triton_quant("cpu") is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tq.has_triton_quant("cpu") is True
