"""Hugging Face FP8 checkpoints (config.json's quantization_config.quant_method "fp8"):
float8_e4m3fn linear weights with per-tensor or per-channel `weight_scale`, or block
`weight_scale_inv` (DeepSeek / Qwen FP8). Dequantized at load (quantization="dequantize")
they generate, greedy in fp32, exactly the tokens of the same dequantized weights written
as an ordinary fp32 checkpoint; run as they are (the default) only on CUDA GPUs with FP8
units, refused elsewhere naming the checkpoint, the device and the alternative; their
"fp8" sources' components (shapes, bytes, values) are `fp8_checkpoint_parts`'s; damaged
checkpoints are named. What needs a GPU: the kept FP8Linear path inside an engine run on
a capability 8.9+ device (tests/gpu)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_hf_checkpoint
from quant_helpers import compressible_names, config_error
from fusegen.engine import LLM, SamplingParams
from fusegen.engine.config import resolve_quantization
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.weights.fp8 import FP8Linear, fp8_checkpoint_parts
from fusegen.engine.weights.loader import checkpoint_tensors
from fusegen.engine.weights.quantized import keep_blocks, layer_nbytes, split_kept
from fusegen.kernels.triton_quant import fp8_linear_reference

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "1 2 3 4 5 6 7 8 9 10"]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# on the CPU, where these tests pin down the refusal and the torch fallback (a GPU
# machine would otherwise run them on CUDA)
OPTIONS = dict(dtype="float32", max_model_len=96, num_kv_blocks=48, max_num_seqs=4,
               device="cpu")
BLOCK = (32, 64)  # weight_block_size of the block checkpoint: [rows, input channels]
# left in fp32, as a checkpoint's modules_to_not_convert are
UNCONVERTED = "model.layers.1.self_attn.o_proj.weight"
SCHEMES = ["tensor", "channel", "block"]


def _quantize(weight: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """A weight's e4m3 codes and scale as FP8 exporters write them (largest |value| of
    the tensor, row or block to 448)."""
    w = weight.float()
    if scheme == "tensor":
        scale = w.abs().amax() / 448
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale,
                "input_scale": torch.tensor(0.02)}  # static activation scale: unused
    if scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
    b0, b1 = BLOCK
    out, inp = w.shape
    blocks = w.reshape(out // b0, b0, inp // b1, b1).abs().amax(dim=(1, 3)) / 448
    full = blocks.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
    return {"weight": (w / full).to(torch.float8_e4m3fn), "weight_scale_inv": blocks}


def _dequantized(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The test's own reading: codes times their scale, one fp32 product each."""
    codes = parts["weight"].float()
    if "weight_scale" in parts:
        return codes * parts["weight_scale"]
    b0, b1 = BLOCK
    return codes * parts["weight_scale_inv"].repeat_interleave(b0, 0).repeat_interleave(b1, 1)


def write_fp8_checkpoint(src: Path, dst: Path, scheme: str, dense: bool = False,
                         edit=None) -> Path:
    """`src` with its decoder linears (but UNCONVERTED) in e4m3 and `scheme`'s scales,
    config.json declaring quant_method "fp8"; `dense`: the dequantized weights as an
    ordinary fp32 checkpoint instead. `edit(tensors)` may damage the tensors."""
    names = compressible_names(src)
    out = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name not in names or name == UNCONVERTED:
            out[name] = tensor
            continue
        parts = _quantize(tensor, scheme)
        base = name.removesuffix(".weight")
        if dense:
            out[name] = _dequantized(parts)
        else:
            out |= {f"{base}.{key}": value for key, value in parts.items()}
    if edit is not None:
        edit(out)
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, dst / path.name)
    save_file({n: t.contiguous() for n, t in out.items()}, dst / "model.safetensors")
    if not dense:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if scheme == "block":
            config["quantization_config"]["weight_block_size"] = list(BLOCK)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("src"), "llama", "bpe", seed=11)


