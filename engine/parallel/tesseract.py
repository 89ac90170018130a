"""Tesseract (2-D / 2.5-D) tensor parallelism: the [q, q, d] grid and its linear.

p = q x q x d ranks sit in a grid; rank r is (i, j, k) with r = k q^2 + i q + j, so the
q^2 ranks of one depth layer are adjacent. A linear Y = X @ W.T (W [out, in], the
paper's Y = X A with A = W.T [in, out]) is split so that:
- rank (i, j, k) holds block (i, j) of A: W's rows (outputs) of block j and columns
  (inputs) of block i, i.e. `W[j-th out block, i-th in block]`, replicated over k;
- X [N, in] is cut into q d row blocks and q column blocks; rank (i, j, k) holds row
  block k q + i (depth k takes a contiguous share of the batch), column block j;
- Y comes out in X's layout (row block k q + i, output column block j), so the next
  linear takes it as it is.
The forward is SUMMA within each depth layer (Tesseract's algorithm): for t = 0..q-1 the
X block (i, t) is broadcast along grid row i, the A block (t, j) along grid column j, and
each rank adds their product; depth layers never talk (forward, inference).

Policy (`GridShape`, `tesseract_grid`, `check_tesseract_shapes`, the block ranges) is
plain Python over integers; `TesseractGroups` and `TesseractLinear` are the mechanism
over an existing torch.distributed world (gloo or nccl). The decoder runs on the grid
weight-stationary instead (tesseract_layers.py: SUMMA moves weight blocks every step),
over the same groups; tesseract_batch.py splits each step's sequences.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class GridShape:
    q: int  # grid rows = grid columns
    depth: int  # d: depth layers, each a q x q SUMMA grid over its share of the batch

    @property
    def world_size(self) -> int:
        return self.q * self.q * self.depth

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(i, j, k) of global rank `rank`."""
        k, rest = divmod(rank, self.q * self.q)
        i, j = divmod(rest, self.q)
        return i, j, k

    def rank(self, i: int, j: int, k: int) -> int:
        return k * self.q * self.q + i * self.q + j

    def row_ranks(self, i: int, k: int) -> list[int]:
        """Grid row i of depth k: the ranks an X block is broadcast among."""
        return [self.rank(i, t, k) for t in range(self.q)]

    def col_ranks(self, j: int, k: int) -> list[int]:
        """Grid column j of depth k: the ranks a weight block is broadcast among."""
        return [self.rank(t, j, k) for t in range(self.q)]

    def depth_ranks(self, i: int, j: int) -> list[int]:
        """The d replicas of weight block (i, j)."""
        return [self.rank(i, j, t) for t in range(self.depth)]

    def __str__(self) -> str:
        return f"[{self.q}, {self.q}, {self.depth}]"


