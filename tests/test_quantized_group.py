"""fusegen's group-quantized checkpoints (int8 / int4, docs/quantization.md) load and run
compressed (`GroupQuantLinear`, `GroupQuantExpertLinear`: engine/weights/groupquant.py)
and generate, greedy in fp32, exactly the tokens of the same weights dequantized at load,
for every architecture; a 16-bit checkpoint quantized on load equals the pre-quantized
one; the memory report counts the components' bytes; a damaged checkpoint is an error
naming the tensor and the file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import ARCHS
from quant_helpers import cached_checkpoint, compressible_names, generate_tokens, write_rewritten
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models import get_architecture
from fusegen.engine.weights.groupquant import GroupQuantExpertLinear, GroupQuantLinear
from fusegen.engine.weights.linear import ROW_TILE, Linear
from fusegen.kernels.group_linear import dequantize_group, quantize_group

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "日本語 🎉 text",
           "1 2 3 4 5 6 7 8 9 10"]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=96, num_kv_blocks=48, max_num_seqs=4)
# hidden 128: every linear's input channels fill groups of 128; MoE: top-2 of 4 experts
SIZES = dict(hidden_size=128, intermediate_size=128)
OVERRIDES = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
             "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                               norm_topk_prob=True)}
# (bits, group_size, symmetric)
FORMATS = [(8, 32, True), (8, 128, False), (4, 32, False), (4, 128, True),
           (8, 32, False), (8, 128, True), (4, 32, True), (4, 128, False)]
LINEARS = ("qkv", "o")  # every architecture's attention linears


def fmt_id(fmt) -> str:
    bits, group_size, symmetric = fmt
    return f"int{bits}-g{group_size}-{'sym' if symmetric else 'asym'}"



def write_group_checkpoint(src: Path, dst: Path, fmt, dense: bool = False,
                           edit=None) -> Path:
    """`src`'s weights with its decoder linears quantized by `quantize_group`, written as
    a fusegen-quantized checkpoint in `dst`; `dense`: as the dequantized weights instead
    (fp32 `dequantize_group` values, an ordinary checkpoint). `edit(tensors)` may damage
    the tensors before they are written."""
    bits, group_size, symmetric = fmt

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, scales, zeros = quantize_group(tensor, bits, group_size, symmetric)
        if dense:
            return {name: dequantize_group(qweight, scales, zeros, bits, group_size,
                                           tensor.shape[1])}
        base = name.removesuffix(".weight")
        out = {f"{base}.qweight": qweight, f"{base}.scales": scales}
        if zeros is not None:
            out[f"{base}.zeros"] = zeros
        return out

    entry = None if dense else ("quantization_config", {
        "quant_method": "fusegen", "bits": bits, "group_size": group_size,
        "symmetric": symmetric, "method": "rtn"})
    return write_rewritten(src, dst, convert, edit, entry)


_SOURCES: dict[str, Path] = {}


def source_checkpoint(arch: str, tmp_path_factory) -> Path:
    return cached_checkpoint(_SOURCES, arch, tmp_path_factory, **SIZES,
                             **OVERRIDES.get(arch, {}))


def generate(path, **options):
    tokens, runner, report, stats = generate_tokens(path, PROMPTS, PARAMS, **OPTIONS,
                                                    **options)
    assert stats["num_steps"] == PARAMS.max_tokens  # the prompts fused in one batch
    return tokens, runner, report


def check_compressed(runner, fmt, moe: bool) -> None:
    for layer in runner.model.layers:
        for name in LINEARS:
            linear = getattr(layer, name)
            assert type(linear) is GroupQuantLinear and linear.params == fmt
            assert (linear.zeros is None) == fmt[2]
        if moe:
            assert type(layer.gate_up) is GroupQuantExpertLinear
            assert type(layer.down) is GroupQuantExpertLinear
            assert type(layer.router) is not GroupQuantLinear  # routers stay dense
            assert layer.gate_up.qweight.shape[0] == layer.gate_up.num_experts
    assert not isinstance(runner.model.lm_head, GroupQuantLinear)


CASES = [(arch, FORMATS[i % len(FORMATS)]) for i, arch in enumerate(ARCHS)] + \
    [("llama", fmt) for fmt in FORMATS[1:]]


@pytest.mark.parametrize("arch, fmt", CASES, ids=[f"{a}-{fmt_id(f)}" for a, f in CASES])
def test_quantized_checkpoint_generates_like_dequantized(arch, fmt, tmp_path, tmp_path_factory):
    src = source_checkpoint(arch, tmp_path_factory)
    quantized = write_group_checkpoint(src, tmp_path / "q", fmt)
    dense = write_group_checkpoint(src, tmp_path / "d", fmt, dense=True)
    want, _, _ = generate(dense)
    got, runner, _ = generate(quantized)  # the checkpoint says what it is: no option
    assert got == want
    assert runner.config.quantization == f"int{fmt[0]}"
    check_compressed(runner, fmt, moe=arch in OVERRIDES)


def test_deterministic_and_dequantize_options(tmp_path, tmp_path_factory):
    # deterministic mode: row tiles kept on the compressed linears, the same tokens;
    # quantization="dequantize" expands the codes as they load: the dense checkpoint's run
    fmt = (4, 32, False)
    src = source_checkpoint("llama", tmp_path_factory)
    quantized = write_group_checkpoint(src, tmp_path / "q", fmt)
    dense = write_group_checkpoint(src, tmp_path / "d", fmt, dense=True)
    want, _, _ = generate(dense, deterministic=True)
    got, runner, _ = generate(quantized, deterministic=True)
    assert got == want
    assert runner.model.layers[0].qkv.row_tile == ROW_TILE
    want, _, dense_report = generate(dense)
    got, runner, report = generate(quantized, quantization="dequantize")
    assert got == want and report["device"]["weights"] == dense_report["device"]["weights"]
    assert not any(isinstance(m, GroupQuantLinear) for m in runner.model.modules())


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_int4_on_load_equals_the_prequantized_checkpoint(arch, tmp_path, tmp_path_factory):
    # quantization="int4" on a 16-bit checkpoint: round to nearest, symmetric, groups of
    # 128 (docs/quantization.md): the codes `quantize_group` writes, the same tokens
    src = source_checkpoint(arch, tmp_path_factory)
    quantized = write_group_checkpoint(src, tmp_path / "q", (4, 128, True))
    want, stored, want_report = generate(quantized)
    got, loaded, report = generate(src, quantization="int4")
    assert got == want
    assert loaded.config.quantization == "int4"
    check_compressed(loaded, (4, 128, True), moe=arch in OVERRIDES)
    for a, b in zip(stored.model.layers, loaded.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            for component in ("qweight", "scales"):
                assert torch.equal(getattr(getattr(a, name), component),
                                   getattr(getattr(b, name), component))
    assert report["device"]["weights"] == want_report["device"]["weights"]
    assert loaded.plan.sizes.layer_bytes == stored.plan.sizes.layer_bytes


def test_memory_report_counts_the_components(tmp_path, tmp_path_factory):
    # resident weights: the fixed tensors, and per layer exactly the file's qweight,
    # scales and zeros bytes plus the layer's other tensors dense in fp32
    fmt = (4, 32, False)
    src = source_checkpoint("llama", tmp_path_factory)
    quantized = write_group_checkpoint(src, tmp_path / "q", fmt)
    tensors = load_file(quantized / "model.safetensors")
    _, runner, report = generate(quantized)
    cfg = runner.config.model_config
    prefix = get_architecture(cfg.architecture).layer_prefix
    layer_bytes = []
    for i in range(cfg.num_layers):
        layer = {n: t for n, t in tensors.items() if n.startswith(prefix.format(i))}
        layer_bytes.append(sum(t.numel() * t.element_size() for n, t in layer.items()
                               if n.endswith((".qweight", ".scales", ".zeros")))
                           + sum(t.numel() * 4 for n, t in layer.items()
                                 if n.endswith(".weight")))
    linears = sum(getattr(runner.model.layers[0], n).nbytes
                  for n in ("qkv", "o", "gate_up", "down"))
    assert linears == layer_bytes[0] - 2 * cfg.hidden_size * 4  # the two norms dense
    assert runner.plan.sizes.layer_bytes == max(layer_bytes)
    head = runner.model.lm_head.nbytes if cfg.tie_word_embeddings else 0
    assert report["device"]["weights"] == runner.model.fixed_nbytes + head + sum(layer_bytes)


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _replace(name, make):
    def edit(tensors):
        tensors[name] = make(tensors[name])
    return edit


Q = "model.layers.1.self_attn.q_proj"


@pytest.mark.parametrize("fmt, edit, message", [
    ((4, 32, False), _drop(f"{Q}.scales"),
     f"{{dir}}: tensor '{Q}.scales' is missing; '{Q}.weight' is stored int4 asymmetric in "
     "groups of 32 (config.json's quantization_config), which needs it"),
    ((4, 32, False), _replace(f"{Q}.scales", lambda t: t.float()),
     f"{{file}}: tensor '{Q}.scales' is float32 [128, 4]; the [128, 128] weight '{Q}.weight' "
     "stored int4 asymmetric in groups of 32 (config.json's quantization_config) needs "
     "float16 [128, 4]"),
    ((4, 32, True), _replace(f"{Q}.qweight", lambda t: t.repeat(1, 2)),
     f"{{file}}: tensor '{Q}.qweight' is uint8 [128, 128]; the [128, 128] weight '{Q}.weight' "
     "stored int4 symmetric in groups of 32 (config.json's quantization_config) needs uint8 "
     "[128, 64]"),
    ((8, 128, True), _replace(f"{Q}.scales", lambda t: t[:64]),
     f"{{file}}: tensor '{Q}.scales' is float16 [64, 1]; the [128, 128] weight '{Q}.weight' "
     "stored int8 symmetric in groups of 128 (config.json's quantization_config) needs "
     "float16 [128, 1]"),
    ((8, 32, True), _replace(f"{Q}.qweight", lambda t: torch.zeros(3, 3, dtype=torch.uint8)),
     f"{{file}}: tensor '{Q}.qweight' is uint8 [3, 3]; the [128, 128] weight '{Q}.weight' "
     "stored int8 symmetric in groups of 32 (config.json's quantization_config) needs uint8 "
     "[128, 128]"),
    ((4, 32, False), _drop(f"{Q}.qweight"),
     f"{{file}}: tensor '{Q}.scales' has no '{Q}.qweight' beside it; the checkpoint is "
     "incomplete"),
], ids=["missing", "dtype", "unpacked", "rows", "shape", "orphan"])
def test_damaged_quantized_tensors_are_named(fmt, edit, message, tmp_path, tmp_path_factory):
    src = source_checkpoint("llama", tmp_path_factory)
    quantized = write_group_checkpoint(src, tmp_path / "q", fmt, edit=edit)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(quantized), **OPTIONS)
    assert str(info.value) == message.format(dir=quantized,
                                             file=quantized / "model.safetensors")


def test_truncated_file_is_named(tmp_path, tmp_path_factory):
    src = source_checkpoint("llama", tmp_path_factory)
    quantized = write_group_checkpoint(src, tmp_path / "q", (4, 32, False))
    path = quantized / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(quantized), **OPTIONS)
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    last = max((n for n in header if n != "__metadata__"),
               key=lambda n: header[n]["data_offsets"][1])
    assert str(info.value) == (f"{path}: truncated: tensor {last!r} ends at byte {size}, past "
                               f"the end of the file ({size - 100} bytes); download or write "
                               "it again")


def test_zero_points_in_a_symmetric_checkpoint(tmp_path, tmp_path_factory):
    src = source_checkpoint("llama", tmp_path_factory)

    def add_zeros(tensors):
        tensors[f"{Q}.zeros"] = torch.zeros(128, 4, dtype=torch.uint8)

    quantized = write_group_checkpoint(src, tmp_path / "q", (4, 32, True), edit=add_zeros)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(quantized), **OPTIONS)
    assert str(info.value) == (
        f"{quantized / 'model.safetensors'}: tensor '{Q}.zeros' holds zero points, but the "
        "checkpoint is int4 symmetric in groups of 32 (config.json's quantization_config), "
        "which stores none; config.json and the weights disagree")


def test_expert_linear_rows_are_each_experts(tmp_path_factory):
    # GroupQuantExpertLinear over E stacked experts equals each expert's own
    # GroupQuantLinear, in both modes
    from fusegen.engine.models.moe import ExpertLinear
    from fusegen.engine.weights.quantized import CompressedSource

    gen = torch.Generator().manual_seed(0)
    experts, out, inp = 3, 64, 128
    weights = torch.randn(experts * out, inp, generator=gen)
    qweight, scales, zeros = quantize_group(weights, 4, 32, False)
    parts = {"qweight": qweight, "scales": scales, "zeros": zeros}
    source = CompressedSource.of("group", (4, 32, False), (experts * out, inp), "w",
                                 lambda: parts)
    x = torch.randn(5, inp, generator=gen)
    for row_tile in (None, ROW_TILE):
        stacked = ExpertLinear(experts)
        stacked.row_tile = row_tile
        module = GroupQuantExpertLinear.shell(stacked, source)
        for name, tensor in parts.items():
            module.set_weight(name, tensor)
        assert module.nbytes == sum(t.numel() * t.element_size() for t in parts.values())
        for e in range(experts):
            rows = slice(e * out, (e + 1) * out)
            one = GroupQuantLinear.shell(Linear(), source.narrow(0, e * out, out))
            for name, tensor in source.narrow(0, e * out, out).load().items():
                one.set_weight(name, tensor)
            assert torch.equal(module(x, e), one(x))
            want = x @ dequantize_group(qweight[rows], scales[rows], zeros[rows], 4, 32, inp).T
            torch.testing.assert_close(module(x, e), want, rtol=1e-5, atol=1e-5)


def _dense(source):
    """A source's weight expanded to fp32 [out, in], from what `load()` returns."""
    from fusegen.kernels.quant_linear import quant_linear_reference

    parts = source.load()
    if source.format == "gguf":
        out, inp = source.shape
        return quant_linear_reference(torch.eye(inp), parts["blocks"], source.params[0], out,
                                      inp).T
    bits, group_size, _ = source.params
    return dequantize_group(parts["qweight"], parts["scales"], parts.get("zeros"), bits,
                            group_size, source.shape[1])


