"""Weights packed on CPUs (engine/weights/packed.py): fusegen's own fp32 GEMM
(`NativeLinear`) and oneDNN's (`PackedLinear`) give the same products as the dense
`Linear`, batch-invariant (the GEMM by construction, oneDNN in row tiles), used for
resident layers only, and the engine's tokens unchanged by them. fusegen's bf16 and fp32
kernels for decode-sized calls on oneDNN's packed weight give oneDNN's result to the
bit."""
import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_hf_checkpoint
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.models.decoder import DecoderLayer
from fusegen.engine.weights.linear import Linear
import fusegen.engine.weights.packed as packed_module
from fusegen.engine.weights.packed import DP_MAX_TILE, DP_ROWS, NativeLinear, PackedLinear, \
    _dp_gemm, _native_gemm, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.float32),
                                reason="fp32 weights are not packed on this CPU")
# fp32 weights go to fusegen's GEMM on AVX2 CPUs, to oneDNN on AVX-512 ones
FP32_KIND = NativeLinear if _native_gemm() else PackedLinear


def _linear(out_features, in_features, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    linear = Linear(bias=bias)
    linear.weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    if bias:
        linear.bias = torch.randn(out_features, generator=gen)
    return linear


@pytest.mark.parametrize("shape", [(96, 64), (1024, 512), (512, 1536), (3000, 128)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 17, 130])
def test_packed_equals_the_dense_product(shape, bias, rows):
    dense = _linear(*shape, bias=bias)
    packed = PackedLinear.pack(dense, batch_hint=256)
    x = torch.randn(rows, shape[1])
    torch.testing.assert_close(packed(x), F.linear(x, dense.weight, dense.bias),
                               rtol=1e-5, atol=1e-5)
    assert packed.nbytes == dense.nbytes  # the packed copy replaces the dense one



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_shape_packed_with_other_hints_and_threads(dtype):
    # two engines of one process pack the same shapes with their own token budgets (and
    # thread counts): oneDNN may lay each out its own way, so fusegen's kernel must not
    # read one with the channel blocking found for another (tiny llama's qkv, 4 threads:
    # the 16-row packing was read with the 512-row one's blocking, every product wrong)
    if not can_pack(dtype):
        pytest.skip(f"{dtype} weights are not packed on this CPU")
    threads = torch.get_num_threads()
    dense = _linear(128, 64, seed=3)
    dense.weight = dense.weight.to(dtype)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    try:
        for num_threads, hint in [(4, 512), (4, 16), (2, 16), (2, 512), (1, 7)]:
            torch.set_num_threads(num_threads)
            packed = PackedLinear.pack(dense, batch_hint=hint)
            for rows in (1, 3, 5):
                want = torch.ops.mkldnn._linear_pointwise(x[:rows], packed.weight, None,
                                                          "none", [], "")
                assert torch.equal(packed(x[:rows]), want), (num_threads, hint, rows)
    finally:
        torch.set_num_threads(threads)

def test_packed_takes_strided_rows():
    dense = _linear(256, 64)
    packed = PackedLinear.pack(dense, batch_hint=64)
    x = torch.randn(9, 128)[:, 32:96]  # rows of 64 with a stride of 128
    torch.testing.assert_close(packed(x), F.linear(x, dense.weight), rtol=1e-5, atol=1e-5)


def test_packed_row_tiles_are_batch_invariant():
    """In deterministic mode a row's bits do not depend on its neighbours or position."""
    dense = _linear(1024, 512, bias=True)
    dense.row_tile = 64
    packed = PackedLinear.pack(dense, batch_hint=2048)
    assert packed.row_tile == 64
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 512, generator=gen)
    alone = packed(row)[0]
    for before, after in [(3, 5), (63, 0), (64, 10), (200, 77)]:
        x = torch.cat([torch.randn(before, 512, generator=gen), row,
                       torch.randn(after, 512, generator=gen)])
        assert torch.equal(packed(x)[before], alone)
    torch.testing.assert_close(alone, F.linear(row, dense.weight, dense.bias)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(96, 64), (1024, 512), (512, 1536), (3000, 1100)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 6, 17, 130])
