"""The Triton sparse-tile kernel (kernels/triton_sparse.py) in Triton's interpreter on CPU
(compiled on CUDA where there is a GPU): it equals the dense product of the decoded weight
(sparse_linear.sparse_linear_reference) within the dtype's tolerance over odd shapes,
tails, 0 and 1 rows, empty and fully dense tiles, every values dtype (int8 with its
scales) and every x dtype; a row is bit-identical alone and batched; split-K's policy is
the weight's shape's, not M's; every kernel compiles for sm_90 (the GPU's POPC path the
interpreter never runs) without spills; the default packed variant equals the gather
variant bit for bit where every tile fits its vector, and tiles that do not take its
second pass; sparse_linear() sends it CUDA x; and the engine
through it (the interpreter here, the GPU where lent) generates the pruned dense model's
tokens."""
from __future__ import annotations

import json
import os

import pytest
import torch

from quant_helpers import (cached_checkpoint, compressible_names, generate_tokens,
                           run_interpreted, write_rewritten)
from fusegen.engine import SamplingParams
from fusegen.kernels import sparse_format as codec
from fusegen.kernels.sparse_linear import sparse_linear, sparse_linear_reference

pytest.importorskip("triton")
from fusegen.kernels import triton_sparse as ts  # noqa: E402
from fusegen.kernels.testing import triton_on  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
X_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
# (rows, out_features, in_features): out / in off multiples of 64 (edge tiles), a single
# partial tile, more column-tiles than one
SHAPES = [(1, 70, 129), (3, 130, 200), (17, 64, 64), (5, 33, 300)]


