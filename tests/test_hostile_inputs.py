"""Bad inputs to fusegen's newest surfaces (`fusegen sparsify`, sparse checkpoints, the
engine's parallel and memory options, `fusegen bench`): each refused with an error that
names the value and what is allowed, before anything is written or loaded, and nothing
left half-written."""
import errno
import json
import os
import shutil
import signal
from functools import partial

import pytest

from checkpoints import make_hf_checkpoint
from quant_helpers import assert_usage_error, run_command
from fusegen.engine.weights import quantize as qz
from fusegen.engine.weights import sparsify as sp

run_sparsify = partial(run_command, "sparsify")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Llama, 96 hidden and 160 intermediate: tiles cut at the matrices' edges."""
    return make_hf_checkpoint(tmp_path_factory.mktemp("src"), "llama", hidden_size=96,
                              intermediate_size=160)


# -- fusegen sparsify: where the output goes ------------------------------------------

def test_output_that_cannot_be_made_is_refused_before_calibrating(src, tmp_path,
                                                                  monkeypatch):
    """An --output under a file (or anywhere no directory can be made) is named at once,
    before Wanda's calibration pass, not found when the pruned weights are written."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\nthe quick brown fox\n")
    calibrated = []
    monkeypatch.setattr(sp, "wanda_norms", lambda *a: calibrated.append(1) or {})
    out = blocker / "sub" / "s"
    result = run_sparsify("--model", src, "--sparsity", 0.5, "--method", "wanda",
                          "--calibration", prompts, "--output", out)
    assert result.exit_code == 2, result.output
    assert "'--output'" in result.output and f"{blocker} is not a directory" in result.output
    assert calibrated == [] and blocker.read_text() == "x"


def test_a_failed_write_is_named_and_leaves_nothing(src, tmp_path, monkeypatch):
    """A write that fails midway (a full disk) is a usage error naming --output and the
    cause; no output and no staging directory are left."""
    real = qz._write_shard

    def full(path, planned, tensors):
        real(path, planned, tensors)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(qz, "_write_shard", full)
    out = tmp_path / "s"
    assert_usage_error(run_sparsify("--model", src, "--sparsity", 0.5, "--output", out),
                       "'--output'", f"{out} was not written", "No space left on device",
                       out=out)


@pytest.mark.parametrize("overwrite", [False, True])
def test_sigterm_mid_write_leaves_nothing_half_written(src, tmp_path, monkeypatch, overwrite):
    """SIGTERM (a scheduler's stop, `timeout`) while the weights are written: the staging
    directory is removed, an existing --output stays as it was, exit status 143."""
    out = tmp_path / "s"
    if overwrite:
        out.mkdir()
        (out / "config.json").write_text("{}")  # an earlier checkpoint, as far as it goes
    real = qz._write_shard

    def stopped(path, planned, tensors):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(path, planned, tensors)

    monkeypatch.setattr(qz, "_write_shard", stopped)
    args = ("--model", src, "--sparsity", 0.5, "--output", out)
    result = run_sparsify(*args, *(("--overwrite",) if overwrite else ()))
    assert result.exit_code == 143, result.output
    assert f"interrupted by SIGTERM; {out} " in result.output
    assert not list(tmp_path.glob(".s.*"))
    if overwrite:
        assert [p.name for p in out.iterdir()] == ["config.json"]
        assert (out / "config.json").read_text() == "{}"
    else:
        assert not out.exists()


def test_overwrite_replaces_a_checkpoint_not_any_folder(src, tmp_path):
    """--overwrite with an --output that holds files but no config.json (a typo for the
    parent, a data folder) is refused with the folder untouched; an empty folder or an
    earlier checkpoint is replaced."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "results.parquet").write_text("keep")
    result = run_sparsify("--model", src, "--sparsity", 0.5, "--output", data, "--overwrite")
    assert result.exit_code == 2, result.output
    assert f"{data} holds files but no config.json: --overwrite replaces a checkpoint " \
        "directory" in result.output
    assert [p.name for p in data.iterdir()] == ["results.parquet"]
    out = tmp_path / "s"
    for _ in range(2):  # made, then replaced
        result = run_sparsify("--model", src, "--sparsity", 0.5, "--output", out,
                              "--overwrite")
        assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["sparsity_config"]["sparsity"] == 0.5


# -- sparse checkpoints whose tables or declaration were changed ------------------------

Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def sparse_dir(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("sparse") / "s"
    sp.sparsify_checkpoint(src, out, sp.SparsifySpec(0.5))
    return out


def _tampered(sparse_dir, dst, edit=None, config_edit=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(sparse_dir, dst)
    if edit is not None:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_edit is not None:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config["sparsity_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _load_error(path) -> str:
    from fusegen.engine import LLM
    from fusegen.engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError) as info:
        LLM(str(path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2)
    return str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_kept_value_that_is_not_finite_is_named(sparse_dir, tmp_path, bad):
    """A NaN or inf among a weight's kept values would turn every token to garbage: the
    load names the weight, the value's index and its tile."""
    def edit(tensors):
        values = tensors[Q + ".sparse_values"].clone()
        values[4000] = bad  # tiles of 2048, 1024, 1024, 512 values (half of 64 x 64, 64 x 32, ...)
        tensors[Q + ".sparse_values"] = values

    text = _load_error(_tampered(sparse_dir, tmp_path / "t", edit=edit))
    assert "model.safetensors" in text and repr(Q) in text
    assert f"sparse_values: value 4000 (tile 2) is {bad}; every kept weight must be finite" \
        in text


def test_a_module_listed_twice_is_named(sparse_dir, tmp_path):
    """Not reported as its tensors missing (they were taken by the first listing)."""
    text = _load_error(_tampered(sparse_dir, tmp_path / "t",
                                 config_edit=lambda c: c["modules"].append(Q)))
    assert f"sparsity_config.modules lists {Q!r} more than once" in text


# -- engine options: through LLM(...) and through a `fusegen run` job file --------------

def _job_refusal(tmp_path, src, lines: str) -> str:
    """`fusegen run` of a job file holding `lines`: its usage error (exit 1), with the
    output directory never made."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["hello"]}), tmp_path / "in.parquet")
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {src}\ninput: {tmp_path / 'in.parquet'}\n"
                   f"output: {tmp_path / 'out'}\nmax_tokens: 2\nprogress: none\n{lines}\n")
    result = run_command("run", job)
    assert result.exit_code == 1, result.output
    assert not (tmp_path / "out").exists()
    return result.output


@pytest.mark.parametrize("name", ["device_memory", "host_memory", "peer_memory"])
@pytest.mark.parametrize("value, yaml", [(1.5, "1.5"), (float("inf"), ".inf")])
def test_a_memory_budget_neither_bytes_nor_a_fraction_is_named(src, tmp_path, name, value,
                                                              yaml):
    """1.5 was read as 1 byte, and inf was an OverflowError: each is named with what the
    option takes."""
    from fusegen.engine import LLM
    from fusegen.engine.errors import EngineConfigError

    group = {"tensor_parallel_size": 2} if name == "peer_memory" else {}
    want = (f"{name}: {value!r} is neither whole bytes nor a fraction in (0, 1]; write "
            "bytes, a size like '24GiB' or a fraction like 0.8")
    with pytest.raises(EngineConfigError) as info:
        LLM(str(src), **{name: value}, **group)
    assert str(info.value) == want
    extra = "\ntensor_parallel_size: 2" if group else ""
    assert want in _job_refusal(tmp_path, src, f"{name}: {yaml}{extra}")


@pytest.mark.parametrize("options, yaml, message", [
    (dict(tensor_parallel_size=2, tensor_parallel_mode="2d"),
     "tensor_parallel_size: 2\ntensor_parallel_mode: 2d",
     "tensor_parallel_mode '2d': a Tesseract grid of 2 ranks at tesseract_depth 1 needs "
     "2 = q x q x 1 for some integer q"),
    (dict(tensor_parallel_size=4, tensor_parallel_mode="2.5d", tesseract_depth=2),
     "tensor_parallel_size: 4\ntensor_parallel_mode: 2.5d\ntesseract_depth: 2",
     "tensor_parallel_mode '2.5d': a Tesseract grid of 4 ranks at tesseract_depth 2 needs "
     "4 = q x q x 2"),
    (dict(tensor_parallel_size=4, tensor_parallel_mode="2d", pipeline_parallel_size=2),
     "tensor_parallel_size: 4\ntensor_parallel_mode: 2d\npipeline_parallel_size: 2",
     "tensor_parallel_mode '2d' runs with pipeline_parallel_size 1 (got 2)"),
    (dict(tensor_parallel_size=4, tensor_parallel_mode="2d", peer_memory="1GiB"),
     "tensor_parallel_size: 4\ntensor_parallel_mode: 2d\npeer_memory: 1GiB",
     "tensor_parallel_mode '2d' has no peer tier: leave peer_memory ('1GiB') unset"),
    (dict(tp_overlap_chunks=4), "tp_overlap_chunks: 4",
     "tp_overlap_chunks 4 splits the all-reduces of a tensor-parallel group, and "
     "tensor_parallel_size is 1"),
    (dict(tensor_parallel_size=2, async_scheduling=True),
     "tensor_parallel_size: 2\nasync_scheduling: true",
     "async_scheduling=True cannot run in a device group (tensor_parallel_size 2 x "
     "pipeline_parallel_size 1)"),
])
def test_group_options_that_contradict_are_refused_before_the_job_starts(
        src, tmp_path, options, yaml, message):
    """Refused with the options alone: a job makes no output directory (it made one, then
    failed loading the model), an `LLM` starts no process."""
    from fusegen.engine.errors import EngineConfigError
    from fusegen.engine.options import EngineOptions

    with pytest.raises(EngineConfigError) as info:
        EngineOptions(**options)
    assert str(info.value).startswith(message), str(info.value)
    assert message in _job_refusal(tmp_path, src, yaml)


# -- fusegen bench: what is found before the run ----------------------------------------

def _bench(monkeypatch, *args):
    """`fusegen bench --preset tiny ARGS`, with the run itself recorded, not done."""
    from click.testing import CliRunner

    from fusegen.jobs.bench import harness
    from fusegen.jobs.bench_cmd import bench

    runs = []
    monkeypatch.setattr(harness, "run_benchmark", lambda *a: runs.append(a) or {})
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--skip-hf", *map(str, args)])
    return result, runs


@pytest.mark.parametrize("flag", ["--json", "--report"])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(
        tmp_path, monkeypatch, flag):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result, runs = _bench(monkeypatch, flag, blocker / "out" / "b.json")
    assert result.exit_code == 2, result.output
    assert f"{flag} {blocker / 'out' / 'b.json'} cannot be written: {blocker} is not a " \
        "directory" in result.output
    assert runs == [] and blocker.read_text() == "x"


def test_a_default_report_path_that_is_a_directory_is_refused_before_the_run(
        tmp_path, monkeypatch):
    (tmp_path / "b.html").mkdir()
    result, runs = _bench(monkeypatch, "--json", tmp_path / "b.json")
    assert result.exit_code == 2, result.output
    assert f"--report {tmp_path / 'b.html'} cannot be written: it is a directory" \
        in result.output
    assert runs == []


def test_more_layers_than_the_preset_are_refused(tmp_path, monkeypatch):
    """--layers runs fewer of a preset's layers; more would build another, larger model."""
    result, runs = _bench(monkeypatch, "--layers", 3, "--cache-dir", tmp_path)
    assert result.exit_code == 2, result.output
    assert "--layers 3 is more than the tiny preset's 2; --layers runs fewer of its " \
        "layers" in result.output
    assert runs == [] and list(tmp_path.iterdir()) == []


def test_figures_are_kept_when_the_json_file_fails_after_the_run(tmp_path, capsys):
    """A write that fails once the run is over (the disk filled meanwhile) puts the
    figures in a temporary file, named in the error, instead of a traceback."""
    import re

    from fusegen.jobs.bench_cmd import _write

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as info:
        _write(blocker / "b.json", '{"tok_s": 1}\n')
    assert info.value.code == 1
    err = capsys.readouterr().err
    kept = re.search(r"the figures are in (\S+\.json)", err).group(1)
    assert f"error: {blocker / 'b.json'} was not written" in err
    assert open(kept).read() == '{"tok_s": 1}\n'
    os.remove(kept)


def test_a_config_that_is_not_an_object_is_named(src, tmp_path):
    """config.json holding a list (or a number) was an AttributeError, in `fusegen
    sparsify` and in `LLM` alike."""
    from fusegen.engine import LLM
    from fusegen.engine.errors import ModelLoadError

    bad = tmp_path / "m"
    shutil.copytree(src, bad)
    (bad / "config.json").write_text("[]")
    want = f"{bad / 'config.json'}: a JSON list, not an object of the model's settings"
    out = tmp_path / "s"
    assert_usage_error(run_sparsify("--model", bad, "--sparsity", 0.5, "--output", out),
                       "'--model'", want, out=out)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(bad))
    assert str(info.value) == want


def test_a_cache_folder_under_a_file_is_refused_before_the_run(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result, runs = _bench(monkeypatch, "--cache-dir", blocker / "cache")
    assert result.exit_code == 2, result.output
    assert f"--cache-dir {blocker / 'cache'} cannot be written: {blocker} is not a " \
        "directory" in result.output
    assert runs == []


@pytest.mark.parametrize("options, yaml, message", [
    (dict(num_host_kv_blocks=10**20), "num_host_kv_blocks: 100000000000000000000",
     "num_host_kv_blocks 100000000000000000000 is past the 2147483647 KV blocks a block "
     "table can number"),
    (dict(num_kv_blocks=2**30, num_host_kv_blocks=2**30),
     "num_kv_blocks: 1073741824\nnum_host_kv_blocks: 1073741824",
     "num_kv_blocks 1073741824 + num_host_kv_blocks 1073741824 is past the 2147483647 KV "
     "blocks"),
])
def test_block_counts_past_what_a_block_table_numbers_are_named(src, tmp_path, options, yaml,
                                                                message):
    """An int64 overflow inside torch's allocator (a traceback naming no option) before;
    the option and the limit now, before anything loads."""
    from fusegen.engine import LLM
    from fusegen.engine.errors import EngineConfigError

    with pytest.raises(EngineConfigError) as info:
        LLM(str(src), **options)
    assert str(info.value).startswith(message), str(info.value)
    assert message in _job_refusal(tmp_path, src, yaml)


def test_a_weight_past_float16_is_named_not_written_as_inf(src, tmp_path):
    """--values fp16 and a kept weight past 65504: it was written as inf (a checkpoint
    that gave garbage tokens); now the tensor, the weight and where it is are named, and
    nothing is written. bf16 keeps it."""
    from safetensors.torch import load_file, save_file

    big = tmp_path / "big"
    shutil.copytree(src, big)
    tensors = load_file(big / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name][3, 5] = 1e6
    save_file(tensors, big / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "s"
    result = run_sparsify("--model", big, "--sparsity", 0.5, "--values", "fp16",
                          "--output", out)
    assert_usage_error(result, "'--values'", f"tensor {name!r} keeps the weight 1000000.0 "
                       "(row 3, column 5), past float16's range (largest 65504); choose "
                       "--values bf16, fp32 or int8", out=out)
    result = run_sparsify("--model", big, "--sparsity", 0.5, "--values", "bf16",
                          "--output", out)
    assert result.exit_code == 0, result.output