def test_native_gemm_equals_the_dense_product(shape, bias, rows):
    # 1536 and 1100 run over more than one depth block (KC = 512), 3000 ends in a
    # partial panel of 8 columns, row counts cover partial blocks of 6 rows.
    dense = _linear(*shape, bias=bias)
    packed = NativeLinear.pack(dense)
    x = torch.randn(rows, shape[1])
    torch.testing.assert_close(packed(x), F.linear(x, dense.weight, dense.bias),
                               rtol=1e-5, atol=1e-5)
    assert packed.weight.numel() == -(-shape[0] // 16) * 16 * shape[1]


def test_native_gemm_takes_strided_and_batched_rows():
    dense = _linear(256, 64)
    packed = NativeLinear.pack(dense)
    x = torch.randn(9, 128)[:, 32:96]  # rows of 64 with a stride of 128
    torch.testing.assert_close(packed(x), F.linear(x, dense.weight), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 64).transpose(0, 1)  # [5, 2, 64], not contiguous
    torch.testing.assert_close(packed(x3), F.linear(x3, dense.weight), rtol=1e-5, atol=1e-5)


def test_native_gemm_is_batch_invariant_without_row_tiles():
    """A row's bits do not depend on its neighbours, its position or the row count."""
    dense = _linear(1000, 1100, bias=True)
    packed = NativeLinear.pack(dense)
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 1100, generator=gen)
    alone = packed(row)[0]
    for before, after in [(3, 5), (5, 0), (6, 11), (63, 0), (200, 77)]:
        x = torch.cat([torch.randn(before, 1100, generator=gen), row,
                       torch.randn(after, 1100, generator=gen)])
        assert torch.equal(packed(x)[before], alone)


@pytest.mark.parametrize("shape", [(32000, 64), (3000, 1100), (17, 32)])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_native_argmax_is_the_argmax_of_the_product(shape, rows):
    from fusegen.kernels.argmax import argmax_native

    dense = _linear(*shape, bias=True)
    packed = NativeLinear.pack(dense)
    x = torch.randn(rows, 256)[:, :shape[1]] if shape[1] < 256 else torch.randn(rows, shape[1])
    assert torch.equal(packed.argmax(x), argmax_native(packed(x)))


def test_native_argmax_keeps_the_first_column_on_ties():
    # Duplicated weight rows give equal logits in columns far apart (in different
    # panels, and on different threads for the 4,000 columns).
    dense = _linear(4000, 32)
    dense.weight[3990] = dense.weight[5] = dense.weight[2001] = 10 * dense.weight[5]
    packed = NativeLinear.pack(dense)
    x = dense.weight[5:6] / dense.weight[5].norm()  # scores highest on rows 5, 2001, 3990
    assert packed.argmax(x).tolist() == [5]


def test_a_packed_weight_cannot_be_repointed():
    for packed in (PackedLinear.pack(_linear(64, 32), batch_hint=8),
                   NativeLinear.pack(_linear(64, 32))):
        with pytest.raises(TypeError, match="streamed layers use Linear"):
            packed.set_weight("weight", torch.zeros(64, 32))


def test_pack_linears_replaces_every_dense_linear(llama_dir):
    from fusegen.engine.models.config import ModelConfig

    layer = DecoderLayer(ModelConfig.from_dir(str(llama_dir)), 0)
    for name in ("qkv", "o", "gate_up", "down"):
        getattr(layer, name).weight = torch.randn(32, 16)
    pack_linears(layer, batch_hint=64)
    assert {name: type(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")} == \
        dict.fromkeys(("qkv", "o", "gate_up", "down"), FP32_KIND)


def test_reference_kernels_turn_packing_off(monkeypatch):
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    assert not can_pack(torch.float32)
    monkeypatch.setenv("FUSEGEN_KERNELS", "auto")
    assert can_pack(torch.float32)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("packed"), "llama", "bpe", seed=5,
                              num_hidden_layers=10, max_position_embeddings=128)


OPTIONS = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
PROMPTS = ["The quick brown fox", "Hello", "1 2 3 4 5 6 7 8 9", "a b c d e f g h i j k"]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _kinds(llm):
    model = llm.engine.runner.model
    return [type(layer.qkv).__name__ for layer in model.layers], type(model.lm_head).__name__


def test_engine_packs_resident_layers_and_keeps_tokens(deep_dir, monkeypatch):
    with LLM(str(deep_dir), **OPTIONS) as llm:
        packed = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert _kinds(llm) == ([FP32_KIND.__name__] * 10, FP32_KIND.__name__)
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    with LLM(str(deep_dir), **OPTIONS) as llm:
        dense = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert _kinds(llm) == (["Linear"] * 10, "Linear")
    assert packed == dense


def test_streamed_layers_stay_dense(deep_dir):
    from test_offload import budget_for

    with LLM(str(deep_dir), **OPTIONS) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        sizes = llm.placement.sizes
    budget = budget_for(sizes, resident=5)
    with LLM(str(deep_dir), device_memory=budget, host_memory="1GiB", **OPTIONS) as llm:
        tiers = llm.placement.layer_tiers
        layers, head = _kinds(llm)
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want
    assert tiers.count("device") == 5 and tiers.count("host") == 5
    assert layers == [FP32_KIND.__name__ if t == "device" else "Linear" for t in tiers]
    assert head == FP32_KIND.__name__


def test_a_tied_head_is_counted_twice(qwen2_dir, monkeypatch):
    """A head tied to the embedding keeps the dense embedding beside the packed copy."""
    with LLM(str(qwen2_dir), device="cpu", dtype="float32") as llm:
        packed = llm.memory_report()["device"]["weights"]
        head = llm.engine.runner.model.lm_head.nbytes
        assert llm.config.shape.fixed_params * 4 >= 2 * head
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    with LLM(str(qwen2_dir), device="cpu", dtype="float32") as llm:
        dense = llm.memory_report()["device"]["weights"]
    assert packed == dense + head


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="bf16 weights are not packed here")
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_bf16_head_argmax_is_the_argmax_of_its_fp32_logits(rows):
    # what greedy decoding asks of a bf16 head: the logits' argmax, without the fp32 copy
    dense = _linear(32000, 64)
    dense.weight = dense.weight.bfloat16()
    packed = PackedLinear.pack(dense, batch_hint=rows)
    x = torch.randn(rows, 64).bfloat16()
    assert torch.equal(packed.argmax(x), packed(x).float().argmax(-1))


