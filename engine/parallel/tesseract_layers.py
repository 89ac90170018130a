"""The decoder on a Tesseract grid (tensor_parallel_mode 2d / 2.5d): one rank's share.

Rank (i, j, k) of a [q, q, d] grid runs depth layer k's sequences (tesseract_batch.py)
and holds block (i, j) of every layer weight, never moved (weight-stationary: a SUMMA
step broadcasts weight blocks, which costs a rank (q - 1) / q^2 of every layer's weights
each step whatever the batch; docs/parallel_modes.md). Its depth layer's residual
stream stays whole on each of its q^2 ranks, so norms, rotary tables and activations
run as the decoder has them. Per layer, with X [R, h] the depth layer's tokens:
- qkv: X's hidden block i times the weights of heads block j, summed over grid column
  j (all-reduce) -> q, k, v of heads j for all R rows;
- attention: heads j of grid row i's sequences only, in the rank's KV cache (heads j,
  those sequences: no rank holds another's); the outputs gathered along grid column j;
- o: heads block j times o's rows of hidden block i, summed over grid row i, then the
  hidden blocks gathered along grid column j -> [R, h];
- gate/up: as qkv (intermediate block j); down: as o. A mixture of experts: the router
  whole, each expert's gate/up and down blocks as these, routed rows summed once each
  way (`_GridMoe`).
The embedding and head are split by vocabulary over the depth layer's q^2 ranks, as
1-D splits them over its ranks (layers.py).
"""
from __future__ import annotations

import copy
import functools

import torch

from fusegen.engine.models.decoder import AttentionMetadata
from fusegen.engine.models.moe import MoeLayer
from fusegen.engine.parallel.layers import (TPGroup, VocabParallelHead, _RankShare,
                                            _vocab_lookup)
from fusegen.engine.parallel.overlap import SumTimes, grid_summed_in_chunks
from fusegen.engine.parallel.shard import (grid_layer_sources, grid_model_config,
                                           shard_fixed_sources, vocab_range)
from fusegen.engine.parallel.tesseract import CommCounter, TesseractGroups
from fusegen.engine.parallel.tesseract_batch import RankStep, rank_step
from fusegen.engine.parallel.worker import ShardRunner
from fusegen.engine.step_inputs import StepInputs, host_rows
from fusegen.engine.weights.linear import Linear
from fusegen.kernels.paged_attention import paged_attention
from fusegen.kernels.rotary import rotary_and_cache
from fusegen.kernels.silu_mul import silu_and_mul


class GridLinear(_RankShare):
    """Rank (i, j)'s block of a linear: its input columns (`columns`, or all) times its
    weight block through `inner` (any dense storage, built without bias), then the bias
    (the rank's outputs' share). qkv and gate_up: the partial products summed over the
    grid column (`sum`). o and down (`times` given): summed over the grid row and the
    output blocks gathered along the grid column, in `chunks` runs of rows, each run's
    collectives started while the next computes (overlap.grid_summed_in_chunks), timed.
    Neither (down inside a chunked MLP, `_GridChunkedMlp`): the partial product alone."""

    def __init__(self, bias: bool, columns: slice | None, sum_, groups: TesseractGroups,
                 times: SumTimes | None = None, chunks: int = 1):
        super().__init__()
        self.inner = Linear(bias=False)
        self.columns, self.sum, self.groups = columns, sum_, groups
        self.times, self.chunks = times, chunks
        self.bias = torch.empty(0) if bias else None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The rank's partial product, unsummed and without bias."""
        return self.inner(x if self.columns is None else x[:, self.columns])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.times is not None:
            out = grid_summed_in_chunks(self.product, x, self.groups, self.chunks, self.times)
        elif self.sum is not None:
            out = self.sum(self.product(x))
        else:
            return self.product(x)
        return out if self.bias is None else out + self.bias

    __call__ = forward

    def set_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name == "bias":
            self.bias = tensor
        else:
            super().set_weight(name, tensor)

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.bias is None else
                                 self.bias.numel() * self.bias.element_size())


