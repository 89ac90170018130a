"""Helpers shared by the tests of compressed weights and their kernels: GGUF blocks as a
writer makes them, a C kernel file compiled for another CPU, the message of a refused
configuration, a generation's tokens, a script run in a child process under Triton's
interpreter, and what the `fusegen quantize` / `fusegen sparsify` tests share (calibration
prompts, MoE shapes, a command's run, a written checkpoint's tensors, a usage error), and
a test checkpoint made once and rewritten with its decoder linears compressed."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fusegen.engine import LLM, EngineConfigError
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.weights.groupquant import quantizable
from fusegen.engine.weights.loader import load_state_dict, weight_files
from fusegen.jobs.cli import main
from fusegen.kernels import native
from fusegen.kernels import quant_linear as ql

from checkpoints import make_hf_checkpoint

# compiler flags of the x86-64 builds other CPUs get, and the kernel families each build
# reports (the bit mask of its `*_available`): AVX-512 without AVX512_BF16, AVX2, baseline
OTHER_CPU_BUILDS = [
    (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"], 1 | 2 | 4),
    (["-mavx2", "-mfma", "-mf16c"], 1 | 2), ([], 1 | 2)]
OTHER_CPU_IDS = ["avx512-without-bf16", "avx2", "baseline"]

# calibration text, the MoE shapes each MoE architecture is made with, and the name
# suffixes of the linears a compressing command rewrites
PROMPTS = ["The quick brown fox jumps over the lazy dog, again and again and again.",
           "Hello world, this is a test of the calibration pass.",
           "1 2 3 4 5 6 7 8 9 10 11 12", "Bonjour tout le monde"]
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                         norm_topk_prob=True)}
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj", "qkv_proj", "gate_up_proj", "w1", "w2", "w3")


def make_blocks(qtype: int, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Blocks as a GGUF writer makes them: gguf's quantizer where it has one for the type,
    else random codes with finite fp16 scales (about 0.01, so products stay moderate)."""
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    try:
        dense = rng.standard_normal((out_features, in_features)).astype(np.float32)
        return torch.from_numpy(quantize(dense, qtype))
    except NotImplementedError:
        pass
    block_size, type_size = ql.BLOCK_SIZES[qtype]
    raw = rng.integers(0, 256, (out_features, in_features // block_size, type_size),
                       dtype=np.uint8)
    scales = (rng.standard_normal((out_features, in_features // block_size, 2)) * 0.01)
    scales = scales.astype(np.float16).view(np.uint8)  # two fp16 as four bytes
    if qtype == ql.Q6_K:
        raw[:, :, 208:210] = scales[:, :, :2]  # d is the block's last field
    else:
        raw[:, :, 0:4] = scales  # d, dmin first
    return torch.from_numpy(raw.reshape(out_features, -1))


def assert_close(got, ref, x, w):
    """A C kernel's result against the reference over the dense weight w. fp32: within 1e-5
    of sum |x| |w| (the sum's own rounding scale, summed in another order than torch's);
    bf16: within 1e-2 of the row's largest |value| (one bf16 rounding of each result) and
    2^-8 of sum |x| |w| (the kernel multiplies each weight as bf16 rounds it, as a model
    dequantized to bf16 holds it)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    scale = x.float().abs() @ w.abs().T
    if got.dtype == torch.float32:
        bound = 1e-5 * scale + 1e-6
    else:
        bound = 1e-2 * ref.float().abs().amax(dim=1, keepdim=True) + 2 ** -8 * scale
    assert ((got.float() - ref.float()).abs() <= bound).all()


def build_for_other_cpu(source_name: str, flags: list[str], tmp_path: Path,
                        functions: tuple[str, ...]) -> ctypes.CDLL:
    """kernels/csrc/`source_name` compiled here with `flags` (another CPU's instruction
    set) into tmp_path, `functions` declared with the signatures native.py gives them.
    Skips off x86-64, where those flags do not exist."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 instruction-set builds")
    source = native._SOURCES[0].with_name(source_name)
    target = tmp_path / (Path(source_name).stem + ".so")
    obj = target.with_suffix(".o")
    # compiled with -ffast-math, linked without (as native.py builds): linking with it adds
    # crtfastmath.o, whose constructor turns on flush-to-zero in the loading thread only,
    # so later tests' torch results on subnormals would depend on the thread computing them
    subprocess.run([native._compiler(), "-O3", *flags, "-fopenmp", "-ffast-math", "-fPIC",
                    "-std=gnu11", "-c", str(source), "-o", str(obj)], check=True)
    subprocess.run([native._compiler(), "-shared", "-fopenmp", str(obj), "-o", str(target),
                    "-lm"], check=True)
    lib = ctypes.CDLL(str(target))
    for name in functions:
        getattr(lib, name).argtypes = native._SIGNATURES[name]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def config_error(call, *args, **kwargs) -> str:
    """The message of the EngineConfigError that call(*args, **kwargs) raises."""
    with pytest.raises(EngineConfigError) as info:
        call(*args, **kwargs)
    return str(info.value)


def generate_tokens(path, prompts, params, **options):
    """The token ids an LLM over the checkpoint at `path` generates for `prompts`, with
    its runner, its memory report and its stats (read before it closes)."""
    with LLM(str(path), **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return ([o.token_ids for o in outs], llm.engine.runner, llm.memory_report(),
                llm.stats())


def kept_like_dequantized(generate, path, **options):
    """generate(path, ...) over a GGUF file with its blocks dequantized on load, then kept
    (quantization="gguf"), asserting both give the same tokens: (the dequantized run's
    runner, the kept run's runner, the kept run's memory report)."""
    want, dense, _ = generate(path, quantization="dequantize", **options)
    got, kept, report = generate(path, quantization="gguf", **options)
    assert got == want
    return dense, kept, report


def run_interpreted(script: str, *args: str):
    """The JSON on the last line `script` prints, run in a child Python with every kernel
    through Triton (FUSEGEN_KERNELS=triton) in its interpreter (TRITON_INTERPRET=1) and
    this checkout first on its path; the child's stderr tail on failure."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "FUSEGEN_KERNELS": "triton",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_command(command: str, *args):
    """`fusegen <command> <args>` through click's runner (each argument as str)."""
    return CliRunner().invoke(main, [command, *map(str, args)])


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files a checkpoint directory holds, as stored."""
    tensors = {}
    for path in weight_files(directory):
        with safe_open(str(path), "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    return tensors


def source_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the loader reads them (fused and renamed)."""
    return load_state_dict(directory, ModelConfig.from_dir(directory))


def is_linear(name: str) -> bool:
    """A decoder layer's linear weight, one a compressing command rewrites."""
    return ".layers." in name and name.endswith(".weight") and \
        name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES


def assert_usage_error(result, *parts, out: Path):
    """A command refused with click's usage exit code, its output naming every part, and
    nothing written at `out` (nor a temporary directory beside it)."""
    assert result.exit_code == 2, result.output
    for part in parts:
        assert part in result.output, result.output
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*"))


def cached_checkpoint(cache: dict, arch: str, tmp_path_factory, **options) -> Path:
    """A tiny `arch` checkpoint (sentencepiece for Gemma, else BPE; seed 7) with `options`,
    made once per (arch, options) and kept in `cache`."""
    key = arch + repr(sorted(options.items()))
    if key not in cache:
        cache[key] = make_hf_checkpoint(
            tmp_path_factory.mktemp(arch), arch,
            "sentencepiece" if arch.startswith("gemma") else "bpe", seed=7, **options)
    return cache[key]


def compressible_names(model_dir: Path) -> dict[str, str]:
    """The checkpoint names of the decoder linears a compressed format stores (int8 / int4
    groups, sparse tiles) -> their layer parameter (the architecture's tensor list)."""
    cfg = ModelConfig.from_dir(str(model_dir))
    arch = get_architecture(cfg.architecture)
    return {arch.layer_prefix.format(i) + name: param for i in range(cfg.num_layers)
            for name, shape, param in arch.layer_tensors(cfg) if quantizable(param, shape)}


def write_rewritten(src: Path, dst: Path, convert, edit=None, config_entry=None) -> Path:
    """`src` written to `dst` with each decoder linear (compressible_names) replaced by
    the tensors `convert(name, weight)` returns, every other tensor as it was, in one
    model.safetensors beside `src`'s other files. `edit(tensors)` may damage the tensors
    before they are written; `config_entry` (key, value) is added to config.json."""
    names = compressible_names(src)
    state = {}
    for path in sorted(src.glob("*.safetensors")):
        state |= load_file(path)
    out = {}
    for name, tensor in state.items():
        if name in names:
            out |= convert(name, tensor)
        else:
            out[name] = tensor
    if edit is not None:
        edit(out)
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy(path, dst / path.name)
    save_file({n: t.contiguous() for n, t in out.items()}, dst / "model.safetensors")
    if config_entry is not None:
        config = json.loads((dst / "config.json").read_text())
        config[config_entry[0]] = config_entry[1]
        (dst / "config.json").write_text(json.dumps(config))
    return dst
