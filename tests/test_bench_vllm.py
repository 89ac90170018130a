"""`fusegen bench --vllm-python`: vLLM's offline API in another interpreter, here a fake
`vllm` package on the current interpreter's path (the real one is measured by hand).
The fake records what it was asked and answers exactly max_tokens ids per request."""
from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from fusegen.jobs.bench import vllm_runner
from fusegen.jobs.bench.harness import BenchConfig, _run_vllm, workload_for
from fusegen.jobs.bench.presets import PRESETS, OffloadSpec
from fusegen.jobs.bench.vllm_runner import run_vllm, vllm_env
from fusegen.jobs.bench_cmd import bench

_FAKE_INIT = '''
import json, os, sys, time

__version__ = "0.0.fake"


class SamplingParams:
    def __init__(self, max_tokens, temperature=1.0, ignore_eos=False):
        self.max_tokens, self.temperature, self.ignore_eos = max_tokens, temperature, ignore_eos


class _Completion:
    def __init__(self, token_ids, finish_reason):
        self.token_ids, self.finish_reason = token_ids, finish_reason


class _Output:
    def __init__(self, prompt_token_ids, completion):
        self.prompt_token_ids, self.outputs = prompt_token_ids, [completion]


class LLM:
    def __init__(self, **kwargs):
        if os.environ.get("FAKE_VLLM_EXIT"):
            os._exit(3)  # a crash: no result file
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError(os.environ["FAKE_VLLM_FAIL"])
        if os.environ.get("FAKE_VLLM_WORKER_ERROR"):  # vLLM's engine process, then its parent
            print("(Worker pid=1) ERROR [executor.py:1] RuntimeError: "
                  + os.environ["FAKE_VLLM_WORKER_ERROR"], file=sys.stderr)
            raise RuntimeError("EngineCore encountered an issue. See stack trace (above)")
        time.sleep(float(os.environ.get("FAKE_VLLM_SLEEP", "0")))
        self.kwargs = kwargs
        held = int(os.environ.get("FAKE_VLLM_ENGINE_MB", "0"))
        if held:  # an engine process of its own holding memory, as vLLM's engine core
            import subprocess
            self.engine = subprocess.Popen([sys.executable, "-c",
                f"b = bytearray({held} << 20); b[::4096] = b'x' * len(b[::4096]); "
                "import time; print('held', flush=True); time.sleep(60)"],
                stdout=subprocess.PIPE)
            self.engine.stdout.readline()  # the memory is touched
            time.sleep(0.5)  # sampled a few times

    def generate(self, prompts, params, *, use_tqdm=True):
        record = os.environ.get("FAKE_VLLM_RECORD")
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({
                    "kwargs": self.kwargs, "use_tqdm": use_tqdm,
                    "prompts": [p["prompt_token_ids"] for p in prompts],
                    "params": [[p.max_tokens, p.temperature, p.ignore_eos] for p in params],
                }) + "\\n")
        time.sleep(0.01)
        return [_Output(list(p["prompt_token_ids"]), _Completion([7] * sp.max_tokens, "length"))
                for p, sp in zip(prompts, params)]
'''

_FAKE_INPUTS = '''
from typing import TypedDict


class TokensPrompt(TypedDict):
    prompt_token_ids: list
'''


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory) -> Path:
    """A folder holding the fake `vllm` package (for PYTHONPATH)."""
    root = tmp_path_factory.mktemp("fake-vllm")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(_FAKE_INIT)
    (root / "vllm" / "inputs.py").write_text(_FAKE_INPUTS)
    return root