@pytest.fixture(scope="module")
def fp8_dirs(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {scheme: write_fp8_checkpoint(src, root / scheme, scheme) for scheme in SCHEMES}


def generate(path, **options):
    with LLM(str(path), **OPTIONS, **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [o.token_ids for o in outs], llm.engine.runner


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantized_at_load_generates_like_the_dense_weights(scheme, src, fp8_dirs, tmp_path):
    dense = write_fp8_checkpoint(src, tmp_path / "dense", scheme, dense=True)
    want, _ = generate(dense)
    got, runner = generate(fp8_dirs[scheme], quantization="dequantize")
    assert got == want
    assert runner.config.quantization == "dequantize"
    assert not any(isinstance(m, FP8Linear) for m in runner.model.modules())


def test_fp8_weights_need_a_gpu_with_fp8_units(fp8_dirs, monkeypatch):
    model = fp8_dirs["channel"]
    start = (f"{model} is an FP8 checkpoint (config.json's quantization_config.quant_method "
             "'fp8'): its FP8 weights run on CUDA GPUs of compute capability 8.9 or later, and ")
    end = "; pass quantization='dequantize' to expand them to the run's dtype as they load"
    on_cpu = start + "device cpu is not one" + end
    assert config_error(LLM, str(model), **OPTIONS) == on_cpu
    for quantization in (None, "fp8"):
        assert config_error(resolve_quantization, quantization, model, "cpu") == on_cpu
    if not torch.cuda.is_available():
        assert config_error(resolve_quantization, None, model, "cuda:0") == (
            start + "device cuda:0: no CUDA GPU is visible to this process" + end)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert config_error(resolve_quantization, None, model, "cuda:0") == (
        start + "cuda:0 (NVIDIA A100) has compute capability 8.0" + end)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_quantization(None, model, "cuda:0") == "fp8"
    assert resolve_quantization("fp8", model, "cuda") == "fp8"
    assert resolve_quantization("dequantize", model, "cuda") == "dequantize"
    assert config_error(resolve_quantization, "int4", model, "cuda:0") == (
        f"quantization='int4' on {model} (device cuda:0): the checkpoint is FP8 already; on "
        "cuda:0 this model runs with quantization=None or 'fp8' (its FP8 weights as stored, "
        "compute capability 8.9 or later), 'dequantize'")
    assert config_error(resolve_quantization, "gguf", model, "cpu") == (
        f"quantization='gguf' on {model} (device cpu): the checkpoint is FP8 already; on cpu "
        "this model runs with quantization='dequantize'")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_sources_are_the_checkpoints_codes(scheme, fp8_dirs):
    """The "fp8" sources a GPU run keeps: e4m3 [out, in] and fp32 [out] components (the
    bytes the plan counts), holding `fp8_checkpoint_parts` of the file's tensors (per
    tensor and per channel: the file's codes exactly); the unconverted linear stays dense;
    kept on the CPU (FP8Linear's torch fallback) a linear computes fp8_linear_reference."""
    model = fp8_dirs[scheme]
    cfg = ModelConfig.from_dir(str(model))
    arch = get_architecture(cfg.architecture)
    state = checkpoint_tensors(model, cfg, torch.float32, "fp8")
    tensors = load_file(model / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    source = state[name + ".weight"].compressed
    assert (source.format, source.params, source.shape) == ("fp8", (), (64, 128))
    assert source.components() == {"weight_fp8": (torch.float8_e4m3fn, (64, 128)),
                                   "weight_scale": (torch.float32, (64,))}
    assert source.nbytes == 64 * 128 + 64 * 4
    parts = source.load()
    scales = {k: tensors.get(f"{name}.{k}") for k in ("weight_scale", "weight_scale_inv")}
    want = fp8_checkpoint_parts(name, tensors[name + ".weight"], **scales, block=BLOCK)
    assert torch.equal(parts["weight_fp8"].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(parts["weight_scale"], want[1])
    if scheme != "block":
        assert torch.equal(parts["weight_fp8"].view(torch.uint8),
                           tensors[name + ".weight"].view(torch.uint8))
    assert not hasattr(state[UNCONVERTED], "compressed")
    for index, dense_params in [(0, ["input_norm", "post_norm"]),
                                (1, ["input_norm", "o.weight", "post_norm"])]:
        sources = arch.layer_sources(state, index, cfg)
        kept, dense = split_kept(sources)
        assert sorted(dense) == dense_params
        layer = arch.build_model(cfg).layers[index]
        components = keep_blocks(layer, kept, "cpu")
        assert layer_nbytes(sources, 4) == sum(
            t.numel() * t.element_size() for t in components.values()) + sum(
            t.numel() for parts in dense.values() for t in parts) * 4
    module = layer.gate_up
    assert type(module) is FP8Linear
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(module(x), fp8_linear_reference(x, module.weight_fp8, module.weight_scale))


def test_kept_fp8_linears_run_in_the_engine(fp8_dirs, monkeypatch):
    # the GPU path's wiring on the CPU: FP8 units pretended, FP8Linear's torch fallback
    # multiplies; the linears hold the file's codes and the plan counts their bytes
    from fusegen.engine import config

    monkeypatch.setattr(config, "_fp8_problem", lambda device: None)
    model = fp8_dirs["channel"]
    tokens, runner = generate(model)
    assert runner.config.quantization == "fp8"
    layer = runner.model.layers[0]
    assert type(layer.qkv) is FP8Linear and type(layer.down) is FP8Linear
    assert type(runner.model.layers[1].o) is not FP8Linear  # UNCONVERTED
    codes = load_file(model / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(layer.down.weight_fp8.view(torch.uint8), codes.view(torch.uint8))
    sizes = runner.config.placement.sizes
    arch = get_architecture(runner.config.model_config.architecture)
    assert sizes.layer_bytes == max(layer_nbytes(arch.layer_sources(
        checkpoint_tensors(model, runner.config.model_config, torch.float32, "fp8"), i,
        runner.config.model_config), 4) for i in range(2))
    assert len(tokens) == len(PROMPTS) and all(len(t) == PARAMS.max_tokens for t in tokens)


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _add(name, value):
    return lambda tensors: tensors.__setitem__(name, value)


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("scheme, edit, message", [
    ("channel", _drop(f"{Q}.weight_scale"),
     f"{Q}: an FP8 weight comes with one of {Q}.weight_scale or {Q}.weight_scale_inv; got "
     "neither"),
    ("channel", _add(f"{Q}.weight_scale_inv", torch.ones(2, 1)),
     f"{Q}: an FP8 weight comes with one of {Q}.weight_scale or {Q}.weight_scale_inv; got "
     "both"),
    ("channel", _add(f"{Q}.weight_scale", torch.ones(3)),
     f"{Q}.weight_scale is [3]; fusegen reads a per-tensor [] or per-channel [64] / [64, 1] "
     "scale"),
    ("block", _add(f"{Q}.weight_scale_inv", torch.ones(1, 1)),
     f"{Q}.weight_scale_inv is [1, 1]; a 64 x 64 weight in 32 x 64 blocks has [2, 1]"),
    ("channel", _add(f"{UNCONVERTED.removesuffix('.weight')}.weight_scale", torch.ones(64)),
     f"tensor '{UNCONVERTED.removesuffix('.weight')}.weight_scale' scales '{UNCONVERTED}', "
     "which is not a float8_e4m3fn weight of this checkpoint"),
], ids=["no-scale", "both-scales", "scale-shape", "block-shape", "stray-scale"])
def test_damaged_fp8_checkpoints_are_named(scheme, edit, message, src, tmp_path):
    model = write_fp8_checkpoint(src, tmp_path / "m", scheme, edit=edit)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model), quantization="dequantize", **OPTIONS)
    assert str(info.value).startswith(f"{model / 'model.safetensors'}: {message}")


def test_fp8_weights_without_the_declaration(src, fp8_dirs, tmp_path):
    # e4m3 weights (their scales left out) in a checkpoint that declares no FP8 format
    model = shutil.copytree(fp8_dirs["channel"], tmp_path / "undeclared")
    config = json.loads((model / "config.json").read_text())
    del config["quantization_config"]
    (model / "config.json").write_text(json.dumps(config))
    tensors = load_file(model / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if not n.endswith("_scale")},
              model / "model.safetensors")
    with pytest.raises(ModelLoadError, match=(
            r"model.safetensors: tensor 'model\.layers\.\d\.[a-z_]+\.[a-z_]+_proj\.weight' "
            r"is float8_e4m3fn, but config.json declares no quantization_config with "
            r"quant_method 'fp8' \(which says how its scales are stored\); fusegen reads FP8 "
            r"weights only from such checkpoints$")):
        LLM(str(model), **OPTIONS)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128]}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model), **OPTIONS)
    assert str(info.value) == (f"{model / 'config.json'}: quantization_config.weight_block_size "
                               "is [128]; it must be two positive integers [output rows, input "
                               "channels]")


def test_moe_experts_load_dequantized(tmp_path):
    # no FP8 expert linear: an FP8 mixture of experts keeps its attention's codes, and its
    # experts' weights load dequantized (the same tokens as the dense weights either way)
    src = make_hf_checkpoint(tmp_path / "src", "mixtral", "bpe", seed=5, num_local_experts=4,
                             num_experts_per_tok=2)
    model = write_fp8_checkpoint(src, tmp_path / "fp8", "channel")
    cfg = ModelConfig.from_dir(str(model))
    sources = get_architecture(cfg.architecture).layer_sources(
        checkpoint_tensors(model, cfg, torch.float32, "fp8"), 0, cfg)
    kept, dense = split_kept(sources)
    assert sorted(kept) == ["o.weight", "qkv.weight"]
    assert {"gate_up.weight", "down.weight", "router.weight"} <= set(dense)
    want, _ = generate(write_fp8_checkpoint(src, tmp_path / "dense", "channel", dense=True))
    got, _ = generate(model, quantization="dequantize")
    assert got == want
