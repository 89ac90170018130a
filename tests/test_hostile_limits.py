"""Sizes and files fusegen must refuse clearly, before anything loads or is written: KV
pools and batch limits past the memory there is, sparse or sharded checkpoints missing a
part, and the checkpoint writers' output, signals and leftover staging folders."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import pytest

from checkpoints import make_hf_checkpoint
from quant_helpers import assert_usage_error, run_command
from fusegen import LLM
from fusegen.engine.errors import EngineConfigError, ModelLoadError
from fusegen.engine.memory import device
from fusegen.engine.weights import quantize as qz


def _refusal(model, **options) -> str:
    with pytest.raises(EngineConfigError) as info:
        LLM(str(model), device="cpu", **options)
    return str(info.value)


# -- the memory plan: sizes past the memory there is ----------------------------------

@pytest.mark.parametrize("option, value, what", [
    ("num_kv_blocks", 10**9, "KV cache"),
    ("num_host_kv_blocks", 10**8, "host KV cache"),
    ("max_num_seqs", 10**9, "activations"),
    ("max_num_batched_tokens", 10**12, "activations"),
])
def test_sizes_past_memory_are_refused_naming_the_option(llama_dir, option, value, what):
    """Each is below the int32 limits but beyond what memory holds: refused by the plan,
    naming the option, its bytes and the bytes available, not an allocator or oneDNN
    error naming nothing."""
    message = _refusal(llama_dir, **{option: value})
    available = device.free_memory("cpu").device
    assert message.startswith(f"{option} {value} asks for "), message
    assert what in message and f"lower {option}" in message, message
    shown = int(message.split(" bytes) is available")[0].rsplit("(", 1)[1])
    assert abs(shown - available) < 2**30  # the machine's available memory, not a guess


def test_the_plan_compares_asked_sizes_with_each_tier():
    """The plan alone, over made-up sizes: on a GPU the device tier is compared with the
    GPU's free memory (exact bytes in the message); a device_memory budget bounds the KV
    pool itself, so the same num_kv_blocks under one is no error; the exact fit runs."""
    from fusegen.engine.memory.plan import FreeMemory, ModelShape, plan_engine
    from fusegen.engine.options import EngineOptions
    mib = 2**20
    shape = ModelShape(num_layers=8, layer_params=mib, fixed_params=2 * mib, kv_width=64,
                       activation_width=1000, vocab_size=1000, max_position_embeddings=256,
                       dtype_bytes=4)
    gpu = FreeMemory(device=2**30, host=2**30, on_gpu=True)
    block = 8 * 16 * 64 * 4  # layers x block_size x kv_width x fp32
    with pytest.raises(EngineConfigError) as info:
        plan_engine(EngineOptions(num_kv_blocks=10**6), shape, gpu)
    assert str(info.value).startswith(
        f"num_kv_blocks 1000000 asks for 30.52 GiB ({10**6 * block} bytes) of KV cache "
        f"({block} bytes a block); "), info.value
    used = plan_engine(EngineOptions(num_kv_blocks=16), shape, gpu).placement
    rest = sum(used.device_bytes.values()) - 16 * block
    fits = (2**30 - rest) // block
    assert str(info.value).endswith(f"of the GPU, but 1.00 GiB ({2**30} bytes) is available:"
                                    f" lower num_kv_blocks to at most {fits}"), info.value
    budgeted = plan_engine(EngineOptions(num_kv_blocks=10**6, device_memory=2**29), shape, gpu)
    assert budgeted.placement.device_budget == 2**29
    assert plan_engine(EngineOptions(num_kv_blocks=fits), shape, gpu).placement \
        .num_device_kv_blocks == fits
    with pytest.raises(EngineConfigError):
        plan_engine(EngineOptions(num_kv_blocks=fits + 1), shape, gpu)


def test_a_group_is_refused_before_any_rank_starts(llama_dir, monkeypatch):
    """tensor_parallel_size 2 x pipeline_parallel_size 2 with a huge num_kv_blocks: the
    plan (each rank's share of the memory) refuses it in the caller, not a failed group."""
    from fusegen.engine.parallel import group
    monkeypatch.setattr(group.DeviceGroup, "__init__", lambda *a, **k: pytest.fail(
        "a rank was started"))
    message = _refusal(llama_dir, num_kv_blocks=10**9, tensor_parallel_size=2,
                       pipeline_parallel_size=2)
    assert message.startswith("num_kv_blocks 1000000000 asks for "), message
    assert "(each rank's share)" in message, message


def test_sizes_that_fit_still_run(llama_dir):
    """The check refuses only what does not fit: asked-for sizes within memory run."""
    with LLM(str(llama_dir), device="cpu", num_kv_blocks=64, num_host_kv_blocks=16,
             max_num_seqs=8, max_num_batched_tokens=512) as llm:
        assert llm.engine.config.placement.num_device_kv_blocks == 64


# -- fusegen quantize: where the output goes, signals, --calibration -----------------

run_quantize = partial(run_command, "quantize")
QUANTIZE = ("--bits", 8, "--group-size", 32)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Llama, 96 hidden and 160 intermediate (groups of 32 divide both)."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("src"), "llama", hidden_size=96,
                              intermediate_size=160)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("hello world\nthe quick brown fox\n")
    return path


