"""x @ W.T on a weight kept in sparse tiles (kernels/sparse_linear.py,
kernels/csrc/sparse_tiles.c, format in kernels/sparse_format.py): the C kernel against
the dense fp32 product over odd shapes, tails, row counts from 0 to 256 (the few-row path
up to 6 rows, the many-row path's scratch above, in one run of tiles or several for long
rows), empty and fully dense tiles and every value type; each row's bits the same alone
or in any batch and on 1 to 3 threads; the AVX-512 (without VBMI2), AVX2 and baseline
builds giving the native build's bits (but bf16 x against bf16 or int8 values by
vdpbf16ps); a fused parameter's parts in one call or written in place; the dispatcher and
the torch path."""
import pytest
import torch

from quant_helpers import assert_close, build_for_other_cpu
from fusegen.kernels import sparse_format as sf
from fusegen.kernels import sparse_linear as sl

VALUE_TYPES = ["bfloat16", "float16", "float32", "int8"]
SHAPES = [(1, 1), (65, 130), (130, 65), (200, 3), (64, 64), (3, 200)]
ROWS = [0, 1, 6, 7, 16, 256]  # few-row path up to MR = 6 rows, the many-row path above
LONG = (70, 2101)  # more columns than one run of the many-row path's scratch (1024 / 2048)
# another CPU's build of the kernel file, and the paths it reports (sparse_tiles_available)
OTHER_BUILDS = [(["-march=x86-64", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],
                 1 | 2), (["-march=x86-64-v3"], 1 | 8), (["-march=x86-64"], 1)]
OTHER_IDS = ["avx512-without-vbmi2", "avx2", "baseline"]

needs_kernel = pytest.mark.skipif(not sl.has_kernel(), reason="no C kernels in this build")


