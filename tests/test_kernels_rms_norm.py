"""RMSNorm: the reference against Hugging Face's LlamaRMSNorm bit for bit, and the
Triton kernel (interpreter on CPU, compiled on CUDA) against the reference."""
import pytest
import torch

from fusegen.kernels.rms_norm import rms_norm, rms_norm_reference, rms_norm_triton
from fusegen.kernels.testing import triton_on

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    residual = torch.randn(shape, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_matches_hugging_face(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    x, residual, weight = _inputs((5, 96), dtype)
    norm = llama.LlamaRMSNorm(96, eps=1e-6).to(dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        assert torch.equal(rms_norm_reference(x, weight, 1e-6), norm(x))
        out, h = rms_norm_reference(x, weight, 1e-6, residual)
        assert torch.equal(h, x + residual) and torch.equal(out, norm(x + residual))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (3, 5, 200)], ids=str)
def test_triton_matches_reference(shape, dtype, device):
    x, residual, weight = _inputs(shape, dtype, device)
    out = triton_on(device, rms_norm_triton)(x, weight, 1e-5)
    assert out.shape == shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), rms_norm_reference(x, weight, 1e-5).cpu())
    out, h = triton_on(device, rms_norm_triton)(x, weight, 1e-5, residual)
    expected, expected_h = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(h, expected_h)  # one rounding of an exact sum: bit for bit
    torch.testing.assert_close(out.cpu(), expected.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_triton_strided_rows(device):
    # Rows of a wider buffer (row stride 300, not 200), as a slice of a fused output.
    x, residual, weight = _inputs((6, 300), torch.bfloat16, device)
    x, residual, weight = x[:, :200], residual[:, 50:250], weight[:200]
    out, h = triton_on(device, rms_norm_triton)(x, weight, 1e-6, residual)
    expected, expected_h = rms_norm_reference(x, weight, 1e-6, residual)
    assert torch.equal(h, expected_h)
    torch.testing.assert_close(out, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_dispatcher_uses_triton_at_model_width():
    x, residual, weight = _inputs((33, 8192), torch.bfloat16, "cuda")
    out, h = rms_norm(x, weight, 1e-5, residual)
    expected, expected_h = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(h, expected_h)
    torch.testing.assert_close(out, expected)
