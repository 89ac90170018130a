"""The group codes' int8 product built for an AVX2 CPU (kernels/csrc/quant_avx2.h's layer:
vpmaddubsw + vpmaddwd, 8 columns a chunk, int8 codes taken signed): the torch
reference's bits (which the AVX512_VNNI kernel gives too) for every bits / symmetric /
group size, odd shapes, row and thread counts, and codes at the ends of their range
against x's codes +-127 (vpmaddubsw's pairs at their largest: no saturation); a
baseline x86-64 build declines."""
import pytest
import torch

from fusegen.kernels import group_vnni as gv
from fusegen.kernels import native
from quant_helpers import OTHER_CPU_BUILDS, build_for_other_cpu
from test_kernels_group_quant import FORMAT_IDS, FORMATS, make_weight

NAMES = ("quant_group_q8_available", "quant_group_q8_bf16")


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    if not {"avx2", "fma", "f16c"} <= set(native._cpu_flags().split()):
        pytest.skip("this CPU cannot run an AVX2 build")
    return build_for_other_cpu("quant_group_vnni.c", OTHER_CPU_BUILDS[1][0],
                               tmp_path_factory.mktemp("avx2"), NAMES)


def call(lib, x, weight, fmt, n, k, threads=2):
    (bits, _, group_size), (qweight, scales, zeros) = fmt, weight
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    assert lib.quant_group_q8_bf16(bits, group_size, x.data_ptr(), x.shape[0], x.stride(0),
                                   qweight.data_ptr(), scales.data_ptr(),
                                   zeros.data_ptr() if zeros is not None else None, n, k,
                                   out.data_ptr(), n, threads) == 0
    return out


def reference(x, weight, fmt, n, k):
    bits, _, group_size = fmt
    return gv.group_linear_q8_reference(x, *weight, bits, group_size, n, k)


@pytest.mark.parametrize("bits,symmetric,group_size", FORMATS, ids=FORMAT_IDS)
def test_avx2_build_is_the_reference_bit_for_bit(bits, symmetric, group_size, avx2_build):
    """n = 1, 7 and 8 (within and at one chunk of 8 columns), 37 (a chunk's tail); every
    row-count form; 1 and 2 threads."""
    fmt = (bits, symmetric, group_size)
    assert avx2_build.quant_group_q8_available(bits) == 1
    for n, k in [(1, group_size), (7, 3 * group_size), (8, 128), (37, 384)]:
        weight = make_weight(bits, symmetric, group_size, n, k, seed=n + k)
        x = bf16_rows(300, k, seed=n)
        x[2] = 0
        for rows in (1, 3, 4, 5, 17, 300):
            want = reference(x[:rows], weight, fmt, n, k)
            for threads in (1, 2):
                assert torch.equal(call(avx2_build, x[:rows], weight, fmt, n, k, threads), want)


@pytest.mark.parametrize("bits,symmetric", [(8, True), (8, False), (4, True), (4, False)])
def test_codes_at_the_ends_of_their_range(bits, symmetric, avx2_build):
    fmt, n, k = (bits, symmetric, 32), 16, 64
    qweight, scales, zeros = make_weight(bits, symmetric, 32, n, k, seed=1)
    top = 255 if bits == 8 else 0xff  # int4: both nibbles 15
    qweight[:8] = top
    qweight[8:] = 0
    if zeros is not None:
        zeros[::2] = 0
    x = torch.full((3, k), 1.0).bfloat16()  # codes 127
    x[1] = -1.0  # codes -127
    x[2, 1::2] = -1.0
    weight = (qweight, scales, zeros)
    assert torch.equal(call(avx2_build, x, weight, fmt, n, k), reference(x, weight, fmt, n, k))


def test_baseline_build_declines(tmp_path):
    lib = build_for_other_cpu("quant_group_vnni.c", OTHER_CPU_BUILDS[2][0], tmp_path, NAMES)
    assert lib.quant_group_q8_available(8) == lib.quant_group_q8_available(4) == 0
    qweight, scales, _ = make_weight(8, True, 32, 1, 32)
    x, out = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)
    assert lib.quant_group_q8_bf16(8, 32, x.data_ptr(), 1, 32, qweight.data_ptr(),
                                   scales.data_ptr(), None, 1, 32, out.data_ptr(), 1, 1) == -1


def bf16_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    return (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()
