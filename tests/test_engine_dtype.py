"""dtype "auto": bf16 on GPUs; on CPUs bf16 only where the flags show bf16 units and a
measured matmul through the engine's linear shows them paying by a clear margin."""
import pytest
import torch

from fusegen.engine import config


@pytest.fixture(autouse=True)
def fresh_choice():
    config.cpu_prefers_bf16.cache_clear()
    yield
    config.cpu_prefers_bf16.cache_clear()


def test_gpus_run_bf16():
    assert config.resolve_dtype("auto", "cuda:1") == torch.bfloat16


def test_no_bf16_units_means_fp32_without_measuring(monkeypatch):
    monkeypatch.setattr(config, "cpu_supports_bf16", lambda: False)
    monkeypatch.setattr(config, "matmul_seconds", lambda dtype: pytest.fail("measured"))
    assert config.resolve_dtype("auto", "cpu") == torch.float32


@pytest.mark.parametrize("fp32_s, bf16_s, want", [
    (1.0, 0.2, torch.bfloat16),  # AMX: about 5x
    (1.0, 1.0 / 1.5, torch.bfloat16),  # exactly the margin
    (1.0, 0.8, torch.float32),  # units present but paying too little to be sure
    (1.0, 4.0, torch.float32),  # emulated
])
def test_bf16_units_are_measured(monkeypatch, fp32_s, bf16_s, want):
    monkeypatch.setattr(config, "cpu_supports_bf16", lambda: True)
    seconds = {torch.float32: fp32_s, torch.bfloat16: bf16_s}
    monkeypatch.setattr(config, "matmul_seconds", seconds.__getitem__)
    assert config.resolve_dtype("auto", "cpu") == want


def test_the_measurement_runs_the_engines_linear():
    assert 0 < config.matmul_seconds(torch.float32, rows=8, size=64) < 1.0


def test_explicit_dtypes_are_kept():
    assert config.resolve_dtype("float16", "cpu") == torch.float16
    assert config.resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