def pruned_weight(out_features, in_features, sparsity=0.6, seed=0):
    """Random weights with about `sparsity` of them zero; tile (0, 0) fully dense, tile
    (0, 1) (where there is one) empty."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen)
    w[torch.rand(out_features, in_features, generator=gen) < sparsity] = 0.0
    w[:64, :64] = torch.randn(min(64, out_features), min(64, in_features), generator=gen)
    w[:64, :64][w[:64, :64] == 0] = 1.0
    w[:64, 64:128] = 0.0
    return w


def encode_on(w, values, device):
    tiles = codec.encode(w, values)
    move = (lambda t: None if t is None else t.to(device))
    return codec.SparseTiles(move(tiles.bitmap), move(tiles.offsets), move(tiles.values),
                             move(tiles.scales), tiles.out_features, tiles.in_features)


def make_x(rows, in_features, dtype, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_features, generator=gen).to(dtype).to(device)


def assert_within_tolerance(got, x, tiles):
    """got against sparse_linear_reference (the decoded fp32 weight, an fp32 product
    rounded once to x's dtype): one rounding of the output (ULP of the result), the
    weight's rounding to x's dtype (|x| @ |w - w rounded|), fp32 reordering (1e-5 of
    |x| @ |w|); exact zeros where a weight row is all zeros."""
    tiles = codec.SparseTiles(*(t if t is None else t.cpu() for t in
                                (tiles.bitmap, tiles.offsets, tiles.values, tiles.scales)),
                              tiles.out_features, tiles.in_features)
    got, x = got.cpu(), x.cpu()
    ref = sparse_linear_reference(x, tiles)
    assert got.shape == ref.shape and got.dtype == ref.dtype == x.dtype
    w = codec.decode(tiles)
    xa = x.float().abs()
    bound = (ULP[x.dtype] * ref.float().abs() + xa @ (w.to(x.dtype).float() - w).abs().T
             + 1e-5 * (xa @ w.abs().T) + 1e-6)
    diff = (got.float() - ref.float()).abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item()}"
    empty_rows = (w == 0).all(dim=1)
    assert (got[:, empty_rows] == 0).all()


# The interpreter takes every shape for each x dtype with its own values and with int8
# values, the other pairs at one shape (time); a GPU takes every case.
_INTERPRETED = {("float32", torch.float32), ("float16", torch.float16),
                ("bfloat16", torch.bfloat16), ("int8", torch.float32), ("int8", torch.bfloat16)}


def _cases():
    for device in ("cpu", "cuda"):
        for shape in SHAPES:
            for values in ("bfloat16", "float16", "float32", "int8"):
                for x_dtype in X_DTYPES:
                    if device == "cpu" and (values, x_dtype) not in _INTERPRETED \
                            and shape != SHAPES[1]:
                        continue
                    yield pytest.param(shape, values, x_dtype, device,
                                       marks=[CUDA] if device == "cuda" else [],
                                       id=f"{device}-{shape}-{values}-x_{str(x_dtype)[6:]}")


@pytest.mark.parametrize("shape, values, x_dtype, device", list(_cases()))
def test_kernel_equals_dense_product(shape, values, x_dtype, device):
    rows, out_features, in_features = shape
    w = pruned_weight(out_features, in_features, seed=out_features)
    if out_features > 64:
        w[-1] = 0.0  # a whole output row pruned (past the dense tile): exact zeros
    assert (w[:64, :64] != 0).all() and (w[:64, 64:128] == 0).all()  # dense and empty tiles
    tiles = encode_on(w, values, device)
    x = make_x(rows, in_features, x_dtype, device)
    got = triton_on(device, ts.sparse_linear_triton)(x, tiles)
    assert_within_tolerance(got, x, tiles)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("values", ["bfloat16", "int8"])
def test_split_k_and_row_blocks(values, device):
    # 9 column-tiles in 3 runs of 3 (and 20 runs asked: 9 of 1), 20 rows in 16-row blocks
    # with a tail; the loop with and without its prefetch of the next tile; both variants,
    # the packed one also two tiles a step (runs of 4 and 2: a last group of one)
    w = pruned_weight(100, 560, sparsity=0.7, seed=3)
    tiles = encode_on(w, values, device)
    x = make_x(20, 560, torch.bfloat16, device)
    kernel = triton_on(device, ts.sparse_linear_triton)
    for variant, splits, prefetch, group in (("packed", 3, True, 1), ("packed", 20, False, 1),
                                             ("packed", 3, True, 2), ("packed", 5, False, 2),
                                             ("gather", 3, True, 1), ("gather", 1, False, 1)):
        config = {"variant": variant, "BLOCK_M": 16, "splits": splits, "PREFETCH": prefetch,
                  "TILES": group, "CAP": 4096}
        assert_within_tolerance(kernel(x, tiles, config=config), x, tiles)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("values, x_dtype", [("bfloat16", torch.bfloat16),
                                             ("float32", torch.float32),
                                             ("int8", torch.float16)])
def test_packed_equals_gather_bit_for_bit(values, x_dtype, device):
    # no tile too dense for the packed vector (an empty one among them) and room in the
    # storage past the last value: every tile expanded on chip, the same dots in the same
    # order as the gather variant's loads, so the same bits
    w = pruned_weight(130, 330, sparsity=0.7, seed=7)
    w[:64, :64][torch.rand(64, 64, generator=torch.Generator().manual_seed(8)) < 0.7] = 0.0
    tiles = encode_on(w, values, device)
    room = torch.zeros(tiles.values.numel() + 64, dtype=tiles.values.dtype, device=device)
    room[:tiles.values.numel()] = tiles.values
    tiles = codec.SparseTiles(tiles.bitmap, tiles.offsets, room[:tiles.values.numel()],
                              tiles.scales, tiles.out_features, tiles.in_features)
    counts = tiles.offsets.diff().cpu()
    shape = ts._packed_shape(tiles)
    assert (counts + shape["ALIGN"] <= shape["CAP"]).all() and (counts == 0).any()
    x = make_x(5, 330, x_dtype, device)
    kernel = triton_on(device, ts.sparse_linear_triton)
    # compiled for a GPU, the two variants' int8 expansions round code x scale into x's
    # dtype by other instruction sequences (an H200 gave other bits): there each variant
    # is held to the reference; the interpreter runs both the same way
    same_bits = not (values == "int8" and device == "cuda")
    for splits in (1, 2):
        packed = kernel(x, tiles, config={"splits": splits})
        gather = kernel(x, tiles, config={"splits": splits, "variant": "gather"})
        if same_bits:
            assert torch.equal(packed, gather)
        else:
            assert_within_tolerance(gather, x, tiles)
        assert_within_tolerance(packed, x, tiles)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_second_pass(device):
    # a vector of 256 values holds none of these tiles but the empty one (about 1,640
    # values each, the dense one 4,096): the others go to the second pass, alone and in
    # groups of two, with and without prefetch; a vector of 2,048 holds all but the
    # dense tile (and groups of two none)
    w = pruned_weight(100, 400, sparsity=0.6, seed=9)
    tiles = encode_on(w, "bfloat16", device)
    x = make_x(3, 400, torch.bfloat16, device)
    kernel = triton_on(device, ts.sparse_linear_triton)
    for cap, group, prefetch in ((256, 1, True), (256, 2, False), (2048, 1, True),
                                 (2048, 2, True)):
        config = {"CAP": cap, "TILES": group, "PREFETCH": prefetch, "splits": 2}
        assert_within_tolerance(kernel(x, tiles, config=config), x, tiles)


def test_safe_end_is_the_storage_room():
    # the aligned vectors may read past the last value up to the storage's end, rounded
    # down to whole vectors; a view's room counts from its own first value
    values = torch.zeros(1000, dtype=torch.bfloat16)
    assert ts._safe_end(values, 8) == 1000
    assert ts._safe_end(values[:997], 8) == 1000
    assert ts._safe_end(values[3:990], 8) == 992
    assert ts._safe_end(torch.zeros(37, dtype=torch.int8), 16) == 32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("values, x_dtype", [("bfloat16", torch.bfloat16),
                                             ("int8", torch.float32), ("float16", torch.float16)])
def test_dense_band_path(values, x_dtype, device):
    # large calls without batch_invariant: the weight expanded in bands (here 64 output
    # rows each: three bands, the last cut at the edge; and one band of all 150 rows)
    # and multiplied by torch
    w = pruned_weight(150, 200, seed=4)
    tiles = encode_on(w, values, device)
    x = make_x(6, 200, x_dtype, device)
    kernel = triton_on(device, ts.sparse_linear_triton)
    for band_rows in (64, 2048):
        got = kernel(x, tiles, config={"dense": True, "band_rows": band_rows})
        assert_within_tolerance(got, x, tiles)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_rows(device):
    tiles = encode_on(pruned_weight(70, 129), "bfloat16", device)
    got = triton_on(device, ts.sparse_linear_triton)(
        torch.empty(0, 129, dtype=torch.bfloat16, device=device), tiles)
    assert got.shape == (0, 70) and got.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_is_batch_invariant(x_dtype, device):
    # 1, 17 and 40 rows take BLOCK_M 16, 32 and 32; 9 column-tiles take 2 splits (an
    # H100's SM count under the interpreter) whatever M
    w = pruned_weight(48, 560, seed=5)
    tiles = encode_on(w, "bfloat16", device)
    x = make_x(40, 560, x_dtype, device)
    kernel = triton_on(device, ts.sparse_linear_triton)
    batched = {n: kernel(x[:n], tiles) for n in (17, 40)}
    for i in (0, 16):
        alone = kernel(x[i:i + 1], tiles)
        assert torch.equal(alone[0], batched[17][i]) and torch.equal(alone[0], batched[40][i])
    assert torch.equal(batched[17], batched[40][:17])


def _shape_only(out_features, in_features):
    empty = torch.empty(0)
    return codec.SparseTiles(empty, empty, empty, None, out_features, in_features)


def test_packed_shape_follows_the_values():
    # CAP: a power of two over a whole tile's average values (the density's) and a
    # quarter (and a vector's alignment), from 256 up to a dense tile's 4,096; ALIGN:
    # values in 16 bytes
    def shape(nnz, dtype, num_tiles=10):
        values = torch.empty(nnz, dtype=dtype)
        return ts._packed_shape(codec.SparseTiles(values, values, values, None, 64,
                                                  64 * num_tiles))
    assert shape(12290, torch.bfloat16) == {"TILES": 1, "CAP": 2048, "ALIGN": 8}  # 70%
    assert shape(20480, torch.float32) == {"TILES": 1, "CAP": 4096, "ALIGN": 4}   # 50%
    assert shape(40960, torch.int8) == {"TILES": 1, "CAP": 4096, "ALIGN": 16}     # dense
    assert shape(100, torch.float16)["CAP"] == 256
    edges = codec.SparseTiles(*(torch.empty(1200, dtype=torch.bfloat16),) * 3, None, 65, 65)
    assert ts._packed_shape(edges)["CAP"] == 2048     # 28% of 65 x 65 kept: 1,163 a tile
    assert shape(0, torch.bfloat16, num_tiles=0)["CAP"] == 256


def test_config_splits_follow_the_weight_not_m():
    # Llama-3-8B's up [14336, 4096] and down [4096, 14336] on 132 SMs: four programs an
    # SM over one row block, runs of at least 4 column-tiles
    up, down = _shape_only(14336, 4096), _shape_only(4096, 14336)
    for m in (1, 8, 16, 64, 256, 4096):
        assert ts._config(m, up, True, 132)["splits"] == 3
        assert ts._config(m, down, True, 132)["splits"] == 9
        assert ts._config(m, down, True, 132)["BLOCK_M"] == (16 if m <= 16 else 32)
        assert ts._config(m, down, True, 132)["PREFETCH"] is True
        assert ts._config(m, down, True, 132)["variant"] == "packed"
    free = ts._config(256, down, False, 132)
    assert (free["BLOCK_M"], free["splits"], free["dense"]) == (128, 5, False)  # 2 x 64
    assert ts._config(511, down, False, 132)["dense"] is False
    assert ts._config(512, down, False, 132)["dense"] is True  # expanded once, cuBLAS
    assert ts._config(4096, down, True, 132)["dense"] is False
    assert ts._config(1, _shape_only(70, 129), True, 132)["splits"] == 1  # 3 column-tiles


def test_bad_inputs_are_named():
    tiles = codec.encode(pruned_weight(70, 129), "int8")
    x = torch.randn(2, 129)
    call = ts.sparse_linear_triton
    with pytest.raises(ValueError, match="x is torch.int32; the kernel takes"):
        call(x.int(), tiles)
    with pytest.raises(ValueError, match=r"x \[2, 128\] is not rows \[M, in_features=129\]"):
        call(torch.randn(2, 128), tiles)
    with pytest.raises(ValueError, match=r"x \[2, 1, 129\] is not rows"):
        call(x[:, None], tiles)
    no_scales = codec.SparseTiles(tiles.bitmap, tiles.offsets, tiles.values, None, 70, 129)
    with pytest.raises(ValueError, match="int8 values need their fp32 scales.*scales absent"):
        call(x, no_scales)
    with pytest.raises(ValueError, match=r"variant 'dense' is not one of \('packed', 'gather'\)"):
        call(x, tiles, config={"variant": "dense"})
    with pytest.raises(ValueError, match="the tiles' bitmap is on meta, x on cpu"):
        call(x, codec.SparseTiles(tiles.bitmap.to("meta"), tiles.offsets, tiles.values,
                                  tiles.scales, 70, 129))


def test_triton_only_where_it_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert ts.has_triton_sparse("cpu") is False
    assert ts.has_triton_sparse("cuda") is torch.cuda.is_available()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ts.has_triton_sparse("cpu") is True


@CUDA
def test_sparse_linear_dispatches_cuda_x_to_triton(monkeypatch):
    tiles = encode_on(pruned_weight(130, 200), "bfloat16", "cuda")
    x = make_x(3, 200, torch.bfloat16, "cuda")
    calls = []
    kernel = ts.sparse_linear_triton
    monkeypatch.setattr(ts, "sparse_linear_triton",
                        lambda *a, **k: calls.append(k) or kernel(*a, **k))
    got = sparse_linear(x[None], tiles)     # [1, 3, in]: rows through the same dispatch
    assert calls == [{"batch_invariant": False}] and got.shape == (1, 3, 130)
    assert torch.equal(got[0], kernel(x, tiles, batch_invariant=False))


# -- compiled for a GPU, without one -------------------------------------------------

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}


class _CompileInstead:
    """A kernel's launches handed to `triton.compile` for sm_90 down to a cubin (the
    interpreter never runs the GPU's POPC path), recording each cubin's stack bytes."""

    def __init__(self, kernel):
        self.kernel, self.stack_bytes = kernel, []

    def __getitem__(self, grid):
        return self._compile

    def _compile(self, *args, num_warps=4, num_stages=3, **kwargs):
        import re
        import subprocess
        import tempfile

        from triton import compiler
        from triton.backends.compiler import GPUTarget

        values = {**dict(zip(self.kernel.arg_names, args)), **kwargs}
        signature, constexprs, attrs = {}, {}, {}
        for i, (name, param) in enumerate(zip(self.kernel.arg_names, self.kernel.params)):
            value = values[name]
            if param.is_constexpr or (type(value) is int and value == 1):  # the JIT folds 1s
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + _TYPES[value.dtype]
                if value.data_ptr() % 16 == 0:  # as the JIT specializes aligned pointers
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = compiler.compile(
            compiler.ASTSource(self.kernel, signature, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": num_warps, "num_stages": num_stages})
        tools = os.path.join(os.path.dirname(compiler.__file__), "..", "backends", "nvidia", "bin")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin.name],
                                   capture_output=True, text=True, check=True).stdout
        self.stack_bytes += [int(n) for n in re.findall(r"STACK:(\d+)", usage)]


@pytest.mark.skipif(not os.path.exists(os.path.join(
    os.path.dirname(pytest.importorskip("triton").__file__), "backends", "nvidia", "bin",
    "ptxas")), reason="Triton's bundled ptxas is missing")
def test_kernels_compile_for_sm90_without_spills(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's path: POPC
    kernels = {name: _CompileInstead(getattr(ts, name)) for name in
               ("_sparse_packed_kernel", "_sparse_tiles_kernel", "_sum_splits_kernel",
                "_expand_kernel")}
    for name, recorder in kernels.items():
        monkeypatch.setattr(ts, name, recorder)
    down = codec.encode(pruned_weight(256, 1024, seed=6), "bfloat16")
    int8 = codec.encode(pruned_weight(256, 1024, seed=6), "int8")
    ts.sparse_linear_triton(torch.zeros(8, 1024, dtype=torch.bfloat16), down)    # split-K
    ts.sparse_linear_triton(torch.zeros(40, 1024, dtype=torch.bfloat16), down)   # 32 rows
    ts.sparse_linear_triton(torch.zeros(8, 1024, dtype=torch.float16), int8)
    ts.sparse_linear_triton(torch.zeros(200, 1024, dtype=torch.bfloat16), down,
                            batch_invariant=False)                               # 128 rows
    ts.sparse_linear_triton(torch.zeros(8, 1024, dtype=torch.bfloat16), down,
                            config={"TILES": 2, "CAP": 4096})                    # two a step
    ts.sparse_linear_triton(torch.zeros(8, 1024, dtype=torch.bfloat16), down,
                            config={"variant": "gather"})                        # the old way
    ts.sparse_linear_triton(torch.zeros(512, 1024, dtype=torch.bfloat16), down,
                            batch_invariant=False)                               # bands
    assert kernels["_sparse_packed_kernel"].stack_bytes == [0] * 5
    assert kernels["_sparse_tiles_kernel"].stack_bytes == [0]
    assert kernels["_sum_splits_kernel"].stack_bytes == [0] * 6  # every call split
    assert kernels["_expand_kernel"].stack_bytes == [0]
    ts.sparse_linear_triton(torch.zeros(8, 1024), down)   # fp32 x: IEEE fp32 dots compile


# -- the engine through the kernel ---------------------------------------------------

def test_sparse_weights_stay_tiles_where_a_kernel_takes_them(monkeypatch):
    from fusegen.engine.weights import quantized
    from fusegen.engine.weights.sparse import sparse_entry

    part = sparse_entry((96, 96), "bfloat16", "o.weight", 10, dict).compressed
    keeps = lambda device: quantized.can_keep("o.weight", [part], device)  # noqa: E731
    monkeypatch.delenv("FUSEGEN_KERNELS", raising=False)
    assert keeps("cpu") and keeps("cuda") and keeps("cuda:1") and not keeps("mps")
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")  # the torch path reads CPU tiles
    assert keeps("cpu") and not keeps("cuda")
    monkeypatch.delenv("FUSEGEN_KERNELS")
    monkeypatch.setattr(quantized, "_triton_available", lambda: False)
    assert keeps("cpu") and not keeps("cuda")


PROMPTS = [[5, 9, 100, 7, 42, 17, 3], [300], list(range(30, 52))]
_SOURCES: dict = {}


def _sparse_and_dense(tmp_path, tmp_path_factory):
    """A tiny Llama (hidden 96, intermediate 160: tiles cut at the edge) with its decoder
    linears pruned to half of each row, stored sparse (fp32 values) and dense."""
    src = cached_checkpoint(_SOURCES, "llama", tmp_path_factory, hidden_size=96,
                            intermediate_size=160)
    entry = ("sparsity_config", {
        "format": "fusegen-bitmap-tiles", "version": 1, "tile": [64, 64], "values": "float32",
        "sparsity": 0.5, "method": "magnitude", "modules": sorted(compressible_names(src))})

    def prune(w):
        w = w.float()
        order = w.abs().argsort(dim=1, stable=True)[:, :w.shape[1] // 2]
        return w.clone().scatter_(1, order, 0.0)

    sparse = write_rewritten(src, tmp_path / "sparse",
                             lambda name, w: codec.tensors(name, codec.encode(prune(w), "float32")),
                             config_entry=entry)
    dense = write_rewritten(src, tmp_path / "dense", lambda name, w: {name: prune(w)})
    return sparse, dense


# Every other kernel on its CPU path (FUSEGEN_KERNELS=auto), the sparse linears' products
# sent to the Triton kernel (in the interpreter) as sparse_linear() sends CUDA x (and
# kept from the C kernel, which takes CPU x only).
ENGINE_SCRIPT = """
import json, os, sys
os.environ["FUSEGEN_KERNELS"] = "auto"
from fusegen.kernels.testing import backport_interpreter_fixes
backport_interpreter_fixes()
from fusegen.kernels import sparse_linear, triton_sparse
from fusegen.engine import LLM, SamplingParams
calls = []
kernel = triton_sparse.sparse_linear_triton
triton_sparse.sparse_linear_triton = lambda *a, **k: calls.append(1) or kernel(*a, **k)
sparse_linear.use_triton = lambda x: True
sparse_linear.use_native = lambda x: False  # as for CUDA x: the C kernel never takes it
llm = LLM(sys.argv[1], device="cpu", dtype="float32", max_num_batched_tokens=24, block_size=4)
prompts = json.loads(sys.argv[2])
outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
print(json.dumps([[o.token_ids for o in outs], len(calls)]))
llm.close()
"""


def test_engine_through_the_kernel_in_the_interpreter(tmp_path, tmp_path_factory):
    sparse, dense = _sparse_and_dense(tmp_path, tmp_path_factory)
    prompts = PROMPTS[:2]
    want, _, _, _ = generate_tokens(dense, prompts, SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True), device="cpu", dtype="float32")
    got, calls = run_interpreted(ENGINE_SCRIPT, str(sparse), json.dumps(prompts))
    assert got == want
    assert calls > 0  # the sparse layers' products went through the Triton kernel


@CUDA
def test_engine_on_cuda_generates_like_pruned_dense(tmp_path, tmp_path_factory):
    from fusegen.engine.weights.sparse import SparseLinear

    sparse, dense = _sparse_and_dense(tmp_path, tmp_path_factory)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", max_model_len=96, max_num_seqs=4)
    want, _, _, _ = generate_tokens(dense, PROMPTS, params, **options)
    got, runner, _, _ = generate_tokens(sparse, PROMPTS, params, **options)
    assert got == want
    assert runner.config.quantization == "sparse"
    # kept as tiles on the GPU (multiplied by the Triton kernel), not decoded on load
    assert all(type(layer.o) is SparseLinear for layer in runner.model.layers)
