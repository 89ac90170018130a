"""The greedy sampler's argmax kernel (kernels/csrc/argmax.c): torch's answer exactly,
the first index on ties."""
import pytest
import torch

from fusegen.kernels import native
from fusegen.kernels.argmax import argmax, argmax_native

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler here")


@pytest.mark.parametrize("rows, cols", [(1, 1), (1, 7), (5, 33), (125, 32000), (3, 151936)])
def test_equals_torch(rows, cols):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    assert torch.equal(argmax_native(x), x.argmax(dim=-1))


def test_ties_take_the_first_index():
    x = torch.randint(0, 3, (64, 1000), generator=torch.Generator().manual_seed(0)).float()
    x[0] = 2.0  # the whole row ties
    got = argmax_native(x)
    assert torch.equal(got, x.argmax(dim=-1)) and got[0].item() == 0


def test_masked_logits_and_strided_rows():
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    x[:, ::2] = float("-inf")  # what top-k leaves of a row
    x[3, :299] = float("-inf")
    sliced = torch.randn(8, 400)[:, 50:350]  # rows of 300 with a stride of 400
    assert torch.equal(argmax_native(x), x.argmax(dim=-1)) and argmax_native(x)[3] == 299
    assert torch.equal(argmax_native(sliced), sliced.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 31, 448, 32000])
def test_rows_of_nothing_but_minus_infinity(dtype, cols):
    """A row a constraint masks whole: index 0, as torch gives, never past the row."""
    x = torch.full((3, cols), float("-inf"), dtype=dtype)
    x[1, cols - 1] = -1e30
    got = argmax_native(x)
    assert torch.equal(got, x.argmax(dim=-1)) and got.tolist() == [0, cols - 1, 0]


def test_dispatcher_keeps_other_dtypes_on_torch():
    x = torch.randn(4, 50).bfloat16()
    assert torch.equal(argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 31), (4, 32), (5, 33), (6, 64), (7, 65),
                                        (2, 95), (117, 32000), (2, 151936)])
def test_bf16_equals_torch(rows, cols):
    # bf16 rows take one pass over 16-bit keys on AVX-512 CPUs: every chunk boundary
    # (32 columns), an odd chunk count and a partial last chunk
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).bfloat16()
    assert torch.equal(argmax_native(x), x.argmax(dim=-1))


def test_bf16_ties_signed_zeros_and_infinities():
    x = torch.randint(-2, 3, (64, 1000), generator=torch.Generator().manual_seed(2)).bfloat16()
    x[0] = 2.0  # the whole row ties: the first index
    x[1] = -0.0
    x[1, 500:] = 0.0  # -0 and +0 compare equal: index 0, not 500
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3, 999] = float("inf")
    x[4] = -1e30
    x[4, 777] = -1e-38  # the greatest of negative values is the one nearest zero
    got = argmax_native(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[:5].tolist() == [0, 0, 0, 999, 777]


def test_bf16_strided_rows():
    x = torch.randn(8, 400, generator=torch.Generator().manual_seed(3)).bfloat16()[:, 50:350]
    assert torch.equal(argmax_native(x), x.argmax(dim=-1))
