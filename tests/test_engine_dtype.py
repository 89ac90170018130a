"""dtype "auto": bf16 on GPUs; on CPUs bf16 exactly where the flags show bf16 units (AMX,
AVX512_BF16), fp32 elsewhere. Nothing is timed: the choice is the same on every start."""
import pytest
import torch

from fusegen.engine.memory import device


def _flags(monkeypatch, amx: bool, avx512_bf16: bool):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16,
                        raising=False)


def test_gpus_run_bf16(monkeypatch):
    _flags(monkeypatch, amx=False, avx512_bf16=False)
    assert device.resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert device.resolve_dtype("auto", "cuda:0,1") == torch.bfloat16


@pytest.mark.parametrize("amx, avx512_bf16, want", [
    (True, False, torch.bfloat16),
    (False, True, torch.bfloat16),
    (True, True, torch.bfloat16),
    (False, False, torch.float32),
])
def test_cpus_follow_their_flags_only(monkeypatch, amx, avx512_bf16, want):
    _flags(monkeypatch, amx, avx512_bf16)
    assert device.resolve_dtype("auto", "cpu") == want


def test_nothing_is_timed_or_computed(monkeypatch):
    """The choice that once timed a matmul at each start (and so flipped on a busy
    machine) reads the flags only: no clock, no product."""
    import time

    _flags(monkeypatch, amx=False, avx512_bf16=True)
    for name in ("perf_counter", "perf_counter_ns", "monotonic", "process_time"):
        monkeypatch.setattr(time, name, lambda n=name: pytest.fail(f"time.{n} called"))
    for name in ("matmul", "mm", "randn"):
        monkeypatch.setattr(torch, name, lambda *a, n=name, **k: pytest.fail(f"torch.{n}"))
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda *a, **k: pytest.fail("linear called"))
    assert [device.resolve_dtype("auto", "cpu") for _ in range(3)] == [torch.bfloat16] * 3
    assert not hasattr(device, "matmul_seconds") and not hasattr(device, "cpu_prefers_bf16")


def test_explicit_dtypes_are_kept(monkeypatch):
    _flags(monkeypatch, amx=False, avx512_bf16=False)
    assert device.resolve_dtype("float16", "cpu") == torch.float16
    assert device.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert device.resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
