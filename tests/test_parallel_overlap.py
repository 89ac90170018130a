"""Communication that overlaps compute in device groups (tp_overlap_chunks): a layer's o
projection and MLP run in chunks of the step's tokens, each chunk's all-reduce started
while the next chunk computes. Every row's sum over the ranks is the one it is
unchunked, so the tokens must equal the single-process engine's; the bytes each rank
moves must equal docs/parallel_modes.md's 1-D formula; the timing splits communication
into the part compute hid and the part it did not."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from checkpoints import make_hf_checkpoint
from fusegen import LLM as _LLM
from fusegen import SamplingParams
from fusegen.engine.errors import EngineConfigError
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.options import EngineOptions
from fusegen.engine.parallel.overlap import (SumTimes, chunk_bounds, grid_summed_in_chunks,
                                             overlap_summary, summed_in_chunks)

LLM = functools.partial(_LLM, device="cpu", dtype="float32")

# Chunked prefill (16-token steps) and preemption with swapping: eight requests of 9 to
# 44 prompt tokens (mixed lengths in one fused batch) and 20 new ones over 12 KV blocks.
TIGHT = dict(max_num_batched_tokens=16, num_kv_blocks=12)
PROMPTS = [list(range(5, 14 + i)) for i in range(0, 40, 5)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
ARCHS = ("llama", "qwen2", "mixtral")  # mixtral: the MoE MLP, chunked as a whole


def tokens(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    out = {arch: make_hf_checkpoint(root / arch, arch) for arch in ARCHS}
    # o and down with biases: added once, after the chunks' sums
    out["llama-bias"] = make_hf_checkpoint(root / "llama-bias", "llama",
                                           attention_bias=True, mlp_bias=True)
    return out


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Each checkpoint's tokens from the single-process engine, through chunked prefill
    and preemption."""
    out = {}
    for name, path in checkpoints.items():
        with LLM(str(path), **TIGHT) as llm:
            out[name] = tokens(llm)
            assert llm.engine.stats.num_preemptions > 0
    return out


# -- the chunks and the clock, without processes ----------------------------------------

def test_chunks_are_near_equal_runs_of_rows_never_more_than_the_rows():
    assert chunk_bounds(10, 4) == [0, 2, 5, 7, 10]
    assert chunk_bounds(10, 1) == [0, 10]
    assert chunk_bounds(3, 8) == [0, 1, 2, 3]  # more chunks than rows: a row each
    assert chunk_bounds(1, 4) == [0, 1]


class _Clock:
    """Fake seconds; moving them on completes the started all-reduces due by then, each
    at its own end (as the collective's thread would)."""

    def __init__(self):
        self.now, self.pending = 0.0, []

    def __call__(self) -> float:
        return self.now

    def advance_to(self, when: float) -> None:
        for work in sorted(self.pending, key=lambda w: w.end):
            if work.end <= when and not work.future.done():
                self.now = work.end
                work.future.set_result(None)
        self.now = max(self.now, when)


class _Work:
    """A started all-reduce that completes at `end` (the fake collective's own
    thread): waiting on it moves the clock there if it is not there yet."""

    def __init__(self, clock: _Clock, end: float):
        self.clock, self.end, self.future = clock, end, torch.futures.Future()
        clock.pending.append(self)

    def get_future(self):
        return self.future

    def wait(self):
        self.clock.advance_to(self.end)


class _Group:
    """Two ranks whose all-reduces take `comm` seconds each, one at a time (a ring),
    and leave the tensor as it is (the other rank's share is zero)."""
    size = 2

    def __init__(self, clock: _Clock, comm: float):
        self.clock, self.comm, self.free_at, self.started = clock, comm, 0.0, []

    def start_all_reduce(self, t):
        begin = max(self.clock.now, self.free_at)
        self.free_at = begin + self.comm
        self.started.append(t.shape[0])
        return _Work(self.clock, self.free_at)

    def all_reduce(self, t):
        self.clock.advance_to(self.clock.now + self.comm)
        return t

    def all_reduce_bytes(self, t) -> int:
        return t.numel() * t.element_size()


def _compute(clock: _Clock, seconds: float):
    def fn(rows):
        clock.advance_to(clock.now + seconds)
        return rows * 2.0
    return fn


