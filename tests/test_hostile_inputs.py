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
import torch

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
        (out / "keep.txt").write_text("old")
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
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