def test_bf16_argmax_kernel_keeps_the_first_column_on_ties():
    from fusegen.kernels import native
    from fusegen.kernels.argmax import argmax_native

    if native.library() is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 5000, generator=gen).bfloat16()
    logits[2, [17, 400, 4999]] = 9.0  # three columns tie on the row's maximum
    logits[5, -1] = 9.5  # the last column
    logits[6] = -3.0  # every column ties
    got = argmax_native(logits)
    assert torch.equal(got, logits.float().argmax(-1))
    assert got[[2, 5, 6]].tolist() == [17, 4999, 0]


# -- fusegen's kernels on oneDNN's packed weight (kernels/csrc/gemm_tiles.c) -----------

DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              not can_pack(torch.bfloat16) or not _dp_gemm(torch.bfloat16),
              reason="bf16 calls stay with oneDNN on this CPU (the kernel needs "
                     "AVX512_BF16 and is not used beside AMX)"), id="bf16"),
          pytest.param(torch.float32, marks=pytest.mark.skipif(
              _native_gemm() or not _dp_gemm(torch.float32),
              reason="fp32 calls take fusegen's AVX2 GEMM or oneDNN on this CPU (the "
                     "kernel needs AVX-512)"), id="fp32")]


def _typed_linear(dtype, out_features, in_features, bias=False, seed=0):
    dense = _linear(out_features, in_features, bias=bias, seed=seed)
    dense.weight = dense.weight.to(dtype)
    dense.bias = None if dense.bias is None else dense.bias.to(dtype)
    return dense


def _onednn(packed, x):
    return torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, "none", [], "")


def _max_in(dtype):
    return DP_MAX_TILE // (64 * dtype.itemsize)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1024, 512), (512, 1536), (2048, 1024), (1000, 200),
                                   (77, 33), (8, 64), (32000, 64), (130, None)])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_kernel_is_onednn_to_the_bit(dtype, shape, bias):
    """Every row count up to DP_ROWS (one row, row blocks of 6 and their tails), tiles of
    64 columns and a partial last one, an odd number of channels, blocks of channel sums,
    the widest weight taken (None: DP_MAX_TILE's channels)."""
    out_features, in_features = shape[0], shape[1] or _max_in(dtype)
    dense = _typed_linear(dtype, out_features, in_features, bias=bias)
    packed = PackedLinear.pack(dense, batch_hint=256)
    assert packed.k_blocks is not None
    gen = torch.Generator().manual_seed(3)
    for rows in (0, 1, 2, 5, 6, 7, 13, 64, 135, DP_ROWS):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)
        got = packed(x)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        assert torch.equal(got, _onednn(packed, x)), rows
    want = F.linear(x.float(), dense.weight.float(),
                    None if dense.bias is None else dense.bias.float())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernel_on_any_thread_count(dtype):
    from fusegen.kernels import native

    packed = PackedLinear.pack(_typed_linear(dtype, 640, 512, bias=True), batch_hint=256)
    x = torch.randn(135, 512).to(dtype)
    want = _onednn(packed, x)
    kernel = getattr(native.library(), f"gemm_tiles_{'bf16' if dtype == torch.bfloat16 else 'f32'}")
    for threads in (1, 2, 3, 16):  # 16: more threads than tiles, the rows split too
        out = torch.empty(135, 640, dtype=dtype)
        assert kernel(x.data_ptr(), 135, 512, packed.weight_ptr, 640, 512, packed.k_blocks[1],
                      packed.bias.data_ptr(), out.data_ptr(), 640, threads) == 0
        assert torch.equal(out, want), threads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1024, 512), (192, 577), (130, 64)])