def test_timing_splits_communication_into_hidden_and_exposed():
    """Two chunks, 1 s of compute and 1.5 s of all-reduce each: chunk 0's sum runs
    1.0-2.5 (hidden 1.0-2.0 behind chunk 1's compute), chunk 1's 2.5-4.0; the caller
    waits 2.0-4.0. Communication in flight 3.0 s, exposed 2.0 s: a third hidden."""
    clock = _Clock()
    group, times = _Group(clock, 1.5), SumTimes()
    x = torch.arange(12.0).view(6, 2)
    out = summed_in_chunks(_compute(clock, 1.0), x, group, 2, times, clock)
    assert torch.equal(out, x * 2.0) and group.started == [3, 3]
    assert (times.calls, times.tokens, times.bytes) == (1, 6, 48)
    assert (times.comm_s, times.exposed_s, times.hidden_s, times.compute_s) == (3.0, 2.0, 1.0,
                                                                               2.0)


def test_one_chunk_is_one_synchronous_all_reduce_with_nothing_hidden():
    clock = _Clock()
    group, times = _Group(clock, 1.5), SumTimes()
    x = torch.arange(12.0).view(6, 2)
    out = summed_in_chunks(_compute(clock, 1.0), x, group, 1, times, clock)
    assert torch.equal(out, x * 2.0) and group.started == []
    assert (times.comm_s, times.exposed_s, times.hidden_s, times.compute_s) == (1.5, 1.5, 0.0,
                                                                               1.0)


def test_chunks_beyond_the_rows_run_a_row_each():
    clock = _Clock()
    group, times = _Group(clock, 0.5), SumTimes()
    x = torch.arange(6.0).view(3, 2)
    out = summed_in_chunks(_compute(clock, 1.0), x, group, 64, times, clock)
    assert torch.equal(out, x * 2.0) and group.started == [1, 1, 1]
    # sums at 1.0-1.5, 2.0-2.5, 3.0-3.5: the first two hidden, the last waited for
    assert (times.comm_s, times.exposed_s, times.hidden_s) == (1.5, 0.5, 1.0)


class _Grid:
    """Rank (0, 0) of a q = 2 grid whose row sums and column gathers take `comm` seconds
    each, one at a time on one link: a sum leaves the block as it is, a gather puts the
    other rank's block (the same here, negated) beside it."""

    def __init__(self, clock: _Clock, comm: float):
        self.clock, self.comm, self.free_at, self.started = clock, comm, 0.0, []
        self.grid = SimpleNamespace(q=2)

    def _start(self, what: str, t):
        begin = max(self.clock.now, self.free_at)
        self.free_at = begin + self.comm
        self.started.append((what, t.shape[0], begin))
        return _Work(self.clock, self.free_at)

    def start_all_reduce_row(self, t):
        return self._start("sum", t)

    def start_gather_col(self, t):
        return [t, -t], self._start("gather", t)


def test_grid_chunks_start_each_runs_gather_once_its_sum_is_in():
    """Two runs of 3 rows, 1 s of compute and 1 s per collective: run 0 computes 0-1,
    its sum 1-2 while run 1 computes 1-2; run 1's sum 2-3, then run 0's gather (waited
    at 2 with nothing blocked) 3-4, run 1's 4-5; the caller blocks 2-5 (run 1's sum from
    2 to 3, then the gathers). In flight 1-5 (4 s), exposed 3 s."""
    clock = _Clock()
    grid, times = _Grid(clock, 1.0), SumTimes()
    x = torch.arange(12.0).view(6, 2)
    out = grid_summed_in_chunks(_compute(clock, 1.0), x, grid, 2, times, clock)
    assert torch.equal(out, torch.cat([x * 2.0, x * -2.0], dim=1))
    assert grid.started == [("sum", 3, 1.0), ("sum", 3, 2.0), ("gather", 3, 3.0),
                            ("gather", 3, 4.0)]
    # per run of 3 rows x 2 fp32: a ring sum sends 2 (q-1)/q of 24 bytes, a gather 24
    assert (times.calls, times.tokens, times.bytes) == (1, 6, 2 * (24 + 24))
    assert (times.comm_s, times.exposed_s, times.hidden_s, times.compute_s) == (4.0, 3.0, 1.0,
                                                                               2.0)