def gather_rows(groups: TesseractGroups, block: torch.Tensor,
                row_tokens: list[int]) -> torch.Tensor:
    """The grid column's row blocks stacked in grid-row order: rank (i, j)'s `block`
    holds row_tokens[i] rows (padded to the largest: gloo gathers equal shapes)."""
    most = max(row_tokens)
    padded = block.new_zeros(most, block.shape[1])
    padded[:block.shape[0]] = block
    parts = groups.all_gather(padded, groups.col, groups.grid.q)
    return torch.cat([p[:n] for p, n in zip(parts, row_tokens)])


class _GridChunkedMlp:
    """A grid layer's MLP (its own `_mlp`: gate_up summed over the grid column, down
    giving the rank's partial product) in `chunks` runs of rows, each run's down summed
    over the grid row and gathered along the grid column while the next runs compute
    (overlap.grid_summed_in_chunks), then down's bias."""

    def __init__(self, mlp, down: GridLinear, groups: TesseractGroups, chunks: int,
                 times: SumTimes):
        self.mlp, self.down, self.groups, self.chunks, self.times = \
            mlp, down, groups, chunks, times

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = grid_summed_in_chunks(self.mlp, x, self.groups, self.chunks, self.times)
        return out if self.down.bias is None else out + self.down.bias


