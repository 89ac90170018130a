"""FP8 (e4m3) weights: quantize_fp8's codes and scales (exact where the weight is made of
e4m3 values, within e4m3's rounding otherwise), fp8_linear's CPU fallback against the
arithmetic written out, FP8Linear built from a dense Linear (bias, row tiles, bytes,
checked tensors), Hugging Face FP8 checkpoints' scales, and the refusal of CUDA GPUs
without FP8 units. On a GPU with FP8 units, torch._scaled_mm against the fallback."""
import pytest
import torch

from fusegen.engine.weights.fp8 import FP8Linear, check_fp8_device, fp8_checkpoint_parts
from fusegen.engine.weights.linear import Linear
from fusegen.kernels import triton_quant as tq

E4M3 = torch.float8_e4m3fn


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def e4m3_codes(rows, cols, seed=0):
    """Random finite e4m3 values whose row maximum |value| is 448 (as quantize_fp8 makes)."""
    bits = torch.randint(0, 256, (rows, cols), generator=_gen(seed), dtype=torch.uint8)
    codes = bits.view(E4M3).float()
    codes = torch.where(codes.isnan(), 0.0, codes)  # 0x7f / 0xff are NaN in e4m3fn
    codes[:, 0] = 448.0
    return codes.to(E4M3)


def test_quantize_fp8_exact_on_e4m3_weights():
    codes = e4m3_codes(6, 40)
    scale = 2.0 ** torch.randint(-12, 3, (6,), generator=_gen(1)).float()
    weight_fp8, got_scale = tq.quantize_fp8(codes.float() * scale[:, None])
    assert weight_fp8.dtype == E4M3 and got_scale.dtype == torch.float32
    assert torch.equal(got_scale, scale)
    assert torch.equal(weight_fp8.view(torch.uint8), codes.view(torch.uint8))


def test_quantize_fp8_within_e4m3_rounding():
    weight = torch.randn(16, 96, generator=_gen(2)) * torch.logspace(-3, 2, 16)[:, None]
    weight[3] = 0.0  # an all-zero channel: codes 0, a tiny scale, no NaN
    weight_fp8, scale = tq.quantize_fp8(weight.bfloat16())
    back = weight_fp8.float() * scale[:, None]
    # 3 mantissa bits: half a step is 2^-4 of the value; subnormals: 2^-10 of the scale
    assert ((back - weight.bfloat16().float()).abs()
            <= 2 ** -4 * weight.bfloat16().float().abs() + 2 ** -10 * scale[:, None]).all()
    assert torch.equal(back[3], torch.zeros(96)) and scale[3] > 0
    top = weight_fp8.float().abs().amax(dim=1)  # each channel's largest value maps to 448
    assert torch.equal(top[torch.arange(16) != 3], torch.full((15,), 448.0))


def test_quantize_fp8_refuses_bad_weights():
    with pytest.raises(ValueError, match=r"weight row 2 holds inf or NaN"):
        bad = torch.ones(4, 8)
        bad[2, 5] = float("nan")
        tq.quantize_fp8(bad)
    with pytest.raises(ValueError, match=r"float weight \[out, in\]; got torch.float32 \[8\]"):
        tq.quantize_fp8(torch.ones(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [0, 1, 3, 17])
def test_fp8_linear_fallback_is_the_scaled_product(rows, dtype):
    weight_fp8, scale = tq.quantize_fp8(torch.randn(48, 128, generator=_gen(3)))
    bias = torch.randn(48, generator=_gen(4)).to(dtype)
    x = torch.randn(rows, 128, generator=_gen(5)).to(dtype)
    got = tq.fp8_linear(x, weight_fp8, scale, bias)
    assert got.shape == (rows, 48) and got.dtype == dtype
    # written out: x per row to e4m3 (quantize_fp8 of x is exactly that), then in float64
    x_fp8, x_scale = tq.quantize_fp8(x)
    want = ((x_fp8.double() * x_scale.double()[:, None])
            @ (weight_fp8.double() * scale.double()[:, None]).T)
    want = want.to(torch.bfloat16).to(dtype) + bias  # _scaled_mm's bf16 result, then bias
    assert torch.allclose(got.double(), want.double(), rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got, tq.fp8_linear_reference(x, weight_fp8, scale, bias))


def test_fp8_linear_per_tensor_scales_every_row_alike():
    weight_fp8, scale = tq.quantize_fp8(torch.randn(16, 64, generator=_gen(6)))
    x = torch.randn(3, 64, generator=_gen(7))
    x[1] *= 100  # the largest row sets the one scale
    _, row_scales = tq.quantize_fp8_rows(x, per_tensor=True)
    assert torch.equal(row_scales, torch.full((3, 1), float(x.abs().max()) / 448))
    per_row = tq.fp8_linear(x, weight_fp8, scale)
    per_tensor = tq.fp8_linear(x, weight_fp8, scale, per_tensor=True)
    assert torch.equal(per_row[1], per_tensor[1]) and not torch.equal(per_row[0], per_tensor[0])


def test_fp8_linear_bad_inputs_are_named():
    weight_fp8, scale = tq.quantize_fp8(torch.randn(16, 64, generator=_gen(8)))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError,
                       match=r"weight_fp8 is float8_e4m3fn \[out, in\]; got torch.bfloat16"):
        tq.fp8_linear(x, weight_fp8.bfloat16(), scale)
    with pytest.raises(ValueError,
                       match=r"weight_scale is float32 \[16\] .*got torch.float32 \[16, 1\]"):
        tq.fp8_linear(x, weight_fp8, scale[:, None])
    with pytest.raises(ValueError, match=r"bias is \[16\]; got \[15\]"):
        tq.fp8_linear(x, weight_fp8, scale, torch.zeros(15))
    with pytest.raises(ValueError, match=r"x \[.., 32\] does not match weight_fp8 \[16, 64\]"):
        tq.fp8_linear(torch.randn(2, 32), weight_fp8, scale)


