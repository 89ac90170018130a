"""The decoder on a Tesseract grid (tensor_parallel_mode 2d / 2.5d): the sequence groups'
policy over plain lists, each rank's weight blocks, refusals before any process starts,
and the engine's tokens on 4 ranks [2, 2, 1] and 8 ranks [2, 2, 2] against the
single-process engine (greedy, fp32; dense and mixture-of-experts models), through
fused mixed-length batches, chunked prefill, preemption and prefix-cache hits; each rank's bytes per layer against the
formulas in docs/parallel_modes.md."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch

from checkpoints import make_hf_checkpoint
from fusegen import LLM as _LLM
from fusegen import SamplingParams
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.models import get_architecture
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.parallel.shard import grid_layer_sources, grid_model_config
from fusegen.engine.parallel.tesseract import GridShape
from fusegen.engine.parallel.tesseract_batch import SequenceGroups, rank_step
from fusegen.engine.step_inputs import StepInputs

LLM = functools.partial(_LLM, device="cpu", dtype="float32")
GRIDS = {"2d": dict(tensor_parallel_size=4, tensor_parallel_mode="2d"),
         "2.5d": dict(tensor_parallel_size=8, tensor_parallel_mode="2.5d", tesseract_depth=2)}
# Chunked prefill (16-token steps) and preemption: eight requests of 9 to 44 prompt
# tokens and 20 new ones over 12 KV blocks of 16; those of 16 tokens or more share their
# first block (prefix caching), which only one sequence group computes.
TIGHT = dict(max_num_batched_tokens=16, num_kv_blocks=12)
TIGHT_PROMPTS = [list(range(5, 14 + i)) for i in range(0, 40, 5)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def tokens(llm, prompts, n: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(n), use_tqdm=False)]


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "fusegen.engine.parallel" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tesseract")


# Top-2 of 4 experts (tests/test_models_moe.py's); Qwen3-MoE's experts narrower than its
# (unused) dense intermediate size.
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                         head_dim=16, norm_topk_prob=True)}


@functools.cache
def _checkpoint(root, arch: str):
    return make_hf_checkpoint(root / arch, arch, **MOE.get(arch, {}))


# -- policy ---------------------------------------------------------------------------

def _req(rid, blocks, computed=0, status="RUNNING"):
    return SimpleNamespace(request_id=rid, block_table=blocks, num_computed_tokens=computed,
                           status=SimpleNamespace(name=status))


def test_sequences_keep_their_group_and_cached_prefixes_follow_their_writer():
    groups = SequenceGroups(GridShape(2, 2))  # 4 groups: g = k q + i
    a, b, c = _req(1, [0]), _req(2, [1]), _req(3, [2, 3])
    assert groups.assign([a, b, c]) == [0, 1, 2]  # the emptiest group, lowest first
    d, e = _req(4, [4]), _req(5, [5])
    assert groups.assign([c, a, d, e]) == [2, 0, 1, 3]  # kept; new ones fill 1 then 3
    # a prompt starting from cached blocks 2, 3 (group 2 wrote them) joins group 2,
    # though groups 1 and 3 have fewer of the step's requests
    f = _req(6, [2, 3, 7], computed=32)
    assert groups.assign([f]) == [2]
    # a reused block id with nothing cached (no computed tokens) is a new sequence
    g = _req(7, [0])
    assert groups.assign([a, g]) == [0, 1]
    # swapped out and back in other blocks: the same group
    a.block_table = [9]
    assert groups.assign([a]) == [0] and groups.block_owner[9] == 0
    a.status = SimpleNamespace(name="FINISHED")
    groups.assign([])
    assert 1 not in groups.group_of and 2 in groups.group_of


def _inputs(lengths: list[int], sampled: list[int]) -> StepInputs:
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(qs[-1])
    return StepInputs(np.arange(100, 100 + n), np.arange(n), np.arange(200, 200 + n),
                      np.array([[b, b + 10] for b in range(len(lengths))], dtype=np.int32),
                      np.array(lengths) + 5, qs, qs[1:][sampled] - 1, np.array(sampled),
                      max(lengths), None, [(1, 2)], [])


def test_each_rank_runs_its_depth_layers_requests_and_attends_its_rows():
    grid = GridShape(2, 2)
    inputs = _inputs([3, 1, 2, 4, 1], sampled=[0, 1, 3, 4])
    groups = [3, 0, 2, 1, 2]  # requests 2 and 4 -> depth 1, row 0; 0 -> depth 1, row 1
    step = rank_step(inputs, groups, grid, i=1, k=1)
    # depth 1 runs requests 2, 4 (row 0) then 0 (row 1): 2 + 1 + 3 tokens
    assert step.inputs.input_ids.tolist() == [104, 105, 110, 100, 101, 102]
    assert step.inputs.query_start.tolist() == [0, 2, 3, 6]
    assert step.inputs.block_tables.tolist() == [[2, 12], [4, 14], [0, 10]]
    assert step.inputs.sample_rows.tolist() == [2, 5] and step.sample_places == [3, 0]
    assert step.row_tokens == [3, 3] and step.rows == range(3, 6)
    assert step.attend.slots.tolist() == [200, 201, 202] and step.inputs.swap_out == [(1, 2)]
    row0 = rank_step(inputs, groups, grid, i=0, k=1)
    assert row0.rows == range(0, 3) and row0.attend.seq_lens.tolist() == [7, 6]
    empty = rank_step(inputs, [0, 0, 1, 1, 0], grid, i=0, k=1)  # depth 1 has nothing
    assert empty.inputs is None and empty.row_tokens == [0, 0]
    alone = rank_step(inputs, [0, 0, 0, 0, 0], grid, i=1, k=0)  # row 1 attends nothing
    assert alone.attend is None and alone.row_tokens == [11, 0] and alone.rows == range(11, 11)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_weight_blocks_rebuild_every_parameter(root, arch):
    """Rank (i, j)'s blocks: q/k/v and gate/up outputs j x inputs i; o and down outputs
    i x inputs j; set side by side they give the whole layer (Phi-3's fused tensors cut
    per part)."""
    from fusegen.engine.weights.loader import fuse, load_state_dict

    path = _checkpoint(root, arch)
    cfg = ModelConfig.from_dir(path)
    a = get_architecture(cfg.architecture)
    state = load_state_dict(str(path), cfg, False)
    whole = fuse(a.layer_sources(state, 1, cfg), "cpu", torch.float32)
    q, d = 2, cfg.head_dim
    blocks = {(i, j): fuse(grid_layer_sources(cfg, a.layer_sources(state, 1, cfg), q, i, j),
                           "cpu", torch.float32) for i in range(q) for j in range(q)}
    local = grid_model_config(cfg, q)
    sizes = [local.num_heads * d, local.num_kv_heads * d, local.num_kv_heads * d]

    def grid(name, split, out_by_j):  # [out, in] from blocks: parts of each j stacked
        rows = []
        for j in range(q):
            cols = [blocks[(i, j) if out_by_j else (j, i)][name] for i in range(q)]
            rows.append(torch.cat(cols, dim=1).split(split))
        return torch.cat([torch.cat([r[p] for r in rows]) for p in range(len(split))])

    assert torch.equal(grid("qkv.weight", sizes, True), whole["qkv.weight"])
    inter = local.intermediate_size
    assert torch.equal(grid("gate_up.weight", [inter, inter], True), whole["gate_up.weight"])
    for name in ("o.weight", "down.weight"):  # rank (i, j): outputs i, inputs j
        assert torch.equal(torch.cat([torch.cat([blocks[(i, j)][name] for j in range(q)], 1)
                                      for i in range(q)]), whole[name])
    for name in whole:
        if "norm" in name:
            assert all(torch.equal(b[name], whole[name]) for b in blocks.values())


def test_grids_the_model_or_options_cannot_take_are_refused_before_start(root):
    path = str(_checkpoint(root, "llama"))  # 4 heads, 2 KV heads, hidden 64, inter 128
    cases = [
        (dict(tensor_parallel_size=8, tensor_parallel_mode="2d"),
         "tensor_parallel_mode '2d': a Tesseract grid of 8 ranks at tesseract_depth 1 needs "
         "8 = q x q x 1 for some integer q, and there is none; at depth 1 use 4 ranks "
         "[2, 2, 1], 9 ranks [3, 3, 1]; 8 ranks fit [1, 1, 8], [2, 2, 2]"),
        (dict(tensor_parallel_size=16, tensor_parallel_mode="2d"),
         "tensor_parallel_mode '2d': num_kv_heads 2 is not divisible by q = 4 of the "
         "Tesseract grid [4, 4, 1]; grids with q in [1, 2] split it"),
        (dict(tensor_parallel_size=8, tensor_parallel_mode="2.5d", tesseract_depth=2,
              max_num_seqs=5),
         "tensor_parallel_mode '2.5d': a batch of 5 sequences is not divisible by "
         "tesseract_depth 2 of the grid [2, 2, 2]; use a batch of 4 or 6, or a depth in "
         "[1, 5]"),
        (dict(tensor_parallel_size=4, tensor_parallel_mode="2d", pipeline_parallel_size=2),
         "tensor_parallel_mode '2d' runs with pipeline_parallel_size 1 (got 2)"),
        (dict(tensor_parallel_size=4, tensor_parallel_mode="2d", quantization="int8"),
         "tensor_parallel_mode '2d' runs dense weights only (quantization resolved to "
         "'int8')"),
    ]
    for options, message in cases:
        with pytest.raises(EngineConfigError) as info:
            LLM(path, **options)
        assert str(info.value).startswith(message), str(info.value)
    assert _children() == []


def test_experts_the_grid_cannot_split_are_refused_naming_the_sizes(root):
    """A mixture of experts' width is cut into q blocks like the dense MLP's: one q does
    not divide is refused before any process starts (Qwen3-MoE's dense
    intermediate_size, which no layer uses, is not asked to divide)."""
    import dataclasses

    from fusegen.engine.options import EngineOptions
    from fusegen.engine.parallel.plan import check_grid

    cfg = ModelConfig.from_dir(_checkpoint(root, "qwen3_moe"))
    options = EngineOptions(tensor_parallel_size=4, tensor_parallel_mode="2d")
    assert check_grid(dataclasses.replace(cfg, intermediate_size=127), options,
                      "dequantize") == 2
    with pytest.raises(EngineConfigError) as info:
        check_grid(dataclasses.replace(cfg, moe_intermediate_size=63), options, "dequantize")
    assert str(info.value) == (
        "tensor_parallel_mode '2d': expert intermediate size 63 is not divisible by q = 2 "
        "of the Tesseract grid [2, 2, 1]; grids with q in [1, 3, 7, 9, 21, 63] split it")


# -- the engine on the grid -----------------------------------------------------------

# Every dense architecture on [2, 2, 2]; those with their own layer code on [2, 2, 1] too;
# the mixtures of experts (router whole, every expert's blocks in place) on both.
MODES = {"llama": ("2.5d", "2d"), "mistral": ("2.5d",), "qwen2": ("2.5d",),
         "qwen3": ("2.5d", "2d"), "gemma2": ("2.5d",), "gemma3": ("2.5d", "2d"),
         "phi3": ("2.5d", "2d"), "mixtral": ("2.5d", "2d"), "qwen3_moe": ("2.5d", "2d")}


@pytest.mark.parametrize("arch", list(MODES))
def test_grid_gives_single_process_tokens(root, arch):
    path = str(_checkpoint(root, arch))
    with LLM(path) as llm:
        expected = tokens(llm, TIGHT_PROMPTS, 20)
    for mode in MODES[arch]:
        with LLM(path, **GRIDS[mode], **TIGHT) as llm:
            assert tokens(llm, TIGHT_PROMPTS, 20) == expected, mode
            stats = llm.engine.stats
            assert stats.num_preemptions > 0  # the victim recomputed in its group
            assert stats.prompt_tokens_cached > 0  # from blocks their writer's group holds
            assert llm.engine.memory_report()["group"]["grid"] == \
                ("[2, 2, 1]" if mode == "2d" else "[2, 2, 2]")
    assert _children() == []


E = 4  # fp32 bytes


def layer_bytes(q: int, rows: int, most_rows: int, cfg) -> int:
    """One rank's bytes (sent, and as many received) for one layer of a step whose
    depth layer runs `rows` tokens, its largest grid row `most_rows`
    (docs/parallel_modes.md): ring all-reduces 2 (q - 1) / q of qkv's and gate/up's
    outputs along the grid column and of o's and down's along the grid row, the
    attention outputs and o's and down's hidden blocks gathered along the column."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    reduced = rows * (qkv + 2 * inter + 2 * h) // q  # elements each rank all-reduces
    gathered = most_rows * cfg.num_heads * d // q + 2 * rows * h // q
    return E * (2 * (q - 1) * reduced // q + (q - 1) * gathered)


def test_bytes_each_rank_moves_per_layer_equal_the_formulas(root):
    """One prefill step of four 8-token prompts, counted on every rank: [2, 2, 1] runs
    32 tokens on each rank (16 a grid row), [2, 2, 2] 16 on each (8 a grid row)."""
    path = str(_checkpoint(root, "llama"))
    cfg = ModelConfig.from_dir(path)
    prompts = [list(range(10 * n + 5, 10 * n + 13)) for n in range(4)]
    for mode, rows, per_token in (("2d", 32, 1344), ("2.5d", 16, 672)):
        with LLM(path, **GRIDS[mode]) as llm:
            tokens(llm, prompts, 1)
            counts = llm.engine.runner.grid_layer_bytes()
        expected = layer_bytes(2, rows, rows // 2, cfg)
        assert expected == per_token * 32  # the table's bytes per token of the step
        for rank, layers in counts.items():
            assert [c["bytes_sent"] for c in layers] == [expected] * cfg.num_layers, rank
            assert [c["bytes_received"] for c in layers] == [expected] * cfg.num_layers
            assert [c["num_collectives"] for c in layers] == [7] * cfg.num_layers


def test_sampled_rows_logits_come_back_in_the_steps_order(root):
    """Seeded sampling with logprobs: the sampled rows' logits (Gemma 3's soft-capped
    head) gathered over the vocabulary slices and the depth layers into the step's
    order; tokens equal the single-process engine's, logprobs within fp32 rounding of the
    grid's split sums."""
    path = str(_checkpoint(root, "gemma3"))
    prompts = [list(range(5, 14)), [20, 21, 22], list(range(30, 70)), [7] * 17]
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=i, logprobs=2)
              for i in range(4)]
    runs = []
    for options in ({}, GRIDS["2.5d"]):
        with LLM(path, **options) as llm:
            runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
    one, grid = runs
    assert [o.token_ids for o in grid] == [o.token_ids for o in one]
    for a, b in zip(one, grid):
        for x, y in zip(a.logprobs, b.logprobs):
            assert list(x) == list(y)
            assert [v.logprob for v in y.values()] == pytest.approx(
                [v.logprob for v in x.values()], rel=1e-5, abs=1e-5)


