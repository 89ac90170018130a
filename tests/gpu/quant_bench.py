"""Compressed-weight linears on a CUDA GPU (kernels/triton_quant.py), checked and timed.

    python3 tests/gpu/quant_bench.py [OUT_DIR]      (OUT_DIR defaults to $OUT, else .)

1. Checks, before any timing, each kernel against its torch reference on the GPU: the
   Triton int4 (group 128, symmetric) and int8 (group 128, asymmetric) kernels, the GGUF
   kernel for every block type at a small shape, fp8_linear (torch._scaled_mm) against
   its fallback. Prints each max abs error; a kernel out of bounds is reported as FAIL,
   not timed, and the script exits 1 at the end.
2. Checks batch invariance on the device: each of M = 1, 16, 64 rows computed alone
   equals the same rows inside the 256-row call, bit for bit: the Triton kernels'
   default (batch_invariant=True) fails the run where it does not hold; "fast"
   (batch_invariant=False) and fp8_linear (cuBLASLt picks its algorithm by M) make no
   such claim, their outcome is printed.
3. Times int4, int8, fp8 and cuBLAS bf16 F.linear at M = 1, 16, 64, 256 on the Llama-3-8B
   MLP shapes [4096 -> 14336] and [14336 -> 4096]: median of 50 calls, each timed with
   torch.cuda.Event after a 256 MiB write that evicts the weights from L2 and a
   torch.cuda._sleep that lets the host queue the call before the GPU reaches it (so a
   time is the GPU's, host launch overhead excluded as in a CUDA graph, weights read
   from HBM as in decode).
Prints a table and writes $OUT_DIR/quant_bench.json. About 60-90 s on an H100, most of it
Triton compiling one kernel per (kernel, M bucket, BLOCK_N).

Its figures on an H200, and what changed after them, are in docs/performance.md (the
fourth GPU run, and the H200 table of its current figures). At decode sizes the int4 /
int8 kernels are level with cuBLAS bf16 on the up projection with 4x / 2x fewer weight
bytes; the down projection (4,096 outputs: 128 programs, each a loop over in_features,
no split-K by design) and prefill are slower: these kernels save memory, not yet time,
past one row tile.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from fusegen.kernels import quant_linear as ql
from fusegen.kernels import triton_quant as tq
from fusegen.kernels.group_linear import dequantize_group, quantize_group

LAYERS = {"up 4096->14336": (14336, 4096), "down 14336->4096": (4096, 14336)}
ROWS = (1, 16, 64, 256)
ITERS, WARMUP = 50, 5
ULP = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -23}


def _flush_and_sleep(scratch: torch.Tensor) -> None:
    scratch.zero_()
    torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU time: the host queues the timed call meanwhile


def median_ms(fn, scratch) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _flush_and_sleep(scratch)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def within_rounding(got, ref, x, w) -> tuple[float, bool]:
    """(max abs error, whether every element is within one rounding of the output dtype
    of the reference plus 1e-5 of sum |x| |w|: the same weights, another summation order)."""
    err = (got.float() - ref.float()).abs()
    bound = ULP[got.dtype] * ref.float().abs() + 1e-5 * (x.float().abs() @ w.abs().T) + 1e-6
    return float(err.max()) if err.numel() else 0.0, bool((err <= bound).all())


def make_weights(out_features, in_features, device):
    gen = torch.Generator(device=device).manual_seed(out_features + in_features)
    dense = (torch.randn(out_features, in_features, generator=gen, device=device) * 0.02)
    dense = dense.bfloat16()
    int4 = quantize_group(dense, 4, 128, True)
    int8 = quantize_group(dense, 8, 128, False)
    fp8 = tq.quantize_fp8(dense)
    return dense, int4, int8, fp8


def kernels_for(layer, device):
    """name -> (fn(x), reference(x), dense fp32 weight the kernel multiplies, weight bytes)."""
    out_features, in_features = layer
    dense, int4, int8, fp8 = make_weights(out_features, in_features, device)
    kernels = {"bf16 F.linear": (lambda x: F.linear(x, dense), None, None, dense.numel() * 2)}
    for name, bits, (qweight, scales, zeros) in (("int4 g128 sym", 4, int4),
                                                  ("int8 g128 asym", 8, int8)):
        args = (qweight, scales, zeros, bits, 128, out_features, in_features)
        w = dequantize_group(qweight, scales, zeros, bits, 128, in_features).bfloat16().float()
        nbytes = sum(t.numel() * t.element_size() for t in (qweight, scales, zeros)
                     if t is not None)
        kernels[name] = (lambda x, a=args: tq.group_linear_triton(x, *a),
                         lambda x, a=args: tq.group_linear_reference(x, *a), w, nbytes)
        # M > 64 in BLOCK_M 128 tiles (wgmma): rows no longer batch-invariant
        kernels[name + " fast"] = (
            lambda x, a=args: tq.group_linear_triton(x, *a, batch_invariant=False),
            lambda x, a=args: tq.group_linear_reference(x, *a), w, nbytes)
    if tq.has_fp8_units(device):
        weight_fp8, scale = fp8
        kernels["fp8 e4m3 _scaled_mm"] = (
            lambda x: tq.fp8_linear(x, weight_fp8, scale),
            lambda x: tq.fp8_linear_reference(x, weight_fp8, scale),
            weight_fp8.float() * scale[:, None], weight_fp8.numel() + scale.numel() * 4)
    return kernels


def check_gguf(device, report) -> bool:
    """Every GGUF block type through the Triton kernel at [17, 512] -> 48, bf16 and fp32."""
    import numpy as np

    ok = True
    rng = np.random.default_rng(0)
    for qtype, name in sorted(ql.SUPPORTED.items()):
        block_size, type_size = ql.BLOCK_SIZES[qtype]
        raw = rng.integers(0, 256, (48, 512 // block_size, type_size), dtype=np.uint8)
        scales = (rng.standard_normal((48, 512 // block_size, 2)) * 0.01).astype(np.float16)
        if qtype == ql.Q6_K:
            raw[:, :, 208:210] = scales.view(np.uint8)[:, :, :2]
        else:
            raw[:, :, 0:4] = scales.view(np.uint8)
        blocks = torch.from_numpy(raw.reshape(48, -1)).to(device)
        w = ql.dequantize_rows(blocks.cpu(), qtype, 512).to(device)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(17, 512, device=device).to(dtype)
            got = tq.gguf_linear_triton(x, blocks, qtype, 48, 512)
            ref = tq.gguf_linear_reference(x, blocks, qtype, 48, 512)
            err, good = within_rounding(got, ref, x, w.to(dtype).float())
            ok &= good
            report.append({"check": f"gguf {name}", "dtype": str(dtype), "max_abs_err": err,
                           "ok": good})
            print(f"check gguf {name:5s} {str(dtype):15s} max abs err {err:.3e} "
                  f"{'ok' if good else 'FAIL'}")
    return ok


def invariance(fn, x) -> dict[str, bool]:
    full = fn(x)
    return {f"rows 0..{m - 1} alone": bool(torch.equal(fn(x[:m]), full[:m])) for m in (1, 16, 64)}


def main(out_dir: str) -> int:
    assert torch.cuda.is_available(), "quant_bench.py needs a CUDA GPU"
    device = torch.device("cuda")
    started = time.time()
    result = {"device": torch.cuda.get_device_name(),
              "capability": torch.cuda.get_device_capability(),
              "torch": torch.__version__, "date": datetime.datetime.now(datetime.UTC).isoformat(),
              "iters": ITERS, "checks": [], "invariance": {}, "timings": []}
    import triton
    result["triton"] = triton.__version__
    print(f"{result['device']} capability {result['capability']} torch {torch.__version__} "
          f"triton {triton.__version__}")
    ok = check_gguf(device, result["checks"])
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    failed = set()
    for layer_name, layer in LAYERS.items():
        kernels = kernels_for(layer, device)
        x_all = torch.randn(max(ROWS), layer[1], device=device).bfloat16()
        for name, (fn, reference, w, _) in kernels.items():
            if reference is None:
                continue
            for rows in (1, 64):  # the decode and the prefill configs
                x = x_all[:rows]
                err, good = within_rounding(fn(x), reference(x), x, w)
                # fp8: x's own e4m3 rounding is in both; cuBLASLt may round the sum once more
                if name.startswith("fp8"):
                    ref = reference(x)
                    good = bool(((fn(x).float() - ref.float()).abs()
                                 <= 2 ** -7 * ref.float().abs() + 2e-2).all())
                result["checks"].append({"check": f"{layer_name} {name}", "rows": rows,
                                         "max_abs_err": err, "ok": good})
                print(f"check {layer_name} {name:25s} M={rows:3d} max abs err {err:.3e} "
                      f"{'ok' if good else 'FAIL'}")
                if not good:
                    failed.add((layer_name, name))
            inv = invariance(fn, x_all)
            result["invariance"][f"{layer_name} {name}"] = inv
            claimed = name.startswith("int") and not name.endswith("fast")
            print(f"invariance {layer_name} {name:25s} {inv}"
                  f"{' FAIL' if claimed and not all(inv.values()) else ''}")
            if claimed and not all(inv.values()):
                ok = False
        for rows in ROWS:
            x = x_all[:rows]
            base = None
            for name, (fn, _, _, nbytes) in kernels.items():
                if (layer_name, name) in failed:
                    continue
                ms = median_ms(lambda: fn(x), scratch)
                base = ms if base is None else base
                result["timings"].append({"layer": layer_name, "rows": rows, "kernel": name,
                                          "median_ms": ms, "weight_bytes": nbytes,
                                          "weight_GBps": nbytes / ms / 1e6,
                                          "speedup_vs_bf16": base / ms})
        del kernels
        torch.cuda.empty_cache()
    ok &= not failed
    print(f"\n{'layer':18s} {'M':>4s} {'kernel':27s} {'median us':>10s} {'weight GB/s':>12s} "
          f"{'vs bf16':>8s}")
    for t in result["timings"]:
        print(f"{t['layer']:18s} {t['rows']:4d} {t['kernel']:27s} {t['median_ms'] * 1e3:10.1f} "
              f"{t['weight_GBps']:12.0f} {t['speedup_vs_bf16']:7.2f}x")
    result["seconds"] = time.time() - started
    result["ok"] = ok
    path = os.path.join(out_dir, "quant_bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'all checks passed' if ok else 'FAILED CHECKS: see above'}; "
          f"{result['seconds']:.0f} s; wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")))
