"""The Triton sparse-tile kernel (kernels/triton_sparse.py) against cuBLAS at decode shapes
on a GPU: `python -m fusegen.kernels.triton_sparse_bench --bench` prints each
launch's median microseconds and speedup over the same pruned weight stored dense."""
from __future__ import annotations

import torch

from fusegen.kernels.sparse_format import SparseTiles
from fusegen.kernels.triton_sparse import has_triton_sparse, sparse_linear_triton

BENCH_SHAPES = ((4096, 14336), (14336, 4096))   # W [out, in]: Llama-3-8B's down and up
BENCH_ROWS = (1, 8, 16, 64, 256)                 # decode batches
BENCH_SPARSITY = 0.7
# The launches --bench times: the default (packed, batch-invariant), the packed variant
# with eight warps and two tiles a step, the gather variant, and without batch_invariant
BENCH_LAUNCHES = {
    "packed": {},
    "packed 8w": {"config": {"num_warps": 8}},
    "packed x2": {"config": {"TILES": 2, "CAP": 4096}},
    "gather": {"config": {"variant": "gather"}},
    "free": {"batch_invariant": False},
}


def _pruned(out_features: int, in_features: int, sparsity: float, seed: int = 0):
    """A random bf16 weight with the `sparsity` share of each row's smallest |w| zeroed."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16).float()
    drop = int(in_features * sparsity)
    cut = w.abs().kthvalue(drop, dim=1, keepdim=True).values
    return torch.where(w.abs() > cut, w, 0.0)


def bench(device: str = "cuda", shapes=BENCH_SHAPES, rows=BENCH_ROWS,
          sparsity: float = BENCH_SPARSITY, launches=BENCH_LAUNCHES) -> list[dict]:
    """The kernel against cuBLAS (bf16 F.linear over the same pruned weight stored dense)
    at decode shapes, bf16 x and values: median microseconds of each (triton's
    do_bench) for each of `launches`; the sparse weight's bytes against dense; the
    largest difference of any launch from the dense product. Prints a table; returns
    its rows."""
    from triton.testing import do_bench

    from fusegen.kernels import sparse_format

    print(f"sparse tiles (Triton) vs cuBLAS dense, bf16, {sparsity:.0%} sparsity, "
          f"{torch.cuda.get_device_name(device)}; microseconds (speedup over dense) of: "
          + "; ".join(f"{name} {kw or '(default)'}" for name, kw in launches.items()))
    print(f"{'W [out, in]':>14} {'M':>4} {'dense':>7} "
          + " ".join(f"{name:>14}" for name in launches) + f" {'bytes':>6} {'max |diff|':>10}")
    table = []
    for out_features, in_features in shapes:
        dense = _pruned(out_features, in_features, sparsity)
        tiles = sparse_format.encode(dense, torch.bfloat16)
        byte_share = sparse_format.nbytes(tiles) / (2 * dense.numel())
        tiles = SparseTiles(tiles.bitmap.to(device), tiles.offsets.to(device),
                            tiles.values.to(device), None, out_features, in_features)
        w = dense.to(device, torch.bfloat16)
        for m in rows:
            x = torch.randn(m, in_features, device=device, dtype=torch.bfloat16)
            want = torch.nn.functional.linear(x, w).float()
            diff = max((sparse_linear_triton(x, tiles, **kw).float() - want).abs().max().item()
                       for kw in launches.values())
            t_dense = do_bench(lambda: torch.nn.functional.linear(x, w), return_mode="median")
            times = {name: do_bench(lambda: sparse_linear_triton(x, tiles, **kw),
                                    return_mode="median") for name, kw in launches.items()}
            table.append({"out": out_features, "in": in_features, "rows": m,
                          "dense_us": 1e3 * t_dense, "bytes": byte_share, "max_diff": diff,
                          **{f"{name}_us": 1e3 * t for name, t in times.items()}})
            cells = " ".join(f"{1e3 * t:>7.1f} {t_dense / t:5.2f}x" for t in times.values())
            print(f"{f'[{out_features}, {in_features}]':>14} {m:>4} {1e3 * t_dense:>7.1f} "
                  f"{cells} {byte_share:>6.2f} {diff:>10.3g}")
    return table


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true",
                        help="time the kernel against cuBLAS dense at decode shapes")
    parser.add_argument("--device", default="cuda")
    options = parser.parse_args()
    if not options.bench:
        parser.error("nothing to do: pass --bench")
    if torch.device(options.device).type != "cuda" or not has_triton_sparse(options.device):
        raise SystemExit(f"the benchmark needs a CUDA GPU and Triton; --device is "
                         f"{options.device!r}, CUDA available: {torch.cuda.is_available()}")
    bench(options.device)


if __name__ == "__main__":
    main()
