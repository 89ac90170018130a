"""The machine's own ceiling, measured in the run: matmul FLOP/s and memory bandwidth."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class Ceiling:
    matmul_flops: dict[str, float]  # dtype name -> best FLOP/s of a large matmul
    matmul_size: dict[str, int]  # dtype name -> n of the n x n x n matmul that gave it
    memory_bandwidth: float  # bytes/s of a large copy, read + write counted (STREAM "copy")
    device: str
    num_threads: int  # torch intra-op threads (CPU): the ceiling is for these, not the socket

    def to_dict(self) -> dict:
        return asdict(self)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _best_rate(fn, work: float, device: str, min_seconds: float, trials: int) -> float:
    """Best of `trials` timed loops, each running fn until min_seconds have passed."""
    fn()  # warm-up: allocator, kernel selection
    _sync(device)
    best = 0.0
    for _ in range(trials):
        start, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = max(best, work * calls / elapsed)
    return best


def matmul_flops(dtype: str, device: str, n: int, min_seconds: float = 0.2, trials: int = 2) -> float:
    """FLOP/s of x @ w.T with x, w [n, n]: the layout nn.Linear uses (weights [out, in]),
    through torch's linear and, on CPUs, the engine's packed one: the faster counts.

    On CPUs without bf16 units, bf16 with both operands row-major is several times slower
    than this layout, so measuring another layout would understate the ceiling."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, n, generator=gen, device=device).to(_DTYPES[dtype])
    w = torch.randn(n, n, generator=gen, device=device).to(_DTYPES[dtype])
    rate = _best_rate(lambda: torch.nn.functional.linear(x, w), 2.0 * n ** 3, device,
                      min_seconds, trials)
    packed = _packed_linear(w)
    if packed is not None:  # the ceiling is the best product this machine has
        rate = max(rate, _best_rate(lambda: packed(x), 2.0 * n ** 3, device, min_seconds,
                                    trials))
    return rate


def _packed_linear(weight: torch.Tensor):
    """On CPUs, the engine's own packed linear of `weight` (fusegen's GEMM for fp32,
    oneDNN's packed weight where it packs the dtype), which can beat torch's `F.linear`;
    None where the engine packs nothing."""
    from fusegen.engine.weights.linear import Linear
    from fusegen.engine.weights.packed import can_pack, pack_linear

    if weight.device.type != "cpu" or not can_pack(weight.dtype):
        return None
    linear = Linear()
    linear.weight = weight
    return pack_linear(linear, weight.shape[0])


def memory_bandwidth(device: str, nbytes: int, min_seconds: float = 0.2, trials: int = 3) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return _best_rate(lambda: dst.copy_(src), 2.0 * src.numel() * 4, device, min_seconds, trials)


def measure_ceiling(device: str, dtypes: tuple[str, ...] = ("bfloat16", "float32"),
                    quick: bool = False) -> Ceiling:
    """quick: small sizes and short loops (seconds; for the tiny preset and tests)."""
    if device.startswith("cuda"):
        sizes, nbytes = (4096, 8192), 1 << 30
    else:
        sizes, nbytes = (1024, 2048), 256 << 20
    min_seconds = 0.2
    if quick:
        sizes, nbytes, min_seconds = (256,), 16 << 20, 0.02
    flops, best_n = {}, {}
    for dtype in dtypes:
        for n in sizes:
            rate = matmul_flops(dtype, device, n, min_seconds)
            if rate > flops.get(dtype, 0.0):
                flops[dtype], best_n[dtype] = rate, n
            if 2.0 * n ** 3 / rate > 0.25:
                break  # slow here (bf16 without bf16 units): 8x the work would take seconds
    bandwidth = memory_bandwidth(device, nbytes, min_seconds)
    return Ceiling(flops, best_n, bandwidth, device, torch.get_num_threads())