@pytest.fixture(scope="module")
def fake_python(fake_vllm, tmp_path_factory) -> Path:
    """An interpreter with the fake vllm installed: a wrapper, as a venv's bin/python is."""
    path = tmp_path_factory.mktemp("fake-venv") / "bin" / "python"
    path.parent.mkdir()
    path.write_text(f'#!/bin/sh\nPYTHONPATH="{fake_vllm}" exec "{sys.executable}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")


def _tiny_workload(cache_dir):
    config = BenchConfig(replace(PRESETS["tiny"], num_requests=5), cache_dir=cache_dir)
    return workload_for(config)


def _run(python, tmp_path, cache_dir, **env):
    requests, warmup = _tiny_workload(cache_dir)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = run_vllm(str(python), tmp_path / "model", requests, warmup, dtype="float32",
                      device="cpu", max_model_len=128, seed=3, log_path=tmp_path / "vllm.log",
                      timeout_s=env.pop("timeout_s", 120), env={**base, **env})
    return result, requests, warmup


# --- the runner over the fake -------------------------------------------------------------

def test_fake_vllm_gets_the_workload_and_counts_come_back(fake_vllm, tmp_path, cache_dir):
    record = tmp_path / "record.jsonl"
    result, requests, warmup = _run(sys.executable, tmp_path, cache_dir,
                                    PYTHONPATH=str(fake_vllm), FAKE_VLLM_RECORD=str(record))
    assert result.skipped is None
    assert result.name == "vllm" and result.label == "vLLM 0.0.fake (cpu)"
    assert result.counts == [(r.num_prompt_tokens, r.max_tokens) for r in requests]
    assert result.budgets_met is True
    assert result.elapsed_s > 0 and result.load_s >= 0
    assert result.extra["vllm_version"] == "0.0.fake"
    assert result.extra["finish_reasons"] == {"length": len(requests)}
    assert result.extra["log"] == str(tmp_path / "vllm.log")
    assert result.peak_rss_bytes > 0  # sampled while it ran
    # warm-up first, then the timed requests: exactly the workload's ids and budgets, greedy
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [c["prompts"] for c in calls] == [[r.prompt_ids for r in warmup],
                                             [r.prompt_ids for r in requests]]
    assert calls[1]["params"] == [[r.max_tokens, 0.0, True] for r in requests]
    assert calls[1]["kwargs"] == {"model": str(tmp_path / "model"), "dtype": "float32",
                                  "max_model_len": 128, "seed": 3}
    assert calls[1]["use_tqdm"] is False


def test_a_missing_interpreter_is_a_skipped_row(tmp_path, cache_dir):
    result, _, _ = _run(tmp_path / "no" / "python", tmp_path, cache_dir)
    assert result.skipped.startswith("skipped: --vllm-python")
    assert "not an executable file" in result.skipped and result.counts == []


def test_an_interpreter_without_vllm_is_a_skipped_row(tmp_path, cache_dir):
    result, _, _ = _run(sys.executable, tmp_path, cache_dir)
    assert "ModuleNotFoundError: No module named 'vllm'" in result.skipped
    assert str(tmp_path / "vllm.log") in result.skipped


def test_vllm_error_reaches_the_reason(fake_vllm, tmp_path, cache_dir):
    result, _, _ = _run(sys.executable, tmp_path, cache_dir, PYTHONPATH=str(fake_vllm),
                        FAKE_VLLM_FAIL="no AVX512 here")
    assert "RuntimeError: no AVX512 here" in result.skipped
    assert "no AVX512 here" in (tmp_path / "vllm.log").read_text()  # the traceback


def test_the_engine_process_error_is_found_in_the_log(fake_vllm, tmp_path, cache_dir):
    result, _, _ = _run(sys.executable, tmp_path, cache_dir, PYTHONPATH=str(fake_vllm),
                        FAKE_VLLM_WORKER_ERROR="Unsupported CPU attention configuration: "
                                               "head_dim=16")
    assert result.skipped.startswith("skipped: vLLM could not run: RuntimeError: EngineCore "
                                     "encountered an issue. See stack trace (above) (root cause "
                                     "in the log: RuntimeError: Unsupported CPU attention "
                                     "configuration: head_dim=16)")


def test_a_crashed_child_is_a_skipped_row(fake_vllm, tmp_path, cache_dir):
    result, _, _ = _run(sys.executable, tmp_path, cache_dir, PYTHONPATH=str(fake_vllm),
                        FAKE_VLLM_EXIT="1")
    assert "ended without a result" in result.skipped


def test_a_timeout_is_a_skipped_row(fake_vllm, tmp_path, cache_dir):
    result, _, _ = _run(sys.executable, tmp_path, cache_dir, PYTHONPATH=str(fake_vllm),
                        FAKE_VLLM_SLEEP="60", timeout_s=2)
    assert "did not finish within --vllm-timeout 2 s" in result.skipped


def test_offload_presets_skip_vllm(tmp_path):
    preset = replace(PRESETS["tiny"], offload=OffloadSpec(resident_fraction=0.5))
    config = BenchConfig(preset, cache_dir=tmp_path, vllm_python=sys.executable)
    [result] = _run_vllm(config, tmp_path, [], [], lambda _: None)
    assert result.skipped == "skipped: vLLM has no comparable offload mode"
    assert _run_vllm(replace(config, vllm_python=None), tmp_path, [], [], lambda _: None) == []


# --- the environment vLLM's CPU engine wants ----------------------------------------------

def test_cpu_environment_is_computed(tmp_path, monkeypatch):
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_text("")
    monkeypatch.setattr(vllm_runner, "TCMALLOC", tcmalloc)
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_text("")
    env, used = vllm_env(str(venv / "bin" / "python"), "cpu", {"HOME": "/h"})
    cores = len(os.sched_getaffinity(0))
    assert used == {"LD_PRELOAD": f"{tcmalloc}:{venv}/lib/libiomp5.so",
                    "VLLM_CPU_KVCACHE_SPACE": "4",
                    "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}
    assert env == {"HOME": "/h", **used}
    # neither library present: no LD_PRELOAD at all
    monkeypatch.setattr(vllm_runner, "TCMALLOC", tmp_path / "absent.so")
    _, used = vllm_env(str(tmp_path / "other" / "bin" / "python"), "cpu", {})
    assert "LD_PRELOAD" not in used
    # not a CPU run: nothing computed
    assert vllm_env(str(venv / "bin" / "python"), "cuda", {"A": "1"}) == ({"A": "1"}, {})


def test_user_set_variables_win(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_runner, "TCMALLOC", tmp_path / "absent.so")
    mine = {"VLLM_CPU_KVCACHE_SPACE": "16", "LD_PRELOAD": "/mine.so",
            "VLLM_CPU_OMP_THREADS_BIND": "0"}
    env, used = vllm_env(str(tmp_path / "bin" / "python"), "cpu", mine)
    assert env == mine and used == mine


# --- the preset --------------------------------------------------------------------------

def test_cpu_prefill_preset(tmp_path):
    preset = PRESETS["cpu-prefill"]
    assert preset.model == replace(PRESETS["cpu-small"].model, max_position_embeddings=2048)
    assert (preset.run_dtype, preset.hf_batch_size) == ("auto", 16)
    requests, _ = workload_for(BenchConfig(preset, cache_dir=tmp_path))
    assert len(requests) == 64
    assert {(r.num_prompt_tokens, r.max_tokens) for r in requests} == {(1024, 128)}
    assert 1024 + 128 <= preset.model.max_position_embeddings


# --- the command -------------------------------------------------------------------------

def _bench(cache_dir, tmp_path, python, *extra):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "4", "--skip-hf",
                                        "--vllm-python", str(python), "--cache-dir",
                                        str(cache_dir), "--json", str(out), *extra])
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text())


