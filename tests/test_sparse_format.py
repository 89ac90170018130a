"""fusegen's sparse weight format (kernels/sparse_format.py, issue 32): exact bitmaps,
offsets and packed values against a direct loop over the tiles, round trips over odd
shapes, empty and fully dense tiles, int8 scales and codes, the byte count, and check()
refusing each corruption by name."""
import pytest
import torch
from safetensors.torch import load, save

from fusegen.kernels import sparse_format as sf

SHAPES = [(1, 1), (65, 130), (64, 64), (3, 200), (130, 65), (128, 192), (200, 3)]
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def pruned(out_features, in_features, sparsity=0.7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    keep = torch.rand(out_features, in_features, generator=gen) >= sparsity
    return w * keep


def loop_encode(w):
    """The format written out as the contract states it, one bit and value at a time."""
    out_features, in_features = w.shape
    n_to, n_ti = -(-out_features // 64), -(-in_features // 64)
    words, values, offsets = [], [], [0]
    for to in range(n_to):
        for ti in range(n_ti):
            for c in range(64):
                word = 0
                for j in range(64):
                    o, k = 64 * to + j, 64 * ti + c
                    if o < out_features and k < in_features and w[o, k] != 0:
                        word |= 1 << j
                        values.append(float(w[o, k]))
                words.append(word)
            offsets.append(len(values))
    return words, values, offsets


def words_of(tiles):
    return [int(v) & (2**64 - 1) for v in tiles.bitmap.view(torch.int64).flatten()]


@pytest.mark.parametrize("shape", [(65, 130), (3, 70), (1, 1)])
def test_layout_matches_the_contract_bit_for_bit(shape):
    w = pruned(*shape, sparsity=0.5)
    tiles = sf.encode(w, torch.float32)
    words, values, offsets = loop_encode(w)
    assert tiles.bitmap.dtype == torch.uint64 and tiles.bitmap.shape == (len(offsets) - 1, 64)
    assert words_of(tiles) == words
    assert tiles.offsets.tolist() == offsets
    assert tiles.values.tolist() == values


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_exact_in_the_values_dtype(shape, dtype):
    w = pruned(*shape).to(dtype)
    tiles = sf.encode(w, dtype)
    sf.check(tiles, *shape)
    assert tiles.values.dtype == dtype and tiles.scales is None
    assert tiles.nnz == int((w != 0).sum())
    assert torch.equal(sf.decode(tiles), w.float())


@pytest.mark.parametrize("shape", [(65, 130), (200, 3), (130, 65)], ids=str)
def test_decode_rows_gives_each_band_of_row_tiles(shape):
    w = pruned(*shape)
    tiles = sf.encode(w, "float32")
    out_features = shape[0]
    for start in range(0, out_features, 64):
        for stop in [*range(start + 64, out_features, 64), out_features]:
            assert torch.equal(sf.decode_rows(tiles, start, stop), w[start:stop])
    for start, stop in [(1, 64), (0, 63), (64, 64), (-64, 64), (0, out_features + 1)]:
        if stop == out_features and start == 0:
            continue
        with pytest.raises(ValueError, match="whole row-tiles"):
            sf.decode_rows(tiles, start, stop)


def test_empty_and_fully_dense_tiles():
    w = torch.randn(130, 192)
    w[:64, 64:128] = 0                                   # tile (0, 1) empty
    w[64:128, :64] = w[64:128, :64].abs() + 1            # tile (1, 0) = 3: kept whole
    w[128:, 128:] = 0                                    # an empty edge tile (2, 2)
    for dtype in ("bfloat16", "int8"):
        tiles = sf.encode(w, dtype)
        sf.check(tiles, 130, 192)
        counts = (tiles.offsets[1:] - tiles.offsets[:-1]).tolist()
        assert counts[1] == 0 and counts[8] == 0
        assert words_of(tiles)[64:128] == [0] * 64
        assert counts[3] == 4096
        assert words_of(tiles)[3 * 64:4 * 64] == [2**64 - 1] * 64
        assert counts[6] == 2 * 64                        # edge tile: 2 rows x 64 columns
        assert words_of(tiles)[6 * 64] == 0b11
        if dtype == "int8":
            assert float(tiles.scales[1]) == 0.0 and float(tiles.scales[8]) == 0.0
        else:
            assert torch.equal(sf.decode(tiles) == 0, w == 0)


def test_all_zero_weight_has_no_values():
    tiles = sf.encode(torch.zeros(70, 70), "int8")
    sf.check(tiles, 70, 70)
    assert tiles.nnz == 0 and tiles.offsets.tolist() == [0] * 5
    assert torch.equal(tiles.scales, torch.zeros(4))
    assert torch.equal(sf.decode(tiles), torch.zeros(70, 70))


def test_int8_scales_and_codes():
    w = pruned(65, 130, sparsity=0.6, seed=3)
    w[0, 0], w[0, 1] = 1e-6, -1e-6                        # kept, but rounds to code 0
    tiles = sf.encode(w, torch.int8)
    sf.check(tiles, 65, 130)
    assert tiles.values.dtype == torch.int8 and tiles.scales.dtype == torch.float32
    words, values, offsets = loop_encode(w)
    assert words_of(tiles) == words                        # the mask is never changed
    expected_scales, expected_codes = [], []
    for t in range(len(offsets) - 1):
        kept = torch.tensor(values[offsets[t]:offsets[t + 1]], dtype=torch.float32)
        scale = kept.abs().max() / 127 if kept.numel() else torch.tensor(0.0)
        expected_scales.append(float(scale))
        if kept.numel():
            expected_codes += torch.round(kept / scale).clamp(-127, 127).to(torch.int8).tolist()
    assert tiles.scales.tolist() == expected_scales
    assert tiles.values.tolist() == expected_codes
    first_of_column_1 = bin(words[0]).count("1")          # column 0's values come first
    assert tiles.values[0] == 0 and tiles.values[first_of_column_1] == 0
    assert words[0] & 1 and words[1] & 1
    assert int(tiles.values.abs().max()) == 127
    dense = sf.decode(tiles)
    per_row_scale = tiles.scales.view(2, 3).repeat_interleave(64, 0)[:65]
    bound = per_row_scale.repeat_interleave(64, 1)[:, :130] / 2
    assert ((dense - w).abs() <= bound * (1 + 1e-6)).all()


def test_int8_rounds_half_to_even():
    w = torch.zeros(1, 4)
    w[0] = torch.tensor([127.0, 2.5, 3.5, -2.5])          # scale 1: ties at 2.5, 3.5
    tiles = sf.encode(w, "int8")
    assert float(tiles.scales[0]) == 1.0
    assert tiles.values.tolist() == [127, 2, 4, -2]


@pytest.mark.parametrize("dtype,size", [("bfloat16", 2), ("float16", 2), ("float32", 4),
                                        ("int8", 1)])
def test_nbytes_is_exact(dtype, size):
    tiles = sf.encode(pruned(130, 200), dtype)            # 3 x 4 tiles
    scales = 4 * 12 if dtype == "int8" else 0
    assert sf.nbytes(tiles) == tiles.nnz * size + 512 * 12 + 8 * 12 + 8 + scales


def test_checkpoint_tensors_round_trip_through_safetensors():
    w = pruned(65, 130)
    for dtype in ("bfloat16", "int8"):
        tiles = sf.encode(w, dtype)
        found = load(save(sf.tensors("model.layers.0.mlp.up_proj.weight", tiles)))
        back = sf.from_tensors("model.layers.0.mlp.up_proj.weight", found, 65, 130)
        assert torch.equal(sf.decode(back), sf.decode(tiles))
        assert ("model.layers.0.mlp.up_proj.weight.sparse_scales" in found) == (dtype == "int8")
    del found["model.layers.0.mlp.up_proj.weight.sparse_offsets"]
    with pytest.raises(ValueError, match="up_proj.weight: sparse weight without its "
                                         "sparse_offsets"):
        sf.from_tensors("model.layers.0.mlp.up_proj.weight", found, 65, 130)


def test_encode_refuses_bad_input():
    with pytest.raises(ValueError, match="'int4' is not one of"):
        sf.encode(torch.ones(2, 2), "int4")
    with pytest.raises(ValueError, match=r"2-D weight .* got shape \(4,\)"):
        sf.encode(torch.ones(4), "float32")
    with pytest.raises(ValueError, match=r"got shape \(0, 4\)"):
        sf.encode(torch.ones(0, 4), "float32")
    with pytest.raises(ValueError, match="floating-point weight, got torch.int64"):
        sf.encode(torch.ones(2, 2, dtype=torch.int64), "float32")


def corrupt(tiles, **changes):
    fields = dict(bitmap=tiles.bitmap.clone(), offsets=tiles.offsets.clone(),
                  values=tiles.values.clone(),
                  scales=None if tiles.scales is None else tiles.scales.clone(),
                  out_features=tiles.out_features, in_features=tiles.in_features)
    fields.update(changes)
    return sf.SparseTiles(**fields)


def with_word(bitmap, index, word):
    words = bitmap.view(torch.int64).clone()
    words.view(-1)[index] = word
    return words.view(torch.uint64)


def test_check_refuses_each_corruption_by_name():
    w = pruned(65, 130, sparsity=0.5)                     # 2 x 3 tiles
    good = sf.encode(w, "bfloat16")
    good8 = sf.encode(w, "int8")
    offsets = good.offsets
    swapped = offsets.clone()
    swapped[2] = offsets[3] + 1
    short = offsets.clone()
    short[1:] -= 1
    short[0] = 0
    shifted = offsets.clone()
    shifted[0] = 1
    cases = [
        (corrupt(good, bitmap=good.bitmap[:5]), r"sparse_bitmap: expected torch.uint64 of "
         r"shape \[6, 64\], got torch.uint64 of shape \[5, 64\]"),
        (corrupt(good, bitmap=good.bitmap.view(torch.int64)), "sparse_bitmap: expected "
         "torch.uint64"),
        (corrupt(good, offsets=offsets.int()), r"sparse_offsets: expected torch.int64 of "
         r"shape \[7\], got torch.int32"),
        (corrupt(good, offsets=offsets[:-1]), "sparse_offsets: expected .* got .* shape "
         r"\[6\]"),
        (corrupt(good, values=good.values.view(1, -1)), "sparse_values: expected a 1-D"),
        (corrupt(good, values=good.values.to(torch.float64)), "sparse_values: .* got "
         "torch.float64"),
        (corrupt(good, offsets=shifted), r"offsets\[0\] is 1, expected 0"),
        (corrupt(good, offsets=swapped), r"sparse_offsets: not monotone at tile 2"),
        (corrupt(good, offsets=short), "sparse_offsets: tile 0 spans .* values but its "
         "bitmap sets .* bits"),
        (corrupt(good, values=good.values[:-1]), r"sparse_values: \d+ values, but the "
         r"offsets and bitmaps count nnz = \d+"),
        # row-tile 1 holds one row (65 = 64 + 1): bit 1 is past the edge
        (corrupt(good, bitmap=with_word(good.bitmap, 3 * 64 + 5, 0b10)), r"sparse_bitmap: "
         r"tile 3 \(row-tile 1, column-tile 0\) column 5 sets bits past the matrix's edge"),
        # column-tile 2 holds two columns (130 = 128 + 2): column 2 is past the edge
        (corrupt(good, bitmap=with_word(good.bitmap, 2 * 64 + 2, 1)), r"tile 2 \(row-tile "
         r"0, column-tile 2\) column 2 sets bits past"),
        (corrupt(good8, scales=None), "sparse_scales: missing"),
        (corrupt(good8, scales=good8.scales[:5]), r"sparse_scales: expected torch.float32 "
         r"of shape \[6\]"),
        (corrupt(good8, scales=good8.scales.double()), "sparse_scales: expected torch.float32"),
        (corrupt(good8, scales=good8.scales.index_fill(0, torch.tensor([4]), -1.0)),
         r"sparse_scales: tile 4 has scale -1.0"),
        (corrupt(good8, scales=good8.scales.index_fill(0, torch.tensor([1]), float("nan"))),
         r"sparse_scales: tile 1 has scale nan"),
        (corrupt(good, scales=good8.scales), "sparse_scales: present with torch.bfloat16"),
        (corrupt(good, out_features=64), r"describe a weight \[64, 130\], expected \[65, 130\]"),
    ]
    for tiles, message in cases:
        with pytest.raises(ValueError, match=message):
            sf.check(tiles, 65, 130)
    sf.check(good, 65, 130)
    sf.check(good8, 65, 130)


def test_check_finds_a_popcount_mismatch_in_a_later_tile():
    good = sf.encode(pruned(130, 130, sparsity=0.5), "float32")
    words = good.bitmap.view(torch.int64).clone()
    words[3, 7] ^= 1 << 4                                # one bit more or less in tile 3
    with pytest.raises(ValueError, match="sparse_offsets: tile 3 spans"):
        sf.check(corrupt(good, bitmap=words.view(torch.uint64)), 130, 130)
