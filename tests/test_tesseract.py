"""Tesseract grids (engine/parallel/tesseract.py): the [q, q, d] grid's policy, and its
SUMMA linear over gloo on CPU with 4 ranks [2, 2, 1] and 8 ranks [2, 2, 2] (forked
processes, one torch thread each). A rank's output block must equal, to the bit, the
one-process product with the grid's block shapes and summation order; with
integer-valued inputs (every sum exact) the gathered output must equal X @ W.T + b to
the bit; the bytes each rank moves must equal the formulas in docs/parallel_modes.md."""
from __future__ import annotations

import io
import multiprocessing as mp
import socket
import traceback

import pytest
import torch

from fusegen.engine.parallel.tesseract import (GridShape, TesseractLinear, check_tesseract_shapes,
                                               col_range, gather_output, gather_rows,
                                               input_block, row_range, summa_bytes,
                                               summa_reference, tesseract_grid, weight_block)

IN, HIDDEN = 8, 12  # W1 [HIDDEN, IN], W2 [IN, HIDDEN]: two linears chained
E = 4  # fp32 bytes


# -- policy ---------------------------------------------------------------------------

def test_grid_coordinates_and_groups():
    g = tesseract_grid(8, 2)
    assert g == GridShape(2, 2) and str(g) == "[2, 2, 2]"
    assert [g.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert all(g.rank(*g.coords(r)) == r for r in range(8))
    assert g.row_ranks(1, 0) == [2, 3] and g.col_ranks(1, 1) == [5, 7]
    assert g.depth_ranks(1, 0) == [2, 6]
    assert tesseract_grid(4, 1) == GridShape(2, 1)
    assert tesseract_grid(18, 2) == GridShape(3, 2)
    # odd row counts: near-equal runs in order, row block k q + i; an empty one allowed
    assert [row_range(7, g, i, k) for k in range(2) for i in range(2)] == \
        [range(0, 1), range(1, 3), range(3, 5), range(5, 7)]
    assert [len(row_range(3, g, i, k)) for k in range(2) for i in range(2)] == [0, 1, 1, 1]


def test_bad_grids_are_named_with_the_shapes_that_work():
    cases = [
        (6, 1, "a Tesseract grid of 6 ranks at tesseract_depth 1 needs 6 = q x q x 1 for some "
               "integer q, and there is none; at depth 1 use 4 ranks [2, 2, 1], 9 ranks "
               "[3, 3, 1]; 6 ranks fit [1, 1, 6]"),
        (8, 1, "a Tesseract grid of 8 ranks at tesseract_depth 1 needs 8 = q x q x 1 for some "
               "integer q, and there is none; at depth 1 use 4 ranks [2, 2, 1], 9 ranks "
               "[3, 3, 1]; 8 ranks fit [1, 1, 8], [2, 2, 2]"),
        (8, 3, "a Tesseract grid of 8 ranks at tesseract_depth 3 needs 8 = q x q x 3 for some "
               "integer q, and there is none; at depth 3 use 3 ranks [1, 1, 3], 12 ranks "
               "[2, 2, 3]; 8 ranks fit [1, 1, 8], [2, 2, 2]"),
        (0, 1, "world_size must be an integer >= 1, got 0"),
        (4, 0, "tesseract_depth must be an integer >= 1, got 0"),
        (4, 1.0, "tesseract_depth must be an integer >= 1, got 1.0"),
    ]
    for world, depth, message in cases:
        with pytest.raises(ValueError) as info:
            tesseract_grid(world, depth)
        assert str(info.value) == message


def test_sizes_the_grid_cannot_split_are_named():
    g = GridShape(2, 2)
    check_tesseract_shapes(g, num_heads=4, num_kv_heads=2, hidden_size=64,
                           intermediate_size=128, batch=6)
    cases = [
        (dict(num_heads=6), GridShape(4, 1), "num_heads 6 is not divisible by q = 4 of the "
         "Tesseract grid [4, 4, 1]; grids with q in [1, 2, 3, 6] split it"),
        (dict(num_kv_heads=1), g, "num_kv_heads 1 is not divisible by q = 2 of the Tesseract "
         "grid [2, 2, 2]; grids with q in [1] split it"),
        (dict(hidden_size=9), g, "hidden_size 9 is not divisible by q = 2 of the Tesseract "
         "grid [2, 2, 2]; grids with q in [1, 3, 9] split it"),
        (dict(batch=5), g, "a batch of 5 sequences is not divisible by tesseract_depth 2 of "
         "the grid [2, 2, 2]; use a batch of 4 or 6, or a depth in [1, 5]"),
        (dict(batch=1), g, "a batch of 1 sequences is not divisible by tesseract_depth 2 of "
         "the grid [2, 2, 2]; use a batch of 2, or a depth in [1]"),
    ]
    for sizes, grid, message in cases:
        with pytest.raises(ValueError) as info:
            check_tesseract_shapes(grid, **sizes)
        assert str(info.value) == message
    with pytest.raises(ValueError, match=r"^in_features 9 is not divisible by q = 2 of the "
                                         r"Tesseract grid \[2, 2, 2\]$"):
        weight_block(torch.zeros(4, 9), g, 0, 0)
    with pytest.raises(ValueError, match=r"^columns 5 is not divisible by q = 2"):
        col_range(5, g, 1)


def test_blocks_rebuild_the_dense_weight():
    w = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8)
    g = GridShape(2, 1)
    rows = [torch.cat([weight_block(w, g, i, j) for i in range(2)], dim=1) for j in range(2)]
    assert torch.equal(torch.cat(rows, dim=0), w)
    assert weight_block(w, g, 1, 0).shape == (6, 4)  # outputs of block 0, inputs of block 1


