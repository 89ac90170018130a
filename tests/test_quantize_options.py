"""quantization=: what each value does with each kind of model, and the refusals, before
anything loads, naming the value, the model, the device and what does run there; what a
job's unset quantization gives (its fingerprint and its tokens unchanged); --dequantize."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import Q, write_gguf
from test_quantized_group import write_group_checkpoint
from fusegen.engine import LLM, EngineConfigError, SamplingParams
from fusegen.engine.config import resolve_quantization
from fusegen.engine.errors import ModelLoadError
from fusegen.engine.options import EngineOptions
from fusegen.engine.weights.quantized import GGUFLinear
from fusegen.kernels import quant_linear

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_model_len=64, num_kv_blocks=32, max_num_seqs=4)
PROMPTS = ["Hello", "The quick brown fox", "1 2 3 4"]
CPU_DENSE = "on cpu this model runs with quantization=None or 'dequantize' (its own width), "\
    "'int8', 'int4'"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):  # hidden 128: groups of 128 fit every linear
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf"), "llama", "bpe", seed=4,
                              hidden_size=128, intermediate_size=128)


@pytest.fixture(scope="module")
def gguf_path(hf_dir, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", qtype=Q.Q4_1)


@pytest.fixture(scope="module")
def int4_dir(hf_dir, tmp_path_factory):
    return write_group_checkpoint(hf_dir, tmp_path_factory.mktemp("int4") / "q",
                                  (4, 32, False))


def _generate(path, **options):
    with LLM(str(path), **OPTIONS, **options) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [o.token_ids for o in outs], llm.engine.runner


def _refused(path, message, **options):
    with pytest.raises(EngineConfigError) as info:
        LLM(str(path), **options)
    assert str(info.value) == message


def test_what_none_resolves_to(hf_dir, gguf_path, int4_dir):
    # pure: the option against the model and the device, nothing loaded
    assert resolve_quantization(None, gguf_path, "cpu") == "gguf"
    assert resolve_quantization(None, gguf_path, "cuda") == "gguf"  # Triton's kernel
    assert resolve_quantization(None, int4_dir, "cpu") == "int4"
    assert resolve_quantization(None, int4_dir, "cuda:0") == "int4"
    assert resolve_quantization(None, hf_dir, "cpu") == "dequantize"
    assert resolve_quantization("dequantize", gguf_path, "cpu") == "dequantize"
    assert resolve_quantization("int8", hf_dir, "cpu") == "int8"
    assert resolve_quantization("int4", int4_dir, "cpu") == "int4"
    assert EngineOptions().quantization is None


def test_gguf_file_keeps_its_blocks_by_default_on_a_cpu(gguf_path):
    want, dense = _generate(gguf_path, quantization="dequantize")
    got, kept = _generate(gguf_path)
    assert got == want
    assert kept.config.quantization == "gguf" and dense.config.quantization == "dequantize"
    assert type(kept.model.layers[0].qkv) is GGUFLinear
    assert not any(isinstance(m, GGUFLinear) for m in dense.model.modules())


def test_a_type_without_a_kernel(gguf_path, monkeypatch):
    # explicitly asked, a layer linear in a type no kernel takes is refused by name; left
    # out, those linears are dequantized and the run goes on
    monkeypatch.delitem(quant_linear.SUPPORTED, Q.Q4_1)
    names = ", ".join(quant_linear.SUPPORTED.values())
    _refused(gguf_path, f"quantization='gguf' on {gguf_path} (device cpu): tensor "
             f"'blk.0.attn_q.weight' is Q4_1, which no kernel on cpu multiplies as blocks "
             f"(kept: {names}); leave quantization out to keep the blocks it can and "
             "dequantize the rest, or pass quantization='dequantize'",
             quantization="gguf", **OPTIONS)
    got, runner = _generate(gguf_path)
    assert not any(isinstance(m, GGUFLinear) for m in runner.model.layers.modules())


def test_unknown_values_are_refused():
    message = ("quantization={!r}: fusegen does not run that; it runs None (the checkpoint's "
               "own form), 'dequantize' (every weight expanded as it loads), 'gguf' (a GGUF "
               "file's blocks, on CPUs and CUDA GPUs with Triton), 'int8' / 'int4' "
               "(fusegen's group codes: its quantized checkpoints, or a 16-bit one quantized "
               "on load) and 'fp8' (Hugging Face FP8 checkpoints, or a 16-bit one quantized "
               "on load; CUDA GPUs of compute capability 8.9+); a checkpoint in another "
               "format converts with `fusegen quantize`")
    for value in ("awq", "gptq", "bitsandbytes", "INT4", 4):
        with pytest.raises(EngineConfigError) as info:
            EngineOptions.from_kwargs({"quantization": value})  # vLLM's keyword
        assert str(info.value) == message.format(value)


def test_combinations_are_refused_before_loading(hf_dir, gguf_path, int4_dir):
    _refused(hf_dir, f"quantization='gguf' on {hf_dir} (device cpu): it keeps the blocks of "
             f"a GGUF file, and this model is not one; {CPU_DENSE}", quantization="gguf")
    gguf_cpu = ("on cpu this model runs with quantization=None (its blocks kept where a "
                "kernel takes them), 'dequantize', 'gguf'")
    for bits in ("int8", "int4"):
        _refused(gguf_path, f"quantization={bits!r} on {gguf_path} (device cpu): a GGUF file "
                 f"is already quantized in its own types; {gguf_cpu}", quantization=bits)
    _refused(int4_dir, f"quantization='int8' on {int4_dir} (device cpu): the checkpoint is "
             "quantized to int4 already; on cpu this model runs with quantization=None or "
             "'int4' (its int4 codes as stored), 'dequantize'", quantization="int8")
    _refused(hf_dir, f"quantization='fp8' on {hf_dir} (device cpu): FP8 weights need a CUDA "
             f"GPU of compute capability 8.9 or later; {CPU_DENSE}", quantization="fp8")
    _refused(gguf_path, f"quantization='fp8' on {gguf_path} (device cpu): FP8 weights need a "
             f"CUDA GPU of compute capability 8.9 or later; {gguf_cpu}", quantization="fp8")


def test_fp8_on_cuda_without_a_gpu(hf_dir, int4_dir):
    import torch

    if torch.cuda.is_available():  # a GPU machine runs the GPU tests instead
        return
    cuda = ("on cuda:0 this model runs with quantization=None or 'dequantize' (its own "
            "width), 'int8', 'int4', 'fp8' (compute capability 8.9 or later)")
    _refused(hf_dir, f"quantization='fp8' on {hf_dir} (device cuda:0): no CUDA GPU is "
             f"visible to this process; {cuda}", quantization="fp8", device="cuda:0")
    _refused(int4_dir, f"quantization='fp8' on {int4_dir} (device cuda:0): FP8 quantizes a "
             "16-bit checkpoint on load, and this one is quantized already; on cuda:0 this "
             "model runs with quantization=None or 'int4' (its int4 codes as stored), "
             "'dequantize'", quantization="fp8", device="cuda:0")


def test_on_load_groups_must_fit(tmp_path):
    # hidden 64: q/k/v/gate/up have 64 input channels, not a group of 128
    narrow = make_hf_checkpoint(tmp_path / "narrow", "llama", "bpe", seed=1)
    _refused(narrow, f"quantization='int4' on {narrow} (device cpu): tensor "
             "'model.layers.0.self_attn.q_proj.weight' has 64 input channels, not a multiple "
             "of the on-load group size 128; pass quantization='dequantize', or quantize it "
             "with `fusegen quantize` and a group size that divides it",
             quantization="int4", **OPTIONS)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "awq", "bits": 4}, "quantization_config's quant_method is 'awq'; fusegen "
     "runs its own group-quantized checkpoints (quant_method 'fusegen', written by `fusegen "
     "quantize`), GGUF files, Hugging Face FP8 checkpoints (quant_method 'fp8') and "
     "unquantized checkpoints"),
    ({"quant_method": "fusegen", "bits": 3, "group_size": 32, "symmetric": True},
     "quantization_config.bits is 3; fusegen's group quantization is 8 or 4 bits"),
    ({"quant_method": "fusegen", "bits": 4, "group_size": 48, "symmetric": True},
     "quantization_config.group_size is 48; it must be one of 32, 64, 128"),
    ({"quant_method": "fusegen", "bits": 4, "group_size": 32, "symmetric": "yes"},
     "quantization_config.symmetric is 'yes'; it must be true or false"),
], ids=["method", "bits", "group", "symmetric"])
def test_bad_quantization_config(qc, message, int4_dir, tmp_path):
    import shutil

    model = shutil.copytree(int4_dir, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(model), **OPTIONS)
    assert str(info.value) == f"{model / 'config.json'}: {message}"


def test_a_job_keeps_dequantizing_gguf_files(gguf_path, int4_dir):
    # Outputs of jobs written before None kept a GGUF file's blocks were made dequantized,
    # and their fingerprints hold no quantization: a resumed job gets both unchanged.
    from fusegen.jobs.spec import JobSpec

    def spec(model, **kw):
        return JobSpec(model=str(model), input="in.parquet", output="out", **kw)

    job = spec(gguf_path)
    assert "quantization" not in job.output_config()
    assert job.engine_kwargs()["quantization"] == "dequantize"
    assert spec(gguf_path, quantization="gguf").engine_kwargs()["quantization"] == "gguf"
    assert spec(gguf_path, quantization="gguf").output_config()["quantization"] == "gguf"
    assert spec(int4_dir).engine_kwargs()["quantization"] is None  # its own codes
    kwargs = {**job.engine_kwargs(), **OPTIONS, "deterministic": False}
    with LLM(str(gguf_path), **kwargs) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert not any(isinstance(m, GGUFLinear) for m in llm.engine.runner.model.modules())
    want, _ = _generate(gguf_path, quantization="dequantize")
    assert got == want


def test_dequantize_flag(int4_dir, tmp_path):
    from fusegen.jobs.run_cmd import _dequantize_flag, run

    flags = {"dequantize": True, "quantization": None}
    _dequantize_flag(flags)
    assert flags == {"quantization": "dequantize"}
    flags = {"dequantize": False, "quantization": "int4"}
    _dequantize_flag(flags)
    assert flags == {"quantization": "int4"}
    result = CliRunner().invoke(run, ["--model", str(int4_dir), "--input", "x.parquet",
                                      "--output", str(tmp_path / "o"), "--dequantize",
                                      "--quantization", "int4"])
    assert result.exit_code != 0
    assert "--dequantize and --quantization int4 both given; pass one" in result.output
    assert "--dequantize" in CliRunner().invoke(run, ["--help"]).output



def test_fp8_sources_build_what_from_linear_builds(hf_dir):
    # quantization="fp8" (CUDA only at the engine): each decoder linear's "fp8" source,
    # fused and kept, holds exactly FP8Linear.from_linear's codes and scales of the fused
    # dense weight; checked here on the CPU, where FP8Linear runs its torch fallback
    import torch

    from fusegen.engine.models import get_architecture
    from fusegen.engine.models.config import ModelConfig
    from fusegen.engine.weights.fp8 import FP8Linear
    from fusegen.engine.weights.linear import Linear
    from fusegen.engine.weights.loader import checkpoint_tensors, fuse
    from fusegen.engine.weights.quantized import keep_blocks, layer_nbytes, split_kept

    cfg = ModelConfig.from_dir(str(hf_dir))
    arch = get_architecture(cfg.architecture)
    state = checkpoint_tensors(hf_dir, cfg, torch.float32, "fp8")
    sources = arch.layer_sources(state, 0, cfg)
    kept, dense = split_kept(sources)
    assert sorted(kept) == ["down.weight", "gate_up.weight", "o.weight", "qkv.weight"]
    layer = arch.build_model(cfg).layers[0]
    components = keep_blocks(layer, kept, "cpu")
    values = {"weight_fp8": 1, "weight_scale": 4}  # bytes a value
    assert layer_nbytes(sources, 4) == sum(t.numel() * values[n.rpartition(".")[2]]
                                           for n, t in components.items()) \
        + sum(t.numel() for parts in dense.values() for t in parts) * 4
    weights = fuse({p: sources[p] for p in kept}, "cpu", torch.float32)
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for param, weight in weights.items():
        module = getattr(layer, param.removesuffix(".weight"))
        assert type(module) is FP8Linear
        dense_linear = Linear()
        dense_linear.weight = weight
        want = FP8Linear.from_linear(dense_linear)
        assert torch.equal(module.weight_fp8.view(torch.uint8), want.weight_fp8.view(torch.uint8))
        assert torch.equal(module.weight_scale, want.weight_scale)
        if param != "down.weight":
            assert torch.equal(module(x[:, :module.in_features]), want(x[:, :module.in_features]))
