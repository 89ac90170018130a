"""The host-share harness (jobs/bench/host_share.py): the real engine loop around a
stubbed model, on the tiny preset's checkpoint, with exact step and token counts."""
import json

import pytest
from click.testing import CliRunner

from fusegen.jobs.bench.host_share import (PHASES, HostShareConfig, PhaseTimer, main,
                                           measure, tiny_checkpoint)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("host-share-cache"))


@pytest.mark.parametrize("batch_size, sampled", [(1, False), (5, False), (3, True)])
def test_counts_are_exact_and_every_token_is_the_stubs(tiny_dir, batch_size, sampled):
    config = HostShareConfig(batch_size, prompt_len=6, output_len=9, warmup_steps=2,
                             sampled=sampled)
    r = measure(tiny_dir, config)
    # one step admits every request and samples its first token; 8 decode steps follow
    assert r["num_steps"] == 9 and r["num_decode_steps"] == 8
    assert r["model_calls"] == 9
    assert r["num_generated_tokens"] == batch_size * 9
    assert r["num_outputs"] == batch_size and r["tokens_as_stubbed"]
    assert r["timed_steps"] == 8 - 2
    us = r["us_per_step"]
    assert set(us) == {*PHASES, "step"}
    assert all(us[p] > 0 for p in ("schedule", "inputs", "copies", "sampling", "update"))
    assert sum(us[p] for p in PHASES) == pytest.approx(us["step"])


def test_bad_configs_name_the_value():
    with pytest.raises(ValueError, match="batch_size 0 must be at least 1"):
        HostShareConfig(0)
    with pytest.raises(ValueError, match="output_len 4 leaves no timed decode step"):
        HostShareConfig(1, output_len=4)
    with pytest.raises(ValueError, match="clock 'gpu' is none of wall, cpu"):
        PhaseTimer("gpu")


def test_command_prints_and_writes_each_batch_size(tiny_dir, tmp_path):
    out = tmp_path / "host.json"
    result = CliRunner().invoke(main, ["--batch-sizes", "1,2", "--output-len", "6",
                                       "--repeats", "2", "--clock", "cpu",
                                       "--model", str(tiny_dir),
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].split()[:2] == ["batch", "step"] and [ln.split()[0] for ln in lines[1:]] \
        == ["1", "2"]
    report = json.loads(out.read_text())
    assert [m["batch_size"] for m in report["medians"]] == [1, 2]
    assert [len(report["runs"][b]) for b in ("1", "2")] == [2, 2]
    assert all(r["num_generated_tokens"] == r["batch_size"] * 6
               for runs in report["runs"].values() for r in runs)
    bad = CliRunner().invoke(main, ["--batch-sizes", "1,x"])
    assert bad.exit_code == 2 and "'1,x': give batch sizes as integers" in bad.output
