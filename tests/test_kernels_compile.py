"""Every kernel compiles for an sm_90 GPU, without one, and keeps its registers.

Each launcher runs on CPU tensors with its kernel swapped for `_CompileInstead`, which
hands the call to `triton.compile` with the signature, constants and 16-byte alignment
hints the JIT would derive, down to a cubin; the interpreter tests cannot catch what only
the compiler rejects. The cubin must not use a stack frame: register spills there would
cost far more than any tile-size tuning gains."""
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

import fusegen.kernels.kv_cache as kv_cache
import fusegen.kernels.paged_attention as paged_attention
import fusegen.kernels.rms_norm as rms_norm
import fusegen.kernels.rotary as rotary
import fusegen.kernels.silu_mul as silu_mul

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(_TOOLS, "ptxas")),
                                reason="Triton's bundled ptxas is missing")
sys.path.insert(0, os.path.dirname(__file__))
from test_kernels_paged_attention import _make_batch  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int32: "i32", torch.int64: "i64"}


class _CompileInstead:
    def __init__(self, kernel):
        self.kernel = kernel
        self.stack_bytes = []  # one per compiled launch
        self.ptx = []

    def __getitem__(self, grid):
        return self._compile

    def _compile(self, *args, num_warps=4, enable_fp_fusion=True, **kwargs):
        values = {**dict(zip(self.kernel.arg_names, args)), **kwargs}
        signature, constexprs, attrs = {}, {}, {}
        for i, (name, param) in enumerate(zip(self.kernel.arg_names, self.kernel.params)):
            value = values[name]
            if param.is_constexpr or (type(value) is int and value == 1):  # the JIT folds 1s
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + _TYPES[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]  # the caching allocator aligns
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "fp32"
        source = compiler.ASTSource(self.kernel, signature, constexprs, attrs)
        target = triton.backends.compiler.GPUTarget("cuda", 90, 32)
        compiled = compiler.compile(source, target=target, options={
            "num_warps": num_warps, "enable_fp_fusion": enable_fp_fusion})
        self.ptx.append(compiled.asm["ptx"])
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-res-usage", cubin.name],
                                   capture_output=True, text=True, check=True).stdout
        self.stack_bytes += [int(n) for n in re.findall(r"STACK:(\d+)", usage)]


def _swap(monkeypatch, module, name):
    recorder = _CompileInstead(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    return recorder


# (q_lens, seq_lens, Hq, Hkv, head_dim, dtype, sliding_window, num_kv_splits)
ATTENTION = {
    "prefill_bf16_d128_gqa4": ([1, 300, 1], [1000, 300, 5], 32, 8, 128, torch.bfloat16, 0, None),
    "decode_fp16_d64_gqa8_split_window": ([1, 1], [900, 30], 64, 8, 64, torch.float16, 256, 4),
    "mixed_fp32_d80": ([20, 1], [40, 9], 8, 8, 80, torch.float32, 0, None),
}


@pytest.mark.parametrize("case", ATTENTION)
def test_paged_attention_compiles_without_spills(case, monkeypatch):
    q_lens, seq_lens, hq, hkv, d, dtype, window, splits = ATTENTION[case]
    main = _swap(monkeypatch, paged_attention, "_paged_attention_kernel")
    reduce = _swap(monkeypatch, paged_attention, "_paged_attention_reduce_kernel")
    batch = _make_batch(q_lens, seq_lens, hq, hkv, d, 16, dtype)
    paged_attention.paged_attention_triton(**batch, sliding_window=window, num_kv_splits=splits)
    assert main.stack_bytes == [0]
    assert reduce.stack_bytes == ([0] if splits else [])


def test_other_kernels_compile_without_spills(monkeypatch):
    recorders = [_swap(monkeypatch, m, n) for m, n in [
        (kv_cache, "_write_kv_cache_kernel"), (rms_norm, "_rms_norm_kernel"),
        (rotary, "_rotary_kernel"), (silu_mul, "_silu_and_mul_kernel")]]
    bf16 = dict(dtype=torch.bfloat16)
    key = torch.zeros(5, 8, 128, **bf16)
    cache = torch.zeros(4, 16, 8, 128, **bf16)
    kv_cache.write_kv_cache_triton(key, key, cache, cache.clone(), torch.arange(5))
    x, weight = torch.zeros(3, 8192, **bf16), torch.ones(8192, **bf16)
    rms_norm.rms_norm_triton(x, weight, 1e-5)
    rms_norm.rms_norm_triton(x, weight, 1e-5, x.clone())
    cos = torch.zeros(100, 64)
    rotary.rotary_embedding_triton(torch.arange(3), torch.zeros(3, 32, 128, **bf16),
                                   torch.zeros(3, 8, 128, **bf16), cos, cos.clone())
    silu_mul.silu_and_mul_triton(torch.zeros(3, 2 * 14336, **bf16))
    assert [r.stack_bytes for r in recorders] == [[0], [0, 0], [0], [0]]
    # The rotation rounds each product as torch does: no fused multiply-add may merge a
    # product into the sum (one rounding where torch has two).
    assert "fma" not in recorders[2].ptx[0] and "mul.rn.bf16" in recorders[2].ptx[0]