def test_bench_reports_vllm_beside_fusegen(fake_python, cache_dir, tmp_path):
    result, report = _bench(cache_dir, tmp_path, fake_python)
    fusegen, vllm = report["results"]["fusegen"], report["results"]["vllm"]
    device = report["machine"]["device"]  # cuda where a GPU is visible
    assert vllm["label"] == f"vLLM 0.0.fake ({device})" and vllm["budgets_met"] is True
    assert vllm["num_output_tokens"] == fusegen["num_output_tokens"] == \
        report["workload"]["num_output_tokens"]
    assert vllm["model_flops"] == fusegen["model_flops"] > 0
    assert list(report["results"]) == ["fusegen", "vllm", "hf_static", "hf_continuous"]
    assert set(report["ratios"]) == {"vllm"}
    assert report["ratios"]["vllm"]["output_tokens_per_s"] == pytest.approx(
        fusegen["output_tokens_per_s"] / vllm["output_tokens_per_s"])
    row = next(line for line in result.stdout.splitlines() if line.startswith("vLLM 0.0.fake"))
    ratio = report["ratios"]["vllm"]["output_tokens_per_s"]
    assert row.rstrip().endswith(f"{ratio:.2f}x")


def test_bench_goes_on_when_vllm_fails(fake_python, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "no AVX512 here")
    result, report = _bench(cache_dir, tmp_path, fake_python)
    assert "no AVX512 here" in report["results"]["vllm"]["skipped"]
    assert report["results"]["fusegen"]["budgets_met"] and report["ratios"] == {}
    assert "no AVX512 here" in result.stdout  # the table's vLLM row


def test_bench_takes_the_interpreter_from_the_environment(cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEGEN_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "2", "--skip-hf",
                                        "--cache-dir", str(cache_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    skipped = json.loads(out.read_text())["results"]["vllm"]["skipped"]
    assert str(tmp_path / "nowhere" / "python") in skipped


def test_peak_rss_counts_the_engine_processes_vllm_starts(fake_vllm, tmp_path, cache_dir):
    # vLLM runs its engine core in a process of its own: its memory is the baseline's too
    alone, _, _ = _run(sys.executable, tmp_path, cache_dir, PYTHONPATH=str(fake_vllm))
    held, _, _ = _run(sys.executable, tmp_path, cache_dir, PYTHONPATH=str(fake_vllm),
                      FAKE_VLLM_ENGINE_MB="200")
    assert alone.skipped is None and held.skipped is None
    assert held.peak_rss_bytes >= alone.peak_rss_bytes + (180 << 20)