def test_deterministic_calls_take_the_decode_kernel_and_are_batch_invariant(dtype, shape,
                                                                             monkeypatch):
    """Deterministic mode: every call through fusegen's kernel with one blocking, no
    padded row tiles; a row's bits alone are its bits inside calls of 2, 7, 64, 300 and
    more than DP_ROWS rows, on one thread or two."""
    dense = _typed_linear(dtype, *shape, bias=True)
    dense.row_tile = 64
    packed = PackedLinear.pack(dense, batch_hint=256)
    assert packed.k_blocks is not None
    monkeypatch.setattr(packed_module, "row_tiled", lambda *a: pytest.fail("row tiles used"))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, shape[1], generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([packed(x[i:i + 1]) for i in range(300)])
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for rows in (2, 7, 64, 300):
                got = torch.cat([packed(x[s:s + rows]) for s in range(0, 300, rows)])
                assert torch.equal(got, alone), (num_threads, rows)
            big = packed(x.repeat(4, 1))  # 1,200 rows: calls of DP_ROWS and the rest
            assert torch.equal(big, alone.repeat(4, 1)), num_threads
    finally:
        torch.set_num_threads(threads)
    want = F.linear(x.float(), dense.weight.float(), dense.bias.float())
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(alone.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernel_takes_strided_rows_and_leaves_large_calls_to_onednn(dtype, monkeypatch):
    packed = PackedLinear.pack(_typed_linear(dtype, 256, 64), batch_hint=64)
    x = torch.randn(9, 128).to(dtype)[:, 32:96]  # rows of 64 with a stride of 128
    assert torch.equal(packed(x), _onednn(packed, x.contiguous()))
    calls = []
    monkeypatch.setattr(PackedLinear, "_dp", lambda self, x: calls.append(len(x)))
    packed(torch.randn(DP_ROWS, 64).to(dtype))
    big = torch.randn(DP_ROWS + 1, 64).to(dtype)
    assert torch.equal(packed(big), _onednn(packed, big))
    assert calls == [DP_ROWS]


def test_decode_kernel_serves_only_shapes_it_matches(monkeypatch, caplog):
    """A shape whose oneDNN result the kernel does not give to the bit stays with oneDNN,
    and so does every shape where the kernel cannot run or whose tiles are too large."""
    if not can_pack(torch.bfloat16):
        pytest.skip("bf16 weights are not packed here")
    monkeypatch.setattr(packed_module, "_DP_BLOCKS", {})
    monkeypatch.setattr(packed_module, "_dp_gemm", lambda dtype: True)
    monkeypatch.setattr(PackedLinear, "_dp", lambda self, x, k_block=None: torch.zeros(
        len(x), self.out_features, dtype=self.dtype))
    with caplog.at_level("INFO", logger="fusegen.engine"):
        packed = PackedLinear.pack(_typed_linear(torch.bfloat16, 128, 64), batch_hint=64)
    assert packed.k_blocks is None
    assert "bfloat16 kernel does not match oneDNN on a [128, 64] weight" in caplog.text
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(packed(x), _onednn(packed, x))
    monkeypatch.setattr(packed_module, "_DP_BLOCKS", {})
    monkeypatch.setattr(packed_module, "_dp_gemm", lambda dtype: False)
    assert PackedLinear.pack(_typed_linear(torch.bfloat16, 128, 64), batch_hint=64) \
        .k_blocks is None
    monkeypatch.setattr(packed_module, "_DP_BLOCKS", {})
    monkeypatch.setattr(packed_module, "_dp_gemm", lambda dtype: True)
    monkeypatch.setattr(PackedLinear, "_dp", lambda self, x, k_block=None: 1 / 0)  # unasked
    wide = _max_in(torch.bfloat16) + 32
    assert PackedLinear.pack(_typed_linear(torch.bfloat16, 64, wide), batch_hint=8) \
        .k_blocks is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_tokens_are_the_same_with_the_decode_kernel(dtype, deep_dir, monkeypatch):
    options = {**OPTIONS, "dtype": str(dtype).removeprefix("torch.")}
    with LLM(str(deep_dir), **options) as llm:
        model = llm.engine.runner.model
        assert all(layer.qkv.k_blocks is not None for layer in model.layers)
        assert model.lm_head.k_blocks is not None
        with_kernel = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    monkeypatch.setattr(packed_module, "_DP_BLOCKS", {})
    monkeypatch.setattr(packed_module, "_dp_gemm", lambda dtype: False)
    with LLM(str(deep_dir), **options) as llm:
        assert llm.engine.runner.model.layers[0].qkv.k_blocks is None
        onednn = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert with_kernel == onednn