def test_grid_one_chunk_sums_then_gathers_with_nothing_hidden():
    clock = _Clock()
    grid, times = _Grid(clock, 1.5), SumTimes()
    x = torch.arange(12.0).view(6, 2)
    out = grid_summed_in_chunks(_compute(clock, 1.0), x, grid, 1, times, clock)
    assert torch.equal(out, torch.cat([x * 2.0, x * -2.0], dim=1))
    assert grid.started == [("sum", 6, 1.0), ("gather", 6, 2.5)]
    assert (times.comm_s, times.exposed_s, times.hidden_s, times.compute_s) == (3.0, 3.0, 0.0,
                                                                               1.0)


def test_the_groups_summary_counts_each_layer_on_the_ranks_that_ran_it():
    """Two stages: layer 0 on ranks 0 and 1, layer 1 on rank 2 alone (tp 2 x pp 2,
    one rank's figures left out). Seconds add over ranks; calls, tokens and bytes are a
    rank's."""
    def row(calls):
        return dict(calls=calls, tokens=10 * calls, bytes=100 * calls, compute_s=1.0 * calls,
                    comm_s=2.0 * calls, exposed_s=0.5 * calls)
    summary = overlap_summary({0: {"0.o": row(2), "1.o": row(0)},
                               1: {"0.o": row(2), "1.o": row(0)},
                               2: {"0.o": row(0), "1.o": row(3)}})
    assert summary["layers"]["0.o"] == dict(
        ranks=2, calls=2, tokens=20, bytes=200, compute_s=4.0, comm_s=8.0, exposed_s=2.0,
        hidden_s=6.0, overlap_fraction=0.75, bytes_per_token=10.0)
    assert summary["layers"]["1.o"]["ranks"] == 1 and summary["layers"]["1.o"]["calls"] == 3
    assert {k: summary[k] for k in ("compute_s", "comm_s", "exposed_s", "hidden_s",
                                    "overlap_fraction", "ranks")} \
        == dict(compute_s=7.0, comm_s=14.0, exposed_s=3.5, hidden_s=10.5, overlap_fraction=0.75,
                ranks=3)


# -- bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -2, 2.5, "2", True, None])
def test_bad_chunk_counts_are_refused_naming_the_value(value):
    with pytest.raises(EngineConfigError) as info:
        EngineOptions(tp_overlap_chunks=value)
    assert str(info.value) == f"tp_overlap_chunks must be an integer >= 1, got {value!r}"


def test_bad_chunk_count_is_refused_before_any_rank_starts(checkpoints):
    with pytest.raises(EngineConfigError, match=r"^tp_overlap_chunks must be an integer "
                                                r">= 1, got 0$"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=2, tp_overlap_chunks=0)


def test_a_job_file_and_the_command_line_take_the_option():
    from click.testing import CliRunner

    from fusegen.jobs.bench_cmd import bench
    from fusegen.jobs.errors import JobError
    from fusegen.jobs.spec import build_spec

    job = {"model": "m", "input": "in.jsonl", "output": "out", "tensor_parallel_size": 2}
    assert build_spec({**job, "tp_overlap_chunks": 4}).engine.tp_overlap_chunks == 4
    with pytest.raises(JobError, match=r"^tp_overlap_chunks must be an integer >= 1, "
                                                r"got 1\.5$"):
        build_spec({**job, "tp_overlap_chunks": 1.5})
    result = CliRunner().invoke(bench, ["--tp-overlap-chunks", "0"])
    assert result.exit_code != 0 and "tp_overlap_chunks must be an integer >= 1, got 0" \
        in result.output


# -- device groups --------------------------------------------------------------------

@pytest.mark.parametrize("name", [*ARCHS, "llama-bias"])
def test_overlapped_groups_give_single_process_tokens(checkpoints, reference, name):
    for chunks in (2, 4):
        with LLM(str(checkpoints[name]), tensor_parallel_size=2, tp_overlap_chunks=chunks,
                 **TIGHT) as llm:
            assert tokens(llm) == reference[name], chunks
            assert llm.engine.stats.num_preemptions > 0
            overlap = llm.engine.runner.tensor_parallel_overlap()
        layers = overlap["layers"]
        assert sorted(layers) == sorted(f"{i}.{part}" for i in range(2) for part in ("o", "mlp"))
        assert overlap["comm_s"] > 0 and 0.0 <= overlap["overlap_fraction"] <= 1.0