def test_compressed_source_narrows_rows_and_whole_blocks():
    # the interface device groups shard with: rows, then input columns in whole blocks;
    # each narrowed source loads exactly the slice of the weight, with the shapes and
    # bytes `components()` and `nbytes` say, and a split inside a block is refused
    import gguf

    from fusegen.engine.weights.quantized import CompressedSource

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 256, generator=gen)
    qweight, scales, zeros = quantize_group(weight, 4, 64, False)
    group = CompressedSource.of("group", (4, 64, False), (96, 256), "w.weight",
                                lambda: {"qweight": qweight, "scales": scales, "zeros": zeros})
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    blocks = torch.from_numpy(gguf.quants.quantize(weight.numpy(), q4_0))
    kept = CompressedSource.of("gguf", (int(q4_0),), (96, 256), "blk.0.attn_q.weight",
                               lambda: {"blocks": blocks})
    for source, block in ((group, 64), (kept, 32)):
        full = _dense(source)
        for dim, start, length in ((0, 16, 40), (1, block, 256 - block), (1, 0, block)):
            part = source.narrow(dim, start, length)
            want = full.narrow(dim, start, length)
            loaded = part.load()
            assert {n: (t.dtype, tuple(t.shape)) for n, t in loaded.items()} == part.components()
            assert part.nbytes == sum(t.numel() * t.element_size() for t in loaded.values())
            assert torch.equal(_dense(part), want)
        rows_then_columns = source.narrow(0, 8, 24).narrow(1, block, block)
        assert torch.equal(_dense(rows_then_columns), full[8:32, block:2 * block])
        with pytest.raises(ValueError) as info:
            source.narrow(1, 16, 128)
        assert str(info.value) == (
            f"{source.name}: its {source.format} weight keeps input columns in blocks of "
            f"{block}; the split [16, 144) cuts one (use a split whose columns are multiples "
            f"of {block})")
    with pytest.raises(ValueError, match=r"^w.weight: \[90, 100\) is outside dim 0 of its "
                                         r"\[96, 256\] weight$"):
        group.narrow(0, 90, 10)


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("fmt", [(4, 32, False), (8, 128, True)], ids=fmt_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_rows_do_not_depend_on_the_batch(fmt, dtype, kernels, monkeypatch):
    # the C kernel sums each output in one order whatever the call, so GroupQuantLinear
    # calls it as it is; the reference (torch's GEMM) in ROW_TILE-row calls. Either way a
    # row is bit-identical alone or among 64 (or 100) rows.
    monkeypatch.setenv("FUSEGEN_KERNELS", kernels)
    from fusegen.engine.weights.quantized import CompressedSource

    bits, group_size, symmetric = fmt
    gen = torch.Generator().manual_seed(1)
    out_features, in_features = 96, 256
    qweight, scales, zeros = quantize_group(torch.randn(out_features, in_features,
                                                        generator=gen), *fmt)
    parts = {"qweight": qweight, "scales": scales} | ({} if zeros is None else {"zeros": zeros})
    source = CompressedSource.of("group", fmt, (out_features, in_features), "w", lambda: parts)
    linear = Linear(bias=True)
    linear.row_tile = ROW_TILE
    module = GroupQuantLinear.shell(linear, source)
    for name, tensor in parts.items():
        module.set_weight(name, tensor)
    module.set_weight("bias", torch.randn(out_features, generator=gen).to(dtype))
    x = torch.randn(100, in_features, generator=gen).to(dtype)
    together = {n: module(x[:n]) for n in (64, 100)}
    for row in (0, 17, 63):
        alone = module(x[row:row + 1])
        assert torch.equal(alone[0], together[64][row])
        assert torch.equal(alone[0], together[100][row])
    want = x.float() @ dequantize_group(qweight, scales, zeros, bits, group_size,
                                        in_features).T + module.bias.float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(together[100].float(), want, rtol=tol, atol=tol * 8)
    assert module.nbytes == sum(t.numel() * t.element_size() for t in parts.values()) \
        + out_features * dtype.itemsize


def test_header_that_misstates_a_tensor_is_named(tmp_path, tmp_path_factory):
    # a header whose byte range does not hold the tensor's dtype x shape: named, not read
    src = source_checkpoint("llama", tmp_path_factory)
    quantized = write_group_checkpoint(src, tmp_path / "q", (4, 32, False))
    path = quantized / "model.safetensors"
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    header[f"{Q}.scales"]["shape"] = [128, 8]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    path.write_bytes(len(text + b" " * (size - len(text))).to_bytes(8, "little")
                     + text + b" " * (size - len(text)) + raw[8 + size:])
    start, end = header[f"{Q}.scales"]["data_offsets"]
    with pytest.raises(ModelLoadError) as info:
        LLM(str(quantized), **OPTIONS)
    assert str(info.value) == (f"{path}: tensor '{Q}.scales' is F16 [128, 8] (2048 bytes) but "
                               f"the header gives it bytes {start}..{end}; the file is damaged")
