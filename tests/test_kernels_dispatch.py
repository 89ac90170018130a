"""The dispatchers' choices: FUSEGEN_KERNELS read at every call (a change takes effect at
the next one), and what the CPU attention derives once per step re-derived when the
step's metadata changes."""
import os

import pytest
import torch

from fusegen import kernels
from fusegen.kernels import native
from fusegen.kernels.paged_attention_cpu import paged_decode_native
from fusegen.kernels.rms_norm import rms_norm, rms_norm_reference
from tests.test_kernels_paged_attention import _make_batch

needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler here")


@pytest.mark.parametrize("value, mode", [(None, "auto"), ("auto", "auto"),
                                         ("reference", "reference"), ("triton", "triton"),
                                         ("something", "something")])
def test_kernels_mode_follows_the_environment_at_each_call(monkeypatch, value, mode):
    x = torch.zeros(3)
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    assert kernels.kernels_mode() == "reference" and not kernels.use_native(x)
    if value is None:
        monkeypatch.delenv("FUSEGEN_KERNELS")
    else:
        monkeypatch.setenv("FUSEGEN_KERNELS", value)
    assert kernels.kernels_mode() == mode == os.environ.get("FUSEGEN_KERNELS", "auto")
    assert kernels.use_triton(x) == (mode == "triton")
    assert kernels.use_native(x) == (mode == "auto" and native.library() is not None)


@needs_native
def test_a_dispatcher_obeys_a_change_between_two_calls(monkeypatch):
    from fusegen.kernels import rms_norm as module

    calls = []
    native_norm = module.rms_norm_native
    monkeypatch.setattr(module, "rms_norm_native",
                        lambda *a, **k: calls.append("native") or native_norm(*a, **k))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 64, generator=gen), torch.randn(64, generator=gen)
    monkeypatch.delenv("FUSEGEN_KERNELS", raising=False)
    rms_norm(x, w, 1e-6)
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    monkeypatch.setenv("FUSEGEN_KERNELS", "auto")
    rms_norm(x, w, 1e-6)
    assert calls == ["native", "native"]


@needs_native
def test_block_tables_changed_in_place_are_checked_again():
    batch = _make_batch([1, 1], [9, 5], 4, 2, 32, 4)
    args = [batch[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens",
                               "query_start_loc")]
    out = torch.empty_like(batch["q"])
    paged_decode_native(*args, out, scale=batch["scale"])  # checked and remembered
    first = out.clone()
    batch["block_tables"][1, 0] = batch["k_cache"].shape[0]  # one past the last block
    with pytest.raises(IndexError, match=r"ids \d+\.\.\d+\] do not cover"):
        paged_decode_native(*args, out, scale=batch["scale"])
    fresh = torch.full_like(batch["block_tables"], -1)
    with pytest.raises(IndexError, match="do not cover"):
        paged_decode_native(*args[:3], fresh, *args[4:], out, scale=batch["scale"])
    batch["block_tables"][1, 0] = 0
    paged_decode_native(*args, out, scale=batch["scale"])
    assert torch.equal(out[:1], first[:1])
