"""The C row-wise kernels for CPUs (kernels/csrc/elementwise.c) against the torch
references: RMSNorm with and without the residual add, SiLU-mul, rotary in place."""
import pytest
import torch

from fusegen.kernels import native
from fusegen.kernels.rms_norm import rms_norm, rms_norm_native, rms_norm_reference
from fusegen.kernels.rotary import rotary_embedding_native, rotary_embedding_reference
from fusegen.kernels.silu_mul import silu_and_mul_native, silu_and_mul_reference

if native.library() is None:
    pytest.fail("the CPU kernels did not build here; see the warning above", pytrace=False)

TOL = dict(atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("rows, hidden", [(0, 64), (1, 64), (37, 512), (300, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows + hidden)
    # A strided view for x: rows of a wider buffer, as a slice of a projection is.
    x = torch.randn(rows, hidden + 7, generator=gen)[:, :hidden]
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    weight = torch.randn(hidden, generator=gen)
    got = rms_norm_native(x, weight, 1e-5, residual)
    want = rms_norm_reference(x, weight, 1e-5, residual)
    if with_residual:
        torch.testing.assert_close(got[0], want[0], **TOL)
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the add is exact
    else:
        torch.testing.assert_close(got, want, **TOL)


def test_rms_norm_keeps_leading_dimensions_and_dispatches():
    x, weight = torch.randn(2, 3, 16), torch.randn(16)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, 1e-6), **TOL)


@pytest.mark.parametrize("rows, inter", [(0, 8), (1, 8), (129, 1536), (5, 100)])
def test_silu_mul_matches_reference(rows, inter):
    x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    torch.testing.assert_close(silu_and_mul_native(x), silu_and_mul_reference(x), **TOL)


@pytest.mark.parametrize("hq, hkv, d, half", [(8, 4, 64, 32), (4, 1, 32, 8), (6, 2, 80, 40)])
def test_rotary_matches_reference_in_place(hq, hkv, d, half):
    gen = torch.Generator().manual_seed(d)
    tokens, positions = 9, torch.tensor([0, 5, 1, 127, 3, 3, 64, 2, 100])
    # q and k as views of one fused projection, as the model hands them over.
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen)
    table = torch.randn(128, 2 * half, generator=gen)
    cos, sin = table.chunk(2, dim=-1)  # row stride 2 * half, as the model's table
    want_q = qkv[:, :hq * d].reshape(tokens, hq, d).clone()
    want_k = qkv[:, hq * d:(hq + hkv) * d].reshape(tokens, hkv, d).clone()
    rotary_embedding_reference(positions, want_q, want_k, cos, sin)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    rotary_embedding_native(positions, q, k, cos, sin)
    torch.testing.assert_close(q, want_q, **TOL)
    torch.testing.assert_close(k, want_k, **TOL)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched


def test_rotary_refuses_positions_outside_the_table():
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    cos, sin = torch.randn(8, 8).chunk(2, dim=-1)
    with pytest.raises(IndexError, match="positions 3..8 outside the rotary table's 8 rows"):
        rotary_embedding_native(torch.tensor([3, 8]), q, k, cos, sin)