# -- the grid over gloo ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(num_rows: int, integers: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        if integers:  # small integers: every product and sum is exact in fp32
            return torch.randint(-4, 5, shape, generator=gen).float()
        return torch.randn(*shape, generator=gen)
    return draw(num_rows, IN), draw(HIDDEN, IN), draw(HIDDEN), draw(IN, HIDDEN)


def _rank_main(rank, world, depth, port, cases, queue):
    import datetime

    import torch.distributed as dist

    from fusegen.engine.parallel.layers import TPGroup
    from fusegen.engine.parallel.tesseract import TesseractGroups
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=60))
        groups = TesseractGroups(depth)
        g, (i, j, k) = groups.grid, (groups.i, groups.j, groups.k)
        results = []
        for x, w1, b1, w2 in cases:
            first = TesseractLinear.from_dense(groups, w1, b1)
            second = TesseractLinear.from_dense(groups, w2)
            before = groups.counter.as_dict()
            y1 = first(input_block(x, g, i, j, k))  # [R, HIDDEN / q]
            counted = {key: groups.counter.as_dict()[key] - before[key] for key in before}
            y2 = second(y1)  # [R, IN / q]: y1's layout is the next linear's input layout
            rows = gather_rows(groups, y1)
            whole = gather_output(groups, y1, x.shape[0])
            # 1-D at the same rank count: row-parallel W1 by input columns, one all-reduce
            tp = TPGroup(None, world, rank)
            cols = range(rank * IN // world, (rank + 1) * IN // world)
            tp.all_reduce(x[:, cols.start:cols.stop] @ w1[:, cols.start:cols.stop].t())
            results.append(dict(y1=y1, y2=y2, rows=rows, whole=whole, counted=counted,
                                one_d=tp.bytes_sent))
        buffer = io.BytesIO()  # bytes, not tensors: torch would pass those by fd, which
        torch.save(results, buffer)  # dies with this process
        queue.put((rank, buffer.getvalue()))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the test reports it
        queue.put((rank, traceback.format_exc()))


# A decoder layer's linears at the tiny llama checkpoint's sizes (tests/checkpoints.py):
# h = 64, I = 128, KV heads x head size = 32; (name, in, out)
LAYER = [("qkv", 64, 128), ("o", 64, 64), ("gate_up", 64, 256), ("down", 128, 64)]


def _layer_main(rank, world, depth, port, token_counts, queue):
    """Each rank's bytes for one layer's four linears on the grid, and for the layer's
    two all-reduces of [N, h] in 1-D over the same ranks (the table in
    docs/parallel_modes.md)."""
    import datetime

    import torch.distributed as dist

    from fusegen.engine.parallel.layers import TPGroup
    from fusegen.engine.parallel.tesseract import TesseractGroups
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=60))
        groups = TesseractGroups(depth)
        g, (i, j, k) = groups.grid, (groups.i, groups.j, groups.k)
        results = []
        for n in token_counts:
            before = groups.counter.bytes_sent, groups.counter.bytes_received
            for _, inp, out in LAYER:
                x, w = torch.randn(n, inp), torch.randn(out, inp)
                TesseractLinear.from_dense(groups, w)(input_block(x, g, i, j, k))
            tp = TPGroup(None, world, rank)
            for _ in range(2):  # o and down
                tp.all_reduce(torch.randn(n, 64))
            results.append((groups.counter.bytes_sent - before[0],
                            groups.counter.bytes_received - before[1], tp.bytes_sent))
        buffer = io.BytesIO()
        torch.save(results, buffer)
        queue.put((rank, buffer.getvalue()))
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the test reports it
        queue.put((rank, traceback.format_exc()))