def test_quantize_output_that_cannot_be_made_is_refused_before_calibrating(
        src, tmp_path, prompts, monkeypatch):
    """An --output under a file is named at once, before AWQ's calibration pass."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    calibrated = []
    monkeypatch.setattr(qz, "calibrate", lambda *a: calibrated.append(1) or {})
    out = blocker / "sub" / "q"
    result = run_quantize("--model", src, *QUANTIZE, "--method", "awq", "--calibration",
                          prompts, "--output", out)
    assert result.exit_code == 2, result.output
    assert "'--output'" in result.output and f"{blocker} is not a directory" in result.output
    assert calibrated == [] and blocker.read_text() == "x"


def test_quantize_failed_write_is_named_and_leaves_nothing(src, tmp_path, monkeypatch):
    real = qz._write_shard

    def full(path, planned, tensors):
        real(path, planned, tensors)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(qz, "_write_shard", full)
    out = tmp_path / "q"
    assert_usage_error(run_quantize("--model", src, *QUANTIZE, "--output", out),
                       "'--output'", f"{out} was not written", "No space left on device",
                       out=out)


@pytest.mark.parametrize("overwrite", [False, True])
def test_quantize_sigterm_mid_write_leaves_nothing_half_written(src, tmp_path, monkeypatch,
                                                               overwrite):
    """SIGTERM while the weights are written unwinds as Ctrl-C does: staging removed, an
    existing --output as it was, exit status 143."""
    out = tmp_path / "q"
    if overwrite:
        out.mkdir()
        (out / "config.json").write_text("{}")
    real = qz._write_shard

    def stopped(path, planned, tensors):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(path, planned, tensors)

    monkeypatch.setattr(qz, "_write_shard", stopped)
    result = run_quantize("--model", src, *QUANTIZE, "--output", out,
                          *(("--overwrite",) if overwrite else ()))
    assert result.exit_code == 143, result.output
    assert f"interrupted by SIGTERM; {out} " in result.output
    assert not list(tmp_path.glob(".q.*"))
    if overwrite:
        assert [p.name for p in out.iterdir()] == ["config.json"]
        assert (out / "config.json").read_text() == "{}"
    else:
        assert not out.exists()


def test_quantize_overwrite_replaces_a_checkpoint_not_any_folder(src, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "results.parquet").write_text("keep")
    result = run_quantize("--model", src, *QUANTIZE, "--output", data, "--overwrite")
    assert result.exit_code == 2, result.output
    assert f"{data} holds files but no config.json: --overwrite replaces a checkpoint " \
        "directory" in result.output
    assert [p.name for p in data.iterdir()] == ["results.parquet"]
    out = tmp_path / "q"
    for _ in range(2):  # made, then replaced
        result = run_quantize("--model", src, *QUANTIZE, "--output", out, "--overwrite")
        assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 8


@pytest.mark.parametrize("command, method", [("quantize", "awq"), ("sparsify", "wanda")])
def test_a_calibration_directory_is_named_as_one(src, tmp_path, command, method):
    out = tmp_path / "o"
    extra = QUANTIZE if command == "quantize" else ("--sparsity", 0.5)
    result = run_command(command, "--model", src, *extra, "--method", method,
                         "--calibration", tmp_path, "--output", out)
    assert_usage_error(result, "'--calibration'", f"{tmp_path} is a directory; --calibration "
                       "takes a file", out=out)
    assert "no such calibration file" not in result.output


# -- staging folders left by writers that were killed ---------------------------------

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_writers_staging_is_removed_a_live_ones_kept(src, tmp_path):
    """A writer killed by SIGKILL leaves `.NAME.partial-HOST-PID`; the next writer of
    NAME on that host removes it, and leaves alone the staging of a writer still running
    and any other host's (a shared file system: its PIDs are not this host's)."""
    from fusegen.engine.weights.quantize import _writer_tag
    out = tmp_path / "q"
    dead_pid = _dead_pid()
    dead = tmp_path / f".q.partial-{_writer_tag(dead_pid)}"
    live_writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = tmp_path / f".q.partial-{_writer_tag(live_writer.pid)}"
        other = tmp_path / f".other.partial-{_writer_tag(_dead_pid())}"  # another output's
        elsewhere = tmp_path / f".q.partial-{_writer_tag(dead_pid).rpartition('-')[0]}x-{dead_pid}"
        for folder in (dead, live, other, elsewhere):
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(b"half")
        result = run_quantize("--model", src, *QUANTIZE, "--output", out)
        assert result.exit_code == 0, result.output
        assert not dead.exists()
        assert (live / "model.safetensors").read_bytes() == b"half"
        assert other.exists()
        assert elsewhere.exists()  # another host's writer
        assert (out / "config.json").is_file()
    finally:
        live_writer.kill()
        live_writer.wait()


# -- checkpoints missing a part: the sparse tiles' declaration, a shard ----------------

def test_sparse_tiles_without_their_config_entry_are_named(src, tmp_path):
    """A sparse checkpoint whose config.json lost its sparsity_config: the tiles' tensors
    are named as sparse tiles the config does not describe, not as unexpected tensors."""
    from fusegen.engine.weights import sparsify as sp
    out = tmp_path / "s"
    sp.sparsify_checkpoint(src, out, sp.SparsifySpec(0.5))
    config = json.loads((out / "config.json").read_text())
    del config["sparsity_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(out), device="cpu")
    message = str(info.value)
    assert "is a sparse tile table" in message, message
    assert "config.json has no 'sparsity_config' entry that describes the sparse tiles" \
        in message, message
    assert "unexpected tensor" not in message


def _split_shards(src, out, second) -> None:
    """`src`'s tensors written as two shards (`second(name)` picks the second's) with
    their index, as a hub checkpoint is."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    tensors = load_file(str(src / "model.safetensors"))
    names = {"model-00001-of-00002.safetensors": [n for n in tensors if not second(n)],
             "model-00002-of-00002.safetensors": [n for n in tensors if second(n)]}
    for file, held in names.items():
        save_file({n: tensors[n].contiguous() for n in held}, str(out / file))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, held in names.items() for n in held}}))