# -- the memory plan on the grid ------------------------------------------------------

def test_the_plan_counts_a_grid_ranks_weights_exactly(root):
    """A rank of a q x q grid holds 1/q^2 of each linear (its block; of every expert's,
    Mixtral), both norms and a router whole, and 1/q^2 of the vocabulary's embedding and
    head rows (a tied head's packed copy too, Gemma 3 on a CPU): the plan's bytes equal
    what every rank loads."""
    for arch in ("llama", "gemma3", "mixtral"):
        path = str(_checkpoint(root, arch))
        cfg = ModelConfig.from_dir(path)
        with LLM(path, **GRIDS["2d"]) as llm:
            sizes = llm.placement.sizes
            loaded = {rank: report["device"]["weights"]
                      for rank, report in llm.engine.memory_report()["ranks"].items()}
        assert loaded == {rank: sizes.fixed_bytes + cfg.num_layers * sizes.layer_bytes
                          for rank in range(4)}, arch
        if arch in ("llama", "mixtral"):  # no biases, untied head
            h, inter, d, q = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, 2
            heads, kv = cfg.num_heads, cfg.num_kv_heads
            linears = (heads + 2 * kv) * d * h + h * heads * d + 3 * inter * h
            router = 0
            if arch == "mixtral":  # 4 experts of width moe_intermediate_size, router [E, h]
                experts = cfg.num_experts
                linears += (experts - 1) * 3 * cfg.moe_intermediate_size * h
                router = experts * h
                assert experts == 4 and cfg.moe_intermediate_size == inter
            assert sizes.layer_bytes == E * (linears // q ** 2 + router + 2 * h), arch
            assert sizes.fixed_bytes == E * (2 * cfg.vocab_size // q ** 2 * h + h), arch


def test_asked_for_host_kv_blocks_get_their_bytes_on_a_cpu():
    """num_host_kv_blocks on a CPU with no device_memory or host_memory: the asked-for
    blocks, exactly, and no swap pool unasked."""
    from fusegen.engine.memory.plan import FreeMemory, ModelShape, plan_engine
    from fusegen.engine.options import EngineOptions

    shape = ModelShape(num_layers=8, layer_params=2**20, fixed_params=2**21, kv_width=64,
                       activation_width=1000, vocab_size=1000, max_position_embeddings=256,
                       dtype_bytes=4)
    cpu = FreeMemory(device=8 * 2**30, host=8 * 2**30, on_gpu=False)
    plan = plan_engine(EngineOptions(num_host_kv_blocks=12), shape, cpu).placement
    assert plan.num_host_kv_blocks == 12
    assert plan.host_budget == 12 * plan.sizes.kv_block_bytes
    assert plan.layer_tiers == ["device"] * 8
    assert plan_engine(EngineOptions(), shape, cpu).placement.num_host_kv_blocks == 0


@pytest.mark.parametrize("mode", ["2d", "2.5d"])
def test_grid_preemption_swaps_to_host_blocks_token_exact(root, mode):
    """TIGHT's small device pool and 12 host KV blocks: preempted requests' blocks are
    swapped out to the host pool and back into their sequence group's ranks."""
    path = str(_checkpoint(root, "llama"))
    with LLM(path) as llm:
        expected = tokens(llm, TIGHT_PROMPTS, 20)
    with LLM(path, **GRIDS[mode], **TIGHT, num_host_kv_blocks=12) as llm:
        assert llm.placement.num_host_kv_blocks == 12
        assert tokens(llm, TIGHT_PROMPTS, 20) == expected
        stats = llm.engine.stats
        assert stats.num_preemptions > 0 and stats.num_swapped_blocks > 0
        assert llm.engine.memory_report()["kv_blocks"]["host"] == 12