def tesseract_grid(world_size: int, depth: int) -> GridShape:
    """The [q, q, d] grid of `world_size` ranks at depth `depth`; a ValueError naming the
    numbers and the nearest rank counts that work when world_size is not q * q * d."""
    for name, value in (("world_size", world_size), ("tesseract_depth", depth)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if world_size % depth == 0:
        q = math.isqrt(world_size // depth)
        if q * q * depth == world_size:
            return GridShape(q, depth)
    low = max(math.isqrt(world_size // depth), 1)
    near = [GridShape(q, depth) for q in (low, low + 1) if q * q * depth != world_size]
    near_text = ", ".join(f"{g.world_size} ranks {g}" for g in near)
    same = [GridShape(q, world_size // (q * q)) for q in range(1, math.isqrt(world_size) + 1)
            if world_size % (q * q) == 0]
    same_text = ", ".join(str(g) for g in same)
    raise ValueError(
        f"a Tesseract grid of {world_size} ranks at tesseract_depth {depth} needs "
        f"{world_size} = q x q x {depth} for some integer q, and there is none; at depth "
        f"{depth} use {near_text}; {world_size} ranks fit {same_text}")


def check_tesseract_shapes(grid: GridShape, *, num_heads: int | None = None,
                           num_kv_heads: int | None = None, hidden_size: int | None = None,
                           intermediate_size: int | None = None,
                           moe_intermediate_size: int | None = None,
                           batch: int | None = None) -> None:
    """Refuse sizes the grid cannot split, naming the size, the grid and what works:
    heads and the hidden / intermediate sizes (a mixture of experts: each expert's) are
    cut into q column blocks, a fused batch into d depth shares."""
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size),
                        ("expert intermediate size", moe_intermediate_size)):
        if value is not None and value % grid.q:
            qs = [q for q in range(1, value + 1) if value % q == 0 and q <= 64]
            raise ValueError(
                f"{name} {value} is not divisible by q = {grid.q} of the Tesseract grid "
                f"{grid}; grids with q in {qs} split it")
    if batch is not None and batch % grid.depth:
        below = batch - batch % grid.depth
        above = below + grid.depth
        depths = [d for d in range(1, batch + 1) if batch % d == 0]
        sizes = f"{below} or {above}" if below else f"{above}"
        raise ValueError(
            f"a batch of {batch} sequences is not divisible by tesseract_depth "
            f"{grid.depth} of the grid {grid}; use a batch of {sizes}, or a depth in "
            f"{depths}")


def row_range(num_rows: int, grid: GridShape, i: int, k: int) -> range:
    """The rows of X (and Y) rank (i, *, k) holds: row block k q + i of q d near-equal
    runs in order, so any row count works (a block may be empty when rows < q d)."""
    block, blocks = k * grid.q + i, grid.q * grid.depth
    return range(num_rows * block // blocks, num_rows * (block + 1) // blocks)


def col_range(size: int, grid: GridShape, j: int, what: str = "columns") -> range:
    """Column block j of `size` columns (in or out features), which q must divide."""
    if size % grid.q:
        raise ValueError(f"{what} {size} is not divisible by q = {grid.q} of the Tesseract "
                         f"grid {grid}")
    per = size // grid.q
    return range(j * per, (j + 1) * per)


def weight_block(weight: torch.Tensor, grid: GridShape, i: int, j: int) -> torch.Tensor:
    """Rank (i, j, *)'s block of a dense W [out, in]: outputs of block j, inputs of block
    i ([out / q, in / q], contiguous: it is broadcast as it is)."""
    out, inp = weight.shape
    rows, cols = col_range(out, grid, j, "out_features"), col_range(inp, grid, i, "in_features")
    return weight[rows.start:rows.stop, cols.start:cols.stop].contiguous()


def input_block(x: torch.Tensor, grid: GridShape, i: int, j: int, k: int) -> torch.Tensor:
    """Rank (i, j, k)'s block of X [N, in]: row block k q + i, column block j."""
    rows, cols = row_range(x.shape[0], grid, i, k), col_range(x.shape[1], grid, j)
    return x[rows.start:rows.stop, cols.start:cols.stop].contiguous()


def summa_reference(x: torch.Tensor, weight: torch.Tensor, grid: GridShape, i: int, j: int,
                    k: int) -> torch.Tensor:
    """Rank (i, j, k)'s output block computed in one process with the grid's shapes and
    summation order (block products added for t = 0..q-1): what the grid gives, to the
    bit. Against X @ W.T it differs only by fp32 rounding of the split sum."""
    out = None
    for t in range(grid.q):
        part = input_block(x, grid, i, t, k) @ weight_block(weight, grid, t, j).t()
        out = part if out is None else out.add_(part)
    return out


class CommCounter:
    """Bytes one rank sent and received through the grid's collectives. A broadcast
    among m ranks counts the root sending its block to each of the other m - 1 (gloo's
    one-to-all broadcast) and each of them receiving it once; an all-gather among m
    ranks counts each sending its block and receiving each other's, m - 1 blocks."""

    def __init__(self):
        self.bytes_sent = 0
        self.bytes_received = 0
        self.num_collectives = 0

    def broadcast(self, nbytes: int, members: int, is_root: bool) -> None:
        if is_root:
            self.bytes_sent += (members - 1) * nbytes
        else:
            self.bytes_received += nbytes
        self.num_collectives += 1

    def all_gather(self, nbytes: int, members: int) -> None:
        self.bytes_sent += (members - 1) * nbytes
        self.bytes_received += (members - 1) * nbytes
        self.num_collectives += 1

    def all_reduce(self, nbytes: int, members: int) -> None:
        """A ring all-reduce of `nbytes` among `members` ranks: 2 (m - 1) / m of it
        sent and as much received (as layers.TPGroup counts)."""
        moved = 2 * (members - 1) * nbytes // members
        self.bytes_sent += moved
        self.bytes_received += moved
        self.num_collectives += 1

    def as_dict(self) -> dict[str, int]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "num_collectives": self.num_collectives}


class TesseractGroups:
    """One rank's place in the grid over the current torch.distributed world: its
    (i, j, k), and the process groups of its grid row, grid column and depth line.
    Every rank of the world must build it at the same point (dist.new_group is
    collective: each rank creates every group, in one order)."""

    def __init__(self, depth: int, counter: CommCounter | None = None):
        self.grid = tesseract_grid(dist.get_world_size(), depth)
        self.global_rank = dist.get_rank()
        self.i, self.j, self.k = self.grid.coords(self.global_rank)
        self.counter = counter or CommCounter()
        g, q, d = self.grid, self.grid.q, self.grid.depth
        self.row = self._mine([g.row_ranks(i, k) for k in range(d) for i in range(q)])
        self.col = self._mine([g.col_ranks(j, k) for k in range(d) for j in range(q)])
        self.depth_group = self._mine([g.depth_ranks(i, j) for i in range(q)
                                       for j in range(q)])
        # the q^2 ranks of one depth layer (the vocabulary split of the embedding and head)
        self.layer = self._mine([[g.rank(i, j, k) for i in range(q) for j in range(q)]
                                 for k in range(d)])

    def _mine(self, all_ranks: list[list[int]]):
        mine = None
        for ranks in all_ranks:
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.global_rank in ranks:
                mine = group
        return mine

    def broadcast_row(self, t: torch.Tensor, src_j: int) -> torch.Tensor:
        """`t` from rank (i, src_j, k) to every rank of grid row i (in place)."""
        return self._broadcast(t, self.row, self.grid.rank(self.i, src_j, self.k),
                               src_j == self.j)

    def broadcast_col(self, t: torch.Tensor, src_i: int) -> torch.Tensor:
        """`t` from rank (src_i, j, k) to every rank of grid column j (in place)."""
        return self._broadcast(t, self.col, self.grid.rank(src_i, self.j, self.k),
                               src_i == self.i)

    def _broadcast(self, t: torch.Tensor, group, src: int, is_root: bool) -> torch.Tensor:
        if self.grid.q > 1 and t.numel():  # an empty block: every member knows, none sends
            dist.broadcast(t, src=src, group=group)
            self.counter.broadcast(t.numel() * t.element_size(), self.grid.q, is_root)
        return t

    def all_reduce_row(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed in place over grid row i (the q ranks (i, *, k))."""
        return self._all_reduce(t, self.row)

    def all_reduce_col(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed in place over grid column j (the q ranks (*, j, k))."""
        return self._all_reduce(t, self.col)

    def _all_reduce(self, t: torch.Tensor, group) -> torch.Tensor:
        if self.grid.q > 1 and t.numel():
            dist.all_reduce(t, group=group)
            self.counter.all_reduce(t.numel() * t.element_size(), self.grid.q)
        return t

    def start_all_reduce_row(self, t: torch.Tensor):
        """Start summing `t` in place over grid row i; None where nothing moves, else the
        work handle to wait on before reading `t`."""
        if self.grid.q == 1 or not t.numel():
            return None
        work = dist.all_reduce(t, group=self.row, async_op=True)
        self.counter.all_reduce(t.numel() * t.element_size(), self.grid.q)
        return work

    def start_gather_col(self, t: torch.Tensor):
        """Start gathering grid column j's blocks of `t` (dense, equal shapes):
        (the blocks in grid-row order, the work handle to wait on first; None with q 1)."""
        if self.grid.q == 1:
            return [t], None
        parts = [torch.empty_like(t) for _ in range(self.grid.q)]
        work = dist.all_gather(parts, t, group=self.col, async_op=True)
        self.counter.all_gather(t.numel() * t.element_size(), self.grid.q)
        return parts, work

    def all_gather(self, t: torch.Tensor, group, members: int) -> list[torch.Tensor]:
        if members == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(members)]
        dist.all_gather(parts, t.contiguous(), group=group)
        self.counter.all_gather(t.numel() * t.element_size(), members)
        return parts


class TesseractLinear:
    """Rank (i, j, k)'s share of Y = X @ W.T + b: `weight` is its block
    [out / q, in / q] (`weight_block`), `bias` (optional) the outputs of block j.
    `forward` takes the rank's X block [R, in / q] and gives its Y block [R, out / q],
    the same layout, so linears chain without moving anything else."""

    def __init__(self, groups: TesseractGroups, weight: torch.Tensor,
                 bias: torch.Tensor | None = None):
        self.groups, self.weight = groups, weight.contiguous()
        self.bias = bias

    @classmethod
    def from_dense(cls, groups: TesseractGroups, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> "TesseractLinear":
        g, i, j = groups.grid, groups.i, groups.j
        block = weight_block(weight, g, i, j)
        if bias is not None:
            cols = col_range(bias.shape[0], g, j, "out_features")
            bias = bias[cols.start:cols.stop].contiguous()
        return cls(groups, block, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [R, in / q] (R the rank's rows; the same R across its grid row)
        groups, w = self.groups, self.weight
        if x.dim() != 2 or x.shape[1] != w.shape[1]:
            raise ValueError(f"a Tesseract linear with blocks [{w.shape[0]}, {w.shape[1]}] "
                             f"takes X blocks [rows, {w.shape[1]}], got {list(x.shape)}")
        x, out = x.contiguous(), None  # broadcast in place: a dense buffer
        for t in range(groups.grid.q):  # SUMMA: step t multiplies X(i, t) by A(t, j)
            a = x if t == groups.j else torch.empty_like(x)
            b = w if t == groups.i else torch.empty_like(w)
            groups.broadcast_row(a, t)
            groups.broadcast_col(b, t)
            part = a @ b.t()  # [R, out / q]
            out = part if out is None else out.add_(part)
        return out if self.bias is None else out + self.bias

    __call__ = forward


def gather_rows(groups: TesseractGroups, y: torch.Tensor) -> torch.Tensor:
    """The rank's rows whole: its Y block [R, out / q] -> [R, out], gathered along its
    grid row (what a norm over the hidden size, a head split or sampling needs)."""
    parts = groups.all_gather(y, groups.row, groups.grid.q)
    return torch.cat(parts, dim=1)


def gather_output(groups: TesseractGroups, y: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The whole Y [num_rows, out] on every rank, in row order, from each rank's block:
    rows whole along the grid row, then the row blocks along the grid column and depth
    (padded to the largest block, since near-equal blocks may differ by one row)."""
    g = groups.grid
    whole = gather_rows(groups, y)  # [R, out]
    most = max(len(row_range(num_rows, g, i, k)) for i in range(g.q) for k in range(g.depth))
    padded = whole.new_zeros(most, whole.shape[1])
    padded[:whole.shape[0]] = whole
    # every rank of the world contributes; ranks (i, *, k) carry the same rows
    parts = groups.all_gather(padded, None, g.world_size)
    blocks = []
    for k in range(g.depth):
        for i in range(g.q):
            rows = row_range(num_rows, g, i, k)
            blocks.append(parts[g.rank(i, 0, k)][:len(rows)])
    return torch.cat(blocks, dim=0)


def summa_bytes(grid: GridShape, rows: int, in_features: int, out_features: int,
                element_size: int = 4) -> int:
    """Bytes one rank with `rows` rows sends (and, equally, receives) in one forward of
    TesseractLinear: q - 1 X blocks [rows, in / q] and q - 1 weight blocks
    [out / q, in / q] (an empty X block moves nothing)."""
    q = grid.q
    return element_size * (q - 1) * (rows * in_features // q
                                     + in_features * out_features // (q * q))