def _run_grid(world: int, depth: int, cases, target=_rank_main) -> dict[int, list]:
    ctx = mp.get_context("fork")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=target, args=(r, world, depth, port, cases, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results, failed = {}, True
    try:
        for _ in range(world):
            rank, out = queue.get(timeout=120)
            assert not isinstance(out, str), f"rank {rank} failed:\n{out}"
            results[rank] = torch.load(io.BytesIO(out))
        failed = False
    finally:
        for p in procs:  # after a failure the others wait in a collective: end them now
            p.join(timeout=0 if failed else 30)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def _one_thread(fn, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' setting: the same BLAS path, the same bits
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _assemble(blocks: dict[tuple[int, int, int], torch.Tensor], g: GridShape) -> torch.Tensor:
    """The whole matrix from every rank's [R, cols / q] block."""
    return torch.cat([torch.cat([blocks[i, j, k] for j in range(g.q)], dim=1)
                      for k in range(g.depth) for i in range(g.q)], dim=0)


@pytest.mark.parametrize("world,depth", [(4, 1), (8, 2)])
def test_grid_linear_equals_the_single_process_product(world, depth):
    g = tesseract_grid(world, depth)
    # 8 rows split evenly; 7 rows (odd) near-equally; 3 rows leave a block empty at [2,2,2]
    cases = [_data(8, False, 1), _data(7, False, 2), _data(7, True, 3), _data(3, True, 4)]
    results = _run_grid(world, depth, cases)
    for n, (x, w1, b1, w2) in enumerate(cases):
        num_rows = x.shape[0]
        y1 = {g.coords(r): results[r][n]["y1"] for r in range(world)}
        y2 = {g.coords(r): results[r][n]["y2"] for r in range(world)}
        for (i, j, k), block in y1.items():
            bias = b1[col_range(HIDDEN, g, j).start:col_range(HIDDEN, g, j).stop]
            expected = _one_thread(summa_reference, x, w1, g, i, j, k) + bias
            assert torch.equal(block, expected), (n, i, j, k)
        whole1 = _assemble(y1, g)
        for (i, j, k), block in y2.items():  # the chained linear, from y1's layout
            assert torch.equal(block, _one_thread(summa_reference, whole1, w2, g, i, j, k))
        for r in range(world):
            i, j, k = g.coords(r)
            rows = row_range(num_rows, g, i, k)
            assert torch.equal(results[r][n]["rows"], whole1[rows.start:rows.stop])
            assert torch.equal(results[r][n]["whole"], whole1)
        dense = x @ w1.t() + b1
        if n >= 2:  # integer-valued: every sum exact, so any order gives these bits
            assert torch.equal(whole1, dense)
            assert torch.equal(_assemble(y2, g), dense @ w2.t())
        else:  # random fp32: the split sum rounds differently from one product
            torch.testing.assert_close(whole1, dense, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("world,depth", [(4, 1), (8, 2)])
def test_bytes_each_rank_moves_equal_the_formulas(world, depth):
    g = tesseract_grid(world, depth)
    q, d, n = g.q, g.depth, 16  # 16 rows: q d divides them
    results = _run_grid(world, depth, [_data(n, False, 5), _data(5, True, 6)])
    for r in range(world):
        i, j, k = g.coords(r)
        even, odd = results[r][0]["counted"], results[r][1]["counted"]
        # per call: q - 1 X blocks [N / (q d), in / q] and q - 1 weight blocks
        # [out / q, in / q], sent and received alike; 2 broadcasts per SUMMA step
        per_call = E * (q - 1) * (n * IN // (q * q * d) + IN * HIDDEN // (q * q))
        assert even == {"bytes_sent": per_call, "bytes_received": per_call,
                        "num_collectives": 2 * q}
        assert per_call == summa_bytes(g, n // (q * d), IN, HIDDEN)
        rows = len(row_range(5, g, i, k))
        assert odd["bytes_sent"] == odd["bytes_received"] == summa_bytes(g, rows, IN, HIDDEN)
        # 1-D at the same rank count: one ring all-reduce of [N, out]
        assert results[r][0]["one_d"] == 2 * (world - 1) * n * HIDDEN * E // world


def test_layer_bytes_match_the_table_in_the_docs():
    """docs/parallel_modes.md's counted table: (N, ranks, depth) -> each rank's bytes for
    one layer, grid (sent = received) and 1-D."""
    table = {(16, 4, 1): (41_984, 12_288), (64, 4, 1): (57_344, 49_152),
             (16, 8, 2): (39_424, 14_336), (64, 8, 2): (47_104, 57_344)}
    weights = sum(inp * out for _, inp, out in LAYER)
    assert weights == 36_864
    for world, depth in ((4, 1), (8, 2)):
        q, results = 2, _run_grid(world, depth, [16, 64], target=_layer_main)
        for n_index, n in enumerate((16, 64)):
            grid_bytes, one_d = table[n, world, depth]
            # (q-1)/q^2 (N (3h + I) / d + W_layer) e  and  4 (p-1)/p N h e
            assert grid_bytes == (q - 1) * (n * (3 * 64 + 128) // depth + weights) * E // q**2
            assert one_d == 4 * (world - 1) * n * 64 * E // world
            assert {tuple(results[r][n_index]) for r in range(world)} == \
                {(grid_bytes, grid_bytes, one_d)}