def _dense(out_features=48, in_features=128, bias=True, seed=9):
    linear = Linear(bias=bias)
    linear.weight = torch.randn(out_features, in_features, generator=_gen(seed)).bfloat16()
    if bias:
        linear.bias = torch.randn(out_features, generator=_gen(seed + 1)).bfloat16()
    return linear


def test_fp8_linear_module_from_dense_linear():
    dense = _dense()
    fp8 = FP8Linear.from_linear(dense)
    assert isinstance(fp8, Linear) and fp8.weight is None and fp8.bias is dense.bias
    assert (fp8.out_features, fp8.in_features) == (48, 128)
    assert fp8.nbytes == 48 * 128 + 48 * 4 + 48 * 2  # codes, fp32 scales, bf16 bias
    x = torch.randn(5, 128, generator=_gen(11)).bfloat16()
    got = fp8(x)
    assert got.shape == (5, 48) and got.dtype == torch.bfloat16
    assert torch.equal(got, tq.fp8_linear(x, fp8.weight_fp8, fp8.weight_scale, dense.bias))
    # within fp8's rounding of x and of the weight (2^-4 each) of the dense product
    err = (got.float() - dense(x).float()).abs()
    assert (err <= 2 ** -3 * (x.float().abs() @ dense.weight.float().abs().T) + 0.05).all()


def test_fp8_linear_module_row_tiles_make_rows_batch_invariant():
    fp8 = FP8Linear.from_linear(_dense(bias=False))
    fp8.row_tile = 8
    x = torch.randn(19, 128, generator=_gen(12)).bfloat16()
    batched = fp8(x)
    for i in (0, 7, 18):
        assert torch.equal(fp8(x[i:i + 1])[0], batched[i])