def pruned_tiles(out_features, in_features, values, sparsity=0.7, seed=0):
    """Tiles of a random weight with `sparsity` of its entries zero, and the dense fp32
    weight they decode to (the product's ground truth)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    w = w * (torch.rand(out_features, in_features, generator=gen) >= sparsity)
    tiles = sf.encode(w, values)
    return tiles, sf.decode(tiles)


def by_pairs(values, dtype):
    """Whether the native build multiplies bf16 x and bf16 (or int8) values two channels at
    a time by vdpbf16ps: its own fixed order, other bits than the FMA paths' (plain C,
    other CPUs)."""
    bit = {"bfloat16": 16, "int8": 32}.get(values, 0)
    return bool(sl.kernel_paths() & bit) and dtype == torch.bfloat16


def rows_of(count, in_features, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(count, in_features, generator=gen).to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("values", VALUE_TYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_dense_product(shape, values, dtype):
    tiles, w = pruned_tiles(*shape, values)
    for count in ROWS:
        x = rows_of(count, shape[1], dtype)
        got = sl.sparse_linear_native(x, tiles)
        assert got.shape == (count, shape[0]) and got.dtype == dtype
        assert_close(got, sl.sparse_linear_reference(x, tiles), x, w)
        plain = sl.sparse_linear_native(x, tiles, plain=True)
        if by_pairs(values, dtype):
            assert_close(plain, sl.sparse_linear_reference(x, tiles), x, w)
        else:
            assert torch.equal(plain, got)


@needs_kernel
@pytest.mark.parametrize("values", VALUE_TYPES)
def test_empty_and_fully_dense_tiles(values):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(150, 200, generator=gen)
    w[:64, 64:128] = 0                                  # an empty tile
    w[64:128, :64] = w[64:128, :64].abs() + 0.5          # a fully dense tile
    w[128:, 128:] = 0                                    # an empty edge tile
    w[64:128, 128:192] *= torch.rand(64, 64, generator=gen) >= 0.9
    tiles = sf.encode(w, values)
    counts = (tiles.offsets[1:] - tiles.offsets[:-1]).tolist()
    assert counts[1] == 0 and counts[4] == 4096 and counts[11] == 0
    for dtype in (torch.float32, torch.bfloat16):
        x = rows_of(17, 200, dtype)
        got = sl.sparse_linear_native(x, tiles)
        assert_close(got, sl.sparse_linear_reference(x, tiles), x, sf.decode(tiles))
        assert torch.equal(sl.sparse_linear_native(x[:1], tiles), got[:1])  # few-row path
        zero = sf.encode(torch.zeros(70, 90), values)    # no values at all
        for count in (1, 17):
            assert torch.equal(sl.sparse_linear_native(x[:count, :90], zero),
                               torch.zeros(count, 70, dtype=dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("values", VALUE_TYPES)
@pytest.mark.parametrize("shape", [(330, 260), LONG], ids=str)
def test_each_row_is_the_same_alone_in_a_batch_and_on_any_thread_count(shape, values, dtype):
    """Row r's bits are the same whether it runs alone (few-row path), in batches of 2 to
    37 rows (either path) and on 1, 2 or 3 threads."""
    tiles, w = pruned_tiles(*shape, values, sparsity=0.5, seed=2)
    x = rows_of(37, shape[1], dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(sl.sparse_linear_native(x, tiles))
            alone = torch.cat([sl.sparse_linear_native(x[r:r + 1], tiles) for r in range(37)])
            assert torch.equal(alone, results[-1])
            for start, stop in ((5, 22), (0, 6), (30, 37), (3, 5), (1, 17)):
                assert torch.equal(sl.sparse_linear_native(x[start:stop], tiles),
                                   results[-1][start:stop])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    assert_close(results[0], sl.sparse_linear_reference(x, tiles), x, w)
    if not by_pairs(values, dtype):
        assert torch.equal(sl.sparse_linear_native(x, tiles, plain=True), results[0])


@pytest.mark.parametrize("flags,paths", OTHER_BUILDS, ids=OTHER_IDS)
def test_other_cpu_builds_give_the_same_bits(flags, paths, tmp_path):
    lib = build_for_other_cpu("sparse_tiles.c", flags, tmp_path,
                              ("sparse_tiles_available", "sparse_tiles"))
    assert lib.sparse_tiles_available() == paths
    for values, shape, counts in [(v, s, c) for v in VALUE_TYPES for s, c in
                                  (((130, 200), (1, 6, 7, 17)), (LONG, (1, 9)))]:
        tiles, w = pruned_tiles(*shape, values, seed=3)
        for dtype in (torch.float32, torch.bfloat16):
            for count in counts:
                x = rows_of(count, shape[1], dtype)
                got = sl.sparse_linear_native(x, tiles, lib=lib)
                assert_close(got, sl.sparse_linear_reference(x, tiles), x, w)
                assert torch.equal(sl.sparse_linear_native(x, tiles, plain=True, lib=lib), got)
                if sl.has_kernel() and not by_pairs(values, dtype):
                    assert torch.equal(sl.sparse_linear_native(x, tiles), got)
        # the weight and a 1-row part in one call, their bands split among 2 threads
        one, _ = pruned_tiles(1, shape[1], values, seed=4)
        x = rows_of(2, shape[1], torch.bfloat16)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            got = sl.sparse_linear_native(x, [tiles, one], lib=lib)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(got, torch.cat([sl.sparse_linear_native(x, t, lib=lib)
                                           for t in (tiles, one)], dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("values", ["bfloat16", "int8"])
def test_parts_write_their_columns_of_one_output_in_place(values, dtype):
    """A fused parameter's parts (70, 64 and 1 output rows) each write their columns of
    one [T, 135] output (a column slice: row stride 135), the bits of each part's own
    product, nothing outside its columns."""
    parts = [pruned_tiles(n, 150, values, seed=6 + i)[0] for i, n in enumerate((70, 64, 1))]
    for count in (1, 16):
        x = rows_of(count, 150, dtype)
        out = torch.full((count, 135), 7.0, dtype=dtype)
        start = 0
        for tiles in parts:
            stop = start + tiles.out_features
            sl.sparse_linear_into(x, tiles, out[:, start:stop])
            want = sl.sparse_linear(x, tiles)
            assert torch.equal(out[:, start:stop], want)
            assert (out[:, stop:] == 7.0).all()
            start = stop
    with pytest.raises(ValueError, match=r"out \[T, 70\] of x's dtype and device, got x "
                                         r"\[16, 150\] .* out \[16, 69\]"):
        sl.sparse_linear_into(x, parts[0], out[:, :69])


@needs_kernel
@pytest.mark.parametrize("in_features", [150, 151])  # odd: bf16 pairs from a padded copy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("values", VALUE_TYPES)
def test_parts_in_one_call_on_any_thread_count(values, dtype, in_features):
    """A fused parameter's parts (100, 1 and 64 output rows: 4 bands, one of 36 rows and
    one of 1) in one kernel call, their bands split among the threads as one list: each
    part's columns hold the bits of its own product for 1 to 6 rows (the few-row path) and
    7 (the many-row path) on 1 to 4 threads."""
    parts = [pruned_tiles(n, in_features, values, seed=6 + i)[0]
             for i, n in enumerate((100, 1, 64))]
    x = rows_of(7, in_features, dtype)
    want = torch.cat([sl.sparse_linear_native(x, t) for t in parts], dim=1)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            for rows in (1, 2, 6, 7):
                got = sl.sparse_linear_parts(x[:rows], parts)
                assert got.shape == (rows, 165) and torch.equal(got, want[:rows])
                alone = sl.sparse_linear_native(x[:rows], parts[0])  # 2 bands alone
                assert torch.equal(alone, want[:rows, :100])
                if not by_pairs(values, dtype):
                    assert torch.equal(sl.sparse_linear_native(x[:rows], parts, plain=True),
                                       want[:rows])
    finally:
        torch.set_num_threads(threads)
    for t, (start, stop) in zip(parts, ((0, 100), (100, 101), (101, 165))):
        assert_close(want[:, start:stop], sl.sparse_linear_reference(x, t), x, sf.decode(t))


def test_parts_refused_by_name():
    a, _ = pruned_tiles(65, 130, "float32")
    b, _ = pruned_tiles(65, 131, "float32")
    with pytest.raises(ValueError, match="parts of in_features 130 and 131"):
        sl.sparse_linear_parts(torch.zeros(2, 130), [a, b])
    with pytest.raises(ValueError, match="at least one part"):
        sl.sparse_linear_parts(torch.zeros(2, 130), [])
    with pytest.raises(ValueError, match=r"takes rows \[T, in\], got \[1, 2, 130\]"):
        sl.sparse_linear_parts(torch.zeros(1, 2, 130), [a])
    fp16 = torch.randn(3, 130).half()                        # the torch path, part by part
    assert torch.equal(sl.sparse_linear_parts(fp16, [a, a]),
                       torch.cat([sl.sparse_linear(fp16, a)] * 2, dim=1))


@pytest.mark.parametrize("values", VALUE_TYPES)
def test_torch_path_expands_bands_and_matches_the_reference(values, monkeypatch):
    tiles, w = pruned_tiles(300, 70, values, seed=4)        # two bands of BAND_ROWS
    calls = []
    real = sf.decode_rows
    monkeypatch.setattr(sl, "decode_rows", lambda t, a, b: calls.append((a, b)) or real(t, a, b))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = rows_of(9, 70, dtype)
        got = sl.sparse_linear_torch(x, tiles)
        assert got.dtype == dtype
        assert_close(got, sl.sparse_linear_reference(x, tiles), x, w)
    assert set(calls) == {(0, 256), (256, 300)}


def test_dispatcher_shapes_dtypes_and_modes(monkeypatch):
    tiles, w = pruned_tiles(65, 130, "bfloat16")
    x = rows_of(6, 130, torch.bfloat16).view(2, 3, 130)
    got = sl.sparse_linear(x, tiles)
    assert got.shape == (2, 3, 65) and got.dtype == torch.bfloat16
    if sl.has_kernel():
        assert torch.equal(got.view(6, 65), sl.sparse_linear_native(x.view(6, 130), tiles))
    fp16 = sl.sparse_linear(x.half(), tiles)                # the torch path
    assert fp16.dtype == torch.float16
    assert torch.equal(fp16, sl.sparse_linear_torch(x.half(), tiles))
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    assert torch.equal(sl.sparse_linear(x, tiles), sl.sparse_linear_torch(x, tiles))
    assert sl.sparse_linear(x[:0], tiles).shape == (0, 3, 65)


def test_bad_x_is_refused_by_name():
    tiles, _ = pruned_tiles(65, 130, "float32")
    with pytest.raises(ValueError, match=r"x of shape \[4, 129\] .* \[65, 130\]: .* "
                                         r"in_features = 130"):
        sl.sparse_linear(torch.zeros(4, 129), tiles)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16 x, got torch.int32"):
        sl.sparse_linear(torch.zeros(4, 130, dtype=torch.int32), tiles)
    with pytest.raises(ValueError, match=r"takes rows \[T, in\]"):
        sl.sparse_linear_native(torch.zeros(1, 4, 130), tiles)
    if sl.has_kernel():
        with pytest.raises(RuntimeError, match="no C sparse tile kernel for torch.float16"):
            sl.sparse_linear_native(torch.zeros(4, 130, dtype=torch.float16), tiles)