class _GridMoe:
    """A grid layer's mixture of experts, weight-stationary like the dense MLP: the
    router whole on every rank, so the depth layer's q^2 ranks (the same rows whole)
    route every token to the same experts; rank (i, j) holds each expert's gate/up
    block (outputs j, hidden inputs i) and down block (hidden outputs i, inputs j).
    Every routed row's gate/up partial products, all experts' at once, are summed over
    the grid column in one all-reduce (same shape on every rank: routing is identical);
    each expert's down gives [n, h / q] partials, weighted and summed over a token's k
    choices locally (linear, as 1-D sums a mixture's output once), then summed over the
    grid row and gathered along the grid column once, in `chunks` runs of rows
    (overlap.grid_summed_in_chunks), as the dense MLP's down."""

    def __init__(self, layer, hidden: slice, groups: TesseractGroups, chunks: int,
                 times: SumTimes):
        self.layer, self.hidden, self.groups, self.chunks, self.times = \
            layer, hidden, groups, chunks, times

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return grid_summed_in_chunks(self.partial, x, self.groups, self.chunks, self.times)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, h] whole -> [T, h / q]: hidden block i of the mixture's output, this
        rank's intermediate block j's share (models/moe.run_experts, on blocks)."""
        layer = self.layer
        weights, experts = layer.route(x)  # [T, k] each, the same on every rank
        num_tokens, top_k = experts.shape
        choices = experts.flatten()
        order = torch.argsort(choices, stable=True)  # slots grouped by expert
        counts = torch.bincount(choices, minlength=layer.gate_up.num_experts).tolist()
        rows = x[order // top_k, self.hidden]  # [T * k, h / q]: hidden block i
        width = layer.gate_up.weight.shape[1]  # 2 I / q: gate block j, up block j
        mid = rows.new_empty(rows.shape[0], width)
        bounds, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                group = slice(start, start + count)
                mid[group] = layer.gate_up(rows[group], expert)
                bounds.append((expert, group))
                start += count
        del rows
        act = silu_and_mul(self.groups.all_reduce_col(mid))  # [T * k, I / q]
        out = x.new_empty(act.shape[0], layer.down.weight.shape[1])  # [T * k, h / q]
        for expert, group in bounds:
            out[group] = layer.down(act[group], expert)
        weighted = out * weights.flatten()[order, None]  # fp32 weights: an fp32 product
        slots = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return slots.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)


class GridStepState:
    """The current step's split, read by every layer's attention: the rank's grid row's
    rows and their attention metadata (None: none there)."""
    step: RankStep | None = None
    meta: AttentionMetadata | None = None


def _grid_attention(layer, state: GridStepState, groups: TesseractGroups, positions, x,
                    rope, kv_cache, meta):
    # x [R, h]: the depth layer's rows whole; q, k, v [R, H/q | K/q, D] of heads j
    q, k, v = layer._qkv(x)
    step, width = state.step, layer.num_heads * layer.head_dim
    out = x.new_empty(0, width)
    if state.meta is not None:
        rows = slice(step.rows.start, step.rows.stop)
        q, k, v = q[rows], k[rows], v[rows]
        k_cache, v_cache = kv_cache
        rotary_and_cache(positions[rows], q, k, v, *rope, k_cache, v_cache,
                         state.meta.slot_mapping)
        m = state.meta
        out = paged_attention(q, k_cache, v_cache, m.block_tables, m.seq_lens,
                              m.query_start_loc, max_query_len=m.max_query_len,
                              max_seq_len=m.max_seq_len, scale=layer.scale,
                              sliding_window=layer.sliding_window, softcap=layer.softcap,
                              deterministic=layer.deterministic).reshape(-1, width)
    return layer.o(gather_rows(groups, out, step.row_tokens))  # [R, H/q D] -> [R, h]


def grid_parallelize(model, groups: TesseractGroups, layer_group: TPGroup,
                     state: GridStepState, chunks: int = 1) -> list[CommCounter]:
    """Make `model` (built from `grid_model_config`, weights not yet loaded) rank
    (i, j, k)'s share; each layer's collectives counted apart (the counters returned,
    one a layer), its o and MLP sums timed in `layer_group.times` ("3.o", "3.mlp", as
    1-D's). `chunks` > 1: o and the whole MLP run in that many runs of the step's rows,
    each run's row sum and column gather overlapping the next runs' compute."""
    g, i, j = groups.grid, groups.i, groups.j
    h = model.cfg.hidden_size
    hidden = slice(i * h // g.q, (i + 1) * h // g.q)
    counters = []
    for index, layer in enumerate(model.layers):
        mine = copy.copy(groups)  # the same process groups, this layer's counter
        mine.counter = CommCounter()
        counters.append(mine.counter)
        cfg = model.cfg
        o_times = layer_group.times.setdefault(f"{index}.o", SumTimes())
        mlp_times = layer_group.times.setdefault(f"{index}.mlp", SumTimes())
        layer.qkv = GridLinear(cfg.qkv_bias, hidden, mine.all_reduce_col, mine)
        layer.o = GridLinear(cfg.o_bias, None, None, mine, o_times, chunks)
        if isinstance(layer, MoeLayer):  # router whole; experts' blocks stay in place
            layer._mlp = _GridMoe(layer, hidden, mine, chunks, mlp_times)
        elif chunks > 1:  # down gives its partial product; the whole MLP is chunked
            layer.down = GridLinear(cfg.mlp_bias, None, None, mine)
            layer._mlp = _GridChunkedMlp(layer._mlp, layer.down, mine, chunks, mlp_times)
        else:
            layer.down = GridLinear(cfg.mlp_bias, None, None, mine, mlp_times)
        if not isinstance(layer, MoeLayer):
            layer.gate_up = GridLinear(cfg.mlp_bias, hidden, mine.all_reduce_col, mine)
        layer._attention = functools.partial(_grid_attention, layer, state, mine)
    start, end = vocab_range(model.cfg.vocab_size, g.q * g.q, i * g.q + j)
    model.lookup = _vocab_lookup(model, start, end, layer_group)
    model.lm_head = VocabParallelHead(model.lm_head, start, layer_group)
    return counters


class GridShardRunner(ShardRunner):
    """Rank (i, j, k) of a Tesseract grid: its weight blocks of every layer, the KV of
    heads block j for its grid row's sequences, its vocabulary slice of the depth
    layer's embedding and head. `step` runs its share of a step and gives rank 0 the
    whole step's result."""

    def __init__(self, config, info, group: TPGroup, groups: TesseractGroups):
        self.groups, self.state = groups, GridStepState()
        self.layer_counters: list[CommCounter] = []
        super().__init__(config, info, group, None)

    @property
    def _layer_rank(self) -> int:
        return self.groups.i * self.groups.grid.q + self.groups.j

    def _model_config(self):
        return grid_model_config(self.config.model_config, self.groups.grid.q)

    def _build_model(self, cfg):
        model = self.arch.build_model(cfg)
        self.layer_counters = grid_parallelize(model, self.groups, self.group, self.state,
                                               self.config.options.tp_overlap_chunks)
        return model

    def _fixed_sources(self, state) -> dict:
        full, q = self.config.model_config, self.groups.grid.q
        return shard_fixed_sources(full, self.arch.fixed_sources(state, full),
                                   self._layer_rank, q * q)

    def _layer_sources(self, state, index: int) -> dict:
        full, g = self.config.model_config, self.groups
        return grid_layer_sources(full, self.arch.layer_sources(state, index, full), g.grid.q,
                                  g.i, g.j)

    def _layer_parts(self, state, index: int, tp_rank: int | None = None):
        return {}, self._layer_sources(state, index)  # dense weights only (plan.check_grid)

    def layer_bytes(self) -> list[dict[str, int]]:
        """Per layer, the bytes this rank's grid collectives sent and received."""
        return [c.as_dict() for c in self.layer_counters]

    @torch.inference_mode()
    def step(self, inputs: StepInputs, groups: list[int], greedy: bool):
        """The rank's share of the step (`groups`: each request's sequence group); on
        rank (0, 0, 0) the whole step's greedy ids [S] or sampled rows' logits [S, V] in
        the step's sample order (None elsewhere, and where nothing samples)."""
        g = self.groups
        split = rank_step(inputs, groups, g.grid, g.i, g.k)
        self.state.step, self.state.meta = split, None
        out = None
        if split.inputs is not None:
            if split.attend is not None:
                self.state.meta = self._meta(split.attend)
            x, residual = self.forward(split.inputs)
            out = self.head(x, residual, split.inputs.sample_rows, greedy)
        self.state.step = self.state.meta = None
        return self._gather_depths(out, inputs, groups, greedy)

    def _meta(self, inputs: StepInputs) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._tensor(inputs.slots, torch.int64),
            block_tables=self._to_device(host_rows(inputs.block_tables)),
            seq_lens=self._tensor(inputs.seq_lens, torch.int32),
            query_start_loc=self._tensor(inputs.query_start, torch.int32),
            max_query_len=inputs.max_query_len, max_seq_len=int(inputs.seq_lens.max()))

    def _gather_depths(self, out, inputs: StepInputs, groups: list[int], greedy: bool):
        """Rank (0, 0, 0) gathers the depth layers' results from ranks (0, 0, k) and puts
        them in the step's sample order."""
        g = self.groups
        if (g.i, g.j) != (0, 0) or not len(inputs.sample_rows):
            return None
        shares = [rank_step(inputs, groups, g.grid, 0, k) for k in range(g.grid.depth)]
        if g.grid.depth > 1:
            most = max(len(s.sample_places) for s in shares)
            vocab = self.config.model_config.vocab_size
            shape = (most,) if greedy else (most, vocab)
            padded = torch.zeros(shape, dtype=torch.int64 if greedy else torch.float32,
                                 device=self.device)
            if out is not None:
                padded[:out.shape[0]] = out
            parts = g.all_gather(padded, g.depth_group, g.grid.depth)
        else:
            parts = [out]
        if g.k != 0:
            return None
        whole = [None] * len(inputs.sample_rows)
        for share, part in zip(shares, parts):
            for n, place in enumerate(share.sample_places):
                whole[place] = part[n]
        return torch.stack(whole)