def test_more_chunks_than_a_steps_rows_give_the_same_tokens(checkpoints, reference):
    """64 chunks: a decode step of 8 rows runs a row a chunk, a 16-token prefill step
    16 chunks of one."""
    with LLM(str(checkpoints["llama"]), tensor_parallel_size=2, tp_overlap_chunks=64,
             **TIGHT) as llm:
        assert tokens(llm) == reference["llama"]


def test_chunked_sums_are_bit_identical_to_one_sum_in_deterministic_mode(checkpoints):
    """Row-tiled matmuls (deterministic mode) make a row's product independent of the
    other rows in its call, and two ranks' sum is a + b in either order: so chunks change
    no bit, and seeded sampling's tokens and logprobs equal exactly."""
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=i, logprobs=2,
                             ignore_eos=True) for i in range(len(PROMPTS))]

    def run(chunks):
        with LLM(str(checkpoints["llama"]), tensor_parallel_size=2, deterministic=True,
                 tp_overlap_chunks=chunks, **TIGHT) as llm:
            outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            return [(o.token_ids, o.cumulative_logprob) for o in outs]
    assert run(3) == run(1)


@pytest.mark.parametrize("tp", [2, 4])
def test_bytes_per_rank_per_layer_per_token_equal_the_1d_formula(checkpoints, tp):
    """docs/parallel_modes.md: 1-D over p ranks moves 4 (p - 1) / p h e bytes per layer
    per token per rank (o's and the MLP's all-reduce, 2 (p - 1) / p h e each), sent and
    received alike; chunks change how many calls, not how many bytes. One step of 40
    tokens, one sampled row: the embedding's all-reduce and the greedy head's gather of
    (value, index) pairs beside the layers'."""
    cfg = ModelConfig.from_dir(checkpoints["llama"])
    h, e, num_tokens, chunks = cfg.hidden_size, 4, 40, 4
    prompt = list(range(30, 30 + num_tokens))
    with LLM(str(checkpoints["llama"]), tensor_parallel_size=tp,
             tp_overlap_chunks=chunks) as llm:
        runner = llm.engine.runner
        tokens(llm, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
        overlap = runner.tensor_parallel_overlap()
        sent = runner.collective_bytes()
    per_layer = {i: sum(overlap["layers"][f"{i}.{part}"]["bytes_per_token"]
                        for part in ("o", "mlp")) for i in range(cfg.num_layers)}
    assert per_layer == {i: 4 * (tp - 1) / tp * h * e for i in range(cfg.num_layers)}
    for part in ("o", "mlp"):
        row = overlap["layers"][f"0.{part}"]
        assert (row["calls"], row["tokens"]) == (1, num_tokens)
    ring = 2 * (tp - 1) * num_tokens * h * e // tp  # one all-reduce of the step's rows
    head = (tp - 1) * 2 * 4  # one row's (value, index) pair from each other rank
    expected = (2 * cfg.num_layers + 1) * ring + head
    assert {rank: b["tensor_parallel"] for rank, b in sent.items()} \
        == {rank: expected for rank in range(tp)}


# -- on a Tesseract grid -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "llama-bias"])
def test_overlapped_grids_give_single_process_tokens(checkpoints, reference, name):
    """[2, 2, 1] with 2 chunks: o and the MLP in runs of rows, each run's sum over the
    grid row and gather along the grid column started while the next runs compute; o's
    and down's biases added once, after. Per layer and token a rank sends, for o and for
    down alike, 2 (q-1)/q of its h/q block summed and (q-1) blocks gathered."""
    cfg = ModelConfig.from_dir(checkpoints[name])
    with LLM(str(checkpoints[name]), tensor_parallel_size=4, tensor_parallel_mode="2d",
             tp_overlap_chunks=2, **TIGHT) as llm:
        assert tokens(llm) == reference[name]
        assert llm.engine.stats.num_preemptions > 0
        overlap = llm.engine.runner.tensor_parallel_overlap()
    layers, q, e = overlap["layers"], 2, 4
    assert sorted(layers) == sorted(f"{i}.{part}" for i in range(cfg.num_layers)
                                    for part in ("o", "mlp"))
    block = cfg.hidden_size // q * e
    for row in layers.values():
        assert row["ranks"] == 4 and row["calls"] > 0
        assert row["bytes_per_token"] == 2 * (q - 1) * block / q + (q - 1) * block
    assert overlap["comm_s"] > 0 and 0.0 <= overlap["overlap_fraction"] <= 1.0
