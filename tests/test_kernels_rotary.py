"""Rotary embedding: the reference against Hugging Face's apply_rotary_pos_emb bit for
bit, and the in-place Triton kernel (interpreter on CPU, compiled on CUDA) against the
reference."""
import math

import pytest
import torch

from fusegen.kernels.rotary import rotary_embedding, rotary_embedding_reference, rotary_embedding_triton
from fusegen.kernels.testing import triton_on

pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def _tables(max_positions, rotary_dim, base=10000.0):
    # Half-width fp32 tables, as Hugging Face computes the angles.
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq
    return freqs.cos(), freqs.sin()


def _qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device="cpu"):
    # q and k as views into one fused qkv projection output (strided tokens).
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    qkv = qkv.to(device)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim]
    return q, k.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_hugging_face(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    cos, sin = _tables(64, 32)
    positions = torch.tensor([0, 5, 63, 5, 17])
    q, k = _qk(5, 4, 2, 32, dtype)
    full_cos = torch.cat([cos, cos], -1)[positions].to(dtype)  # HF's [T, D] in x's dtype
    full_sin = torch.cat([sin, sin], -1)[positions].to(dtype)
    expected_q, expected_k = llama.apply_rotary_pos_emb(q, k, full_cos, full_sin)
    rotary_embedding_reference(positions, q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim,rotary_dim", [
    (1, 2, 1, 32, 32), (13, 6, 3, 64, 64), (4, 4, 4, 96, 64)])
def test_triton_matches_reference(num_tokens, heads, kv_heads, head_dim, rotary_dim, dtype,
                                  device):
    cos, sin = _tables(100, rotary_dim)
    positions = torch.randint(0, 100, (num_tokens,), generator=torch.Generator().manual_seed(2))
    positions[0] = 99
    q, k = _qk(num_tokens, heads, kv_heads, head_dim, dtype)
    expected_q, expected_k = q.clone(), k.clone()
    rotary_embedding_reference(positions, expected_q, expected_k, cos, sin)
    q, k = q.to(device), k.to(device)
    to = lambda t: t.to(device)  # noqa: E731
    triton_on(device, rotary_embedding_triton)(to(positions), q, k, to(cos), to(sin))
    # Every product and sum rounded as torch rounds it, on a GPU too (no fused
    # multiply-adds): bit for bit.
    assert torch.equal(q.cpu(), expected_q) and torch.equal(k.cpu(), expected_k)
    original_q = _qk(num_tokens, heads, kv_heads, head_dim, dtype)[0]
    assert not torch.equal(q[..., :rotary_dim].cpu(), original_q[..., :rotary_dim])
    assert torch.equal(q[..., rotary_dim:].cpu(), original_q[..., rotary_dim:])  # pass-through


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_dispatcher_uses_triton_at_model_shape():
    cos, sin = _tables(4096, 128)
    positions = torch.randint(0, 4096, (77,), device="cuda")
    q, k = _qk(77, 32, 8, 128, torch.bfloat16, "cuda")
    expected_q, expected_k = q.clone(), k.clone()
    rotary_embedding_reference(positions, expected_q, expected_k, cos.cuda(), sin.cuda())
    rotary_embedding(positions, q, k, cos.cuda(), sin.cuda())
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert math.isfinite(q.float().abs().max().item())