@pytest.mark.parametrize("second, error", [
    (lambda n: n.startswith("model.layers.1."), "num_hidden_layers is 2; expected 1"),
    (lambda n: n.startswith("model.layers.1.mlp") or n == "model.norm.weight",
     "weights missing for model.norm.weight, model.layers.1.mlp.gate_proj.weight"),
])
def test_a_missing_last_shard_and_index_are_named(src, tmp_path, second, error):
    """The last shard and the index gone: the error names the layer whose tensors are
    absent (or the tensors) and the missing shard, not only a layer count."""
    out = tmp_path / "m"
    _split_shards(src, out, second)
    (out / "model-00002-of-00002.safetensors").unlink()
    (out / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelLoadError) as info:
        LLM(str(out), device="cpu")
    message = str(info.value)
    assert error in message, message
    if "expected 1" in error:
        assert "no tensors of layer model.layers.1.*" in message, message
    assert "the checkpoint is sharded in 2 files and model-00002-of-00002.safetensors is " \
        f"missing from {out} (as is model.safetensors.index.json): copy the missing " \
        "files" in message, message


# -- Ctrl-C while the calibration engine loads ----------------------------------------

_LOADING = """
import sys, pathlib, torch
from fusegen.engine import llm
def build(model, options):  # an engine still loading, in torch's native code
    pathlib.Path(sys.argv[1]).write_text("loading")
    a = torch.randn(256, 256)
    while True:
        a = torch.tanh(a @ a)
llm.EngineConfig.build = staticmethod(build)
from fusegen.jobs.cli import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("command, extra", [
    ("sparsify", ("--sparsity", "0.5", "--method", "wanda")),
    ("quantize", ("--bits", "8", "--group-size", "32", "--method", "awq")),
])
def test_ctrl_c_while_the_calibration_engine_loads_exits_130(src, tmp_path, prompts,
                                                             command, extra):
    """SIGINT while the engine of the calibration pass is still being built: the command
    says so and exits 130. Its engine thread (a daemon, still inside torch) must not be
    stopped by the interpreter's exit, which aborted the process (status 134,
    "terminate called without an active exception")."""
    flag, out = tmp_path / "loading", tmp_path / "o"
    script = tmp_path / "loading.py"
    script.write_text(_LOADING)
    child = subprocess.Popen(
        [sys.executable, str(script), str(flag), command, "--model", str(src), *extra,
         "--calibration", str(prompts), "--output", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not flag.exists() and child.poll() is None:
            time.sleep(0.05)
        time.sleep(0.3)
        child.send_signal(signal.SIGINT)
        output = child.communicate(timeout=120)[0]
    finally:
        child.kill()
    assert child.returncode == 130, output
    assert f"interrupted by SIGINT; {out} not written" in output
    assert "terminate called" not in output
    assert not out.exists() and not list(tmp_path.glob(".o.*"))
