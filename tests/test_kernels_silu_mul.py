"""silu_and_mul: the Triton kernel (interpreter on CPU, compiled on CUDA) against the
torch reference, which is Hugging Face Llama's act_fn(gate) * up."""
import pytest
import torch
import torch.nn.functional as F

from fusegen.kernels.silu_mul import silu_and_mul, silu_and_mul_reference, silu_and_mul_triton
from fusegen.kernels.testing import triton_on

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def test_reference_is_silu_gate_times_up():
    gate, up = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_reference(torch.cat([gate, up], -1)), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (5, 14), (3, 2, 2600)], ids=str)
def test_triton_matches_reference(shape, dtype, device):
    # 2600 = 2 x 1300: two 1024-wide blocks per row, the second one ragged.
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype).to(device)
    out = triton_on(device, silu_and_mul_triton)(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_reference(x))


@pytest.mark.parametrize("device", DEVICES)
def test_triton_strided_rows(device):
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(1)).to(device)[:, 4:36]
    torch.testing.assert_close(triton_on(device, silu_and_mul_triton)(x),
                               F.silu(x[:, :16]) * x[:, 16:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_dispatcher_uses_triton_at_model_width():
    x = torch.randn(33, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x))
