"""What a sparse checkpoint written by `fusegen sparsify` must hold, shared by its
tests (tests/test_sparsify*.py): each linear's tiles against the mask and values
expected, every other tensor as the source holds it, and the bytes the format counts."""
import torch

from quant_helpers import is_linear
from fusegen.kernels import sparse_format

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def decoded(written: dict, name: str, shape) -> sparse_format.SparseTiles:
    return sparse_format.from_tensors(name, written, *shape)


def top_mask(scores: torch.Tensor, kept: int) -> torch.Tensor:
    """Each row's `kept` highest scores, of equal ones the lower column (numpy's lexsort
    on (-score, column): bf16 weights do tie)."""
    import numpy as np

    s = scores.double().numpy()
    columns = np.broadcast_to(np.arange(s.shape[1]), s.shape)
    order = torch.from_numpy(np.lexsort((columns, -s), axis=-1)[:, :kept].copy())
    return torch.zeros(scores.shape, dtype=torch.bool).scatter_(1, order, True)


def check_written(source: dict, written: dict, sparsity: float, values: str,
                  masks: dict | None = None) -> int:
    """Every source linear stored as tiles that decode to the weight with each row's
    `kept` largest |w| (or the given mask) kept: exactly in bf16 / fp16 / fp32, within
    half a tile scale in int8; every other tensor byte for byte; nothing else written.
    Returns the linears counted."""
    expected, count = set(), 0
    for name, w in source.items():
        if not is_linear(name):
            assert written[name].dtype == w.dtype and torch.equal(written[name], w), name
            expected.add(name)
            continue
        w = w.float()
        kept = round((1 - sparsity) * w.shape[1])  # no halves in the sparsities used
        mask = top_mask(w.abs(), kept) if masks is None else masks[name]
        tiles = decoded(written, name, w.shape)
        got = sparse_format.decode(tiles)
        assert torch.equal(got != 0, mask) or values == "int8", name
        bits = sparse_format.decode(sparse_format.SparseTiles(
            tiles.bitmap, tiles.offsets, torch.ones(tiles.nnz), None, *w.shape)) != 0
        assert torch.equal(bits, mask), name  # the bitmap is the mask, int8 or not
        assert (bits.sum(1) == kept).all(), name
        pruned = torch.where(mask, w, 0.0)
        if values == "int8":
            assert tiles.values.dtype == torch.int8
            scales = tiles.scales.view(tiles.num_row_tiles, 1, tiles.num_col_tiles, 1)
            scales = scales.expand(-1, 64, -1, 64).reshape(tiles.num_row_tiles * 64, -1)
            bound = scales[:w.shape[0], :w.shape[1]] / 2 * (1 + 1e-6)
            assert ((got - pruned).abs() <= bound).all(), name
        else:
            assert tiles.values.dtype == DTYPES[values]
            assert torch.equal(got, pruned.to(DTYPES[values]).float()), name
        expected |= {f"{name}.{s}" for s in sparse_format.SUFFIXES[:3]}
        expected |= {f"{name}.sparse_scales"} if values == "int8" else set()
        count += 1
    assert set(written) == expected
    return count


def layer_bytes(written: dict, name: str) -> int:
    """A linear's bytes as the format counts them, from the written tensors' sizes."""
    tiles = written[name + ".sparse_bitmap"].shape[0]
    values = written[name + ".sparse_values"]
    return values.numel() * values.element_size() + 512 * tiles + 8 * tiles + 8 + \
        (4 * tiles if values.dtype == torch.int8 else 0)