def test_fp8_linear_module_checks_its_tensors():
    fp8 = FP8Linear.from_linear(_dense(bias=False))
    with pytest.raises(ValueError,
                       match=r"weight_fp8 is float8_e4m3fn \[out, in\]; got torch.float16"):
        fp8.set_weight("weight_fp8", torch.zeros(48, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"weight_fp8 is \[48, 128\]; got \[48, 64\]"):
        fp8.set_weight("weight_fp8", torch.zeros(48, 64, dtype=E4M3))
    with pytest.raises(ValueError, match=r"weight_scale is float32 \[48\]"):
        fp8.set_weight("weight_scale", torch.ones(47))
    with pytest.raises(ValueError, match=r"has no 'weight'"):
        fp8.set_weight("weight", torch.zeros(48, 128))
    with pytest.raises(ValueError, match="Linear has no bias"):
        fp8.set_weight("bias", torch.zeros(48))
    with pytest.raises(ValueError, match=r"from_linear: the linear's weight is \[0\]"):
        FP8Linear.from_linear(Linear())


def test_cuda_without_fp8_units_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(tq, "has_fp8_units", lambda device: False)
    monkeypatch.setattr("fusegen.engine.weights.fp8.has_fp8_units", lambda device: False)
    with pytest.raises(RuntimeError, match=r"cuda:0 \(NVIDIA A100-SXM4-80GB\) has compute "
                                           r"capability 8.0; FP8 weights need 8.9 or later"):
        check_fp8_device("cuda:0")
    check_fp8_device("cpu")  # the fallback


def test_checkpoint_parts_per_tensor_and_per_channel_kept_exactly():
    codes = e4m3_codes(8, 32)
    weight, scale = fp8_checkpoint_parts("q_proj", codes, weight_scale=torch.tensor(0.5))
    assert weight is codes and torch.equal(scale, torch.full((8,), 0.5))
    channel = torch.rand(8, 1, generator=_gen(13))
    weight, scale = fp8_checkpoint_parts("q_proj", codes, weight_scale=channel)
    assert weight is codes and torch.equal(scale, channel[:, 0])


def test_checkpoint_parts_blockwise_scales_requantized_per_channel():
    codes = e4m3_codes(200, 300, seed=14)  # blocks of 128 that do not divide the weight
    scale_inv = torch.rand(2, 3, generator=_gen(15)) + 0.5
    weight, scale = fp8_checkpoint_parts("down_proj", codes, weight_scale_inv=scale_inv)
    blocks = scale_inv.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    dense = codes.float() * blocks
    back = weight.float() * scale[:, None]
    assert ((back - dense).abs() <= 2 ** -4 * dense.abs() + 2 ** -10 * scale[:, None]).all()


def test_checkpoint_parts_bad_tensors_are_named():
    codes = e4m3_codes(8, 32)
    with pytest.raises(ValueError, match=r"o_proj.weight is torch.bfloat16 \[8, 32\]"):
        fp8_checkpoint_parts("o_proj", codes.bfloat16(), weight_scale=torch.tensor(1.0))
    with pytest.raises(ValueError,
                       match=r"o_proj.weight_scale or o_proj.weight_scale_inv; got neither"):
        fp8_checkpoint_parts("o_proj", codes)
    with pytest.raises(ValueError, match=r"o_proj.weight_scale is \[4\]"):
        fp8_checkpoint_parts("o_proj", codes, weight_scale=torch.ones(4))
    with pytest.raises(ValueError, match=r"o_proj.weight_scale_inv is \[2, 2\]; a 8 x 32 weight "
                                         r"in 128 x 128 blocks has \[1, 1\]"):
        fp8_checkpoint_parts("o_proj", codes, weight_scale_inv=torch.ones(2, 2))


@pytest.mark.skipif(not tq.has_fp8_units("cuda"), reason="needs a GPU with FP8 units")
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_scaled_mm_matches_the_fallback(rows):
    weight_fp8, scale = tq.quantize_fp8(torch.randn(48, 256, generator=_gen(16)))
    x = torch.randn(rows, 256, generator=_gen(17)).bfloat16()
    bias = torch.randn(48, generator=_gen(18)).bfloat16()
    got = tq.fp8_linear(x.cuda(), weight_fp8.cuda(), scale.cuda(), bias.cuda()).cpu()
    ref = tq.fp8_linear_reference(x, weight_fp8, scale, bias)
    torch.testing.assert_close(got, ref, rtol=2 ** -7, atol=2e-2)
    dense = _dense()
    on_cpu = FP8Linear.from_linear(dense)
    dense.weight, dense.bias = dense.weight.cuda(), dense.bias.cuda()
    on_gpu = FP8Linear.from_linear(dense)
    assert torch.equal(on_gpu.weight_fp8.cpu().view(torch.uint8),
                       on_cpu.weight_fp8.view(torch.uint8))
    torch.testing.assert_close(on_gpu(x.cuda()[:, :128]).cpu(), on_cpu(x[:, :128]),
                               rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not tq.has_fp8_units("cuda"), reason="needs a GPU with FP8 units"))])
def test_row_quantization_kernel_matches_torch(device):
    pytest.importorskip("triton")
    from fusegen.kernels.testing import triton_on

    x = torch.randn(5, 2500, generator=_gen(19)).bfloat16().to(device)  # two k-tiles, a tail
    x[2] = 0.0
    codes, scale = triton_on(device, tq.quantize_fp8_rows_triton)(x)
    want_codes, want_scale = tq.quantize_fp8_rows(x)
    assert torch.equal(scale, want_scale)
    got, want = codes.float().cpu(), want_codes.float().cpu()
    if device == "cpu":
        # Triton's interpreter converts to e4m3 its own way: ties away from zero, and a
        # value that rounds up into the next binade to half of it (126.9 -> 64, not 128).
        # Its codes are at most one e4m3 step (2^-3 of the value) from torch's, or that
        # half; the GPU converts to nearest even and matches exactly.
        step = (got - want).abs() <= 2 ** -3 * want.abs()
        assert (step | (got * 2 == want)).all()
    else:
        assert torch.equal(got, want)
    empty_codes, empty_scale = triton_on(device, tq.quantize_fp8_rows_triton)(x[:0])
    assert empty_codes.shape == (0, 2500) and empty_scale.shape == (0, 1)


def test_scaled_mm_path_survives_a_row_kernel_that_fails(monkeypatch):
    # The GPU path with _scaled_mm and the Triton row quantizer stood in for on the CPU:
    # a row quantizer that raises is turned off with a warning, and x quantized by torch.
    def row_kernel(x):
        raise RuntimeError("compile failed")

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)

    monkeypatch.setattr(tq, "has_fp8_units", lambda device: True)
    monkeypatch.setattr(tq, "quantize_fp8_rows_triton", row_kernel)
    monkeypatch.setattr(tq, "_ROW_KERNEL", {"usable": True})
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    weight_fp8, scale = tq.quantize_fp8(torch.randn(16, 64, generator=_gen(20)))
    x = torch.randn(3, 64, generator=_gen(21)).bfloat16()
    with pytest.warns(RuntimeWarning, match="Triton row quantizer failed"):
        out = tq.fp8_linear(x, weight_fp8, scale)
    assert tq._ROW_KERNEL == {"usable": False}
    torch.testing.assert_close(out, tq.fp8_linear_reference(x, weight_fp8, scale))
