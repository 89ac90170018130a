"""Recorded decode steps on CPUs (engine/cpu_graphs.py, engine/graphs.py's
CpuDecodeGraphs): the same tokens, logprobs and bits as the eager engine, replays
that make every kernel call of a step, and the engine going eager where a replay
cannot be trusted."""
import ctypes
import logging

import numpy as np
import pytest
import torch

from checkpoints import make_hf_checkpoint
from fusegen.engine import LLM, SamplingParams
from fusegen.engine import graphs as graphs_module
from fusegen.engine.cpu_graphs import ReplayMismatch, record
from fusegen.engine.graphs import CPU_GRAPH_ROWS, CpuDecodeGraphs, rows_within
from fusegen.engine.step_inputs import StepInputs
from fusegen.kernels import native
from gguf_checkpoints import Q, write_gguf
from test_engine_equality import PROMPTS
from test_engine_graphs import BUDGETS
from test_sparse_weights import source, write_pruned

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the C kernels")
# 7 requests whose budgets finish them one by one: decode steps of 7 (once), 6, 5, 4
# (once each), 3, 2 (twice each) and 1 row (four times), every row count a graph takes
NS = [13, 2, 9, 4, 3, 7, 5]
OPTIONS = dict(device="cpu", max_num_seqs=7, max_model_len=128)
ROWS = set(range(1, 8))


def greedy(ns=NS):
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in ns]


def generate(model_dir, params, eager: bool, prompts=PROMPTS, **options):
    """(token ids per prompt, logprobs per prompt, the runner's graphs)"""
    with LLM(str(model_dir), enforce_eager=eager, **{**OPTIONS, **options}) as llm:
        outs = llm.generate(prompts, params)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        return ([o.token_ids for o in outs], [_values(o.outputs[0].logprobs) for o in outs],
                graphs)


def _values(logprobs):
    if logprobs is None:
        return None
    return [{token: (p.logprob, p.rank) for token, p in position.items()}
            for position in logprobs]


def assert_graphed_equals_eager(model_dir, params=None, rows=ROWS, **options):
    params = params or greedy()
    eager, eager_logprobs, _ = generate(model_dir, params, True, **options)
    graphed, logprobs, graphs = generate(model_dir, params, False, **options)
    assert graphed == eager
    assert logprobs == eager_logprobs  # exactly: a replay makes eager's calls
    assert graphs.failed is None and graphs.replays > 0
    assert {rows for rows, _ in graphs.graphs} == rows
    return graphs


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_hf_checkpoint(tmp_path_factory.mktemp(arch), arch, seed=2)
        return made[arch]
    return get


@pytest.mark.parametrize("arch, dtype", [
    ("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"),
    ("qwen3", "bfloat16"), ("gemma3", "float32"), ("phi3", "bfloat16"),
])
def test_greedy_tokens_equal_eager(arch, dtype, arch_dirs):
    graphs = assert_graphed_equals_eager(arch_dirs(arch), dtype=dtype)
    assert type(graphs) is CpuDecodeGraphs and graphs.buckets == list(range(1, 8))
    # greedy rows: each graph holds the head and argmax
    assert all(set(by_head) == {True} for by_head in graphs.graphs.values())


def test_soft_capped_attention_runs_eagerly(arch_dirs):
    # Gemma 2's soft cap takes the torch reference, which loops over the sequences
    # in Python: its steps would not replay, so they are not recorded
    with LLM(str(arch_dirs("gemma2")), **OPTIONS) as llm:
        assert llm.engine.runner.graphs is None


def test_sampled_rows_stops_logprobs_and_prefix_caching(llama_dir):
    # Seeded sampled rows (the head outside the graph), logprobs, a stop token and a stop
    # string, prompts sharing a cached prefix: the same tokens and logprob values.
    shared = PROMPTS[6] + " "
    prompts = [shared + p for p in PROMPTS[:4]] + PROMPTS[4:]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in BUDGETS]
    params[1] = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, top_k=20, seed=7,
                               ignore_eos=True)
    params[2] = SamplingParams(max_tokens=9, temperature=0.0, logprobs=3, ignore_eos=True)
    params[3] = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2,
                               ignore_eos=True)
    params[5] = SamplingParams(max_tokens=12, temperature=0.0, stop=["a"], ignore_eos=True)
    eager, eager_logprobs, _ = generate(llama_dir, params, True, prompts=prompts,
                                        dtype="float32", enable_prefix_caching=True)
    graphed, logprobs, graphs = generate(llama_dir, params, False, prompts=prompts,
                                         dtype="float32", enable_prefix_caching=True)
    assert graphed == eager and logprobs == eager_logprobs
    assert eager_logprobs[2] is not None and graphs.replays > 0
    # steps with sampled rows record (x, residual) only; plain greedy ones the head too
    heads = {head for by_head in graphs.graphs.values() for head in by_head}
    assert heads == {False, True}


# 12 requests finishing one by one: decode steps of every row count 1..12, past 8
NS12 = [13, 2, 9, 4, 3, 7, 5, 16, 6, 10, 11, 12]
PROMPTS12 = PROMPTS + PROMPTS[:5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_counts_past_eight_record_and_replay(dtype, llama_dir):
    graphs = assert_graphed_equals_eager(llama_dir, greedy(NS12), rows=set(range(1, 13)),
                                         prompts=PROMPTS12, dtype=dtype, max_num_seqs=12)
    assert graphs.rows == 12 and graphs.buckets == list(range(1, 13))


def test_deterministic_mode_is_bit_identical(llama_dir):
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True)
              for n in NS]
    assert_graphed_equals_eager(llama_dir, params, dtype="float32", deterministic=True)
    # and past 8 rows, in bf16
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True)
              for n in NS12]
    assert_graphed_equals_eager(llama_dir, params, rows=set(range(1, 13)), prompts=PROMPTS12,
                                dtype="bfloat16", deterministic=True, max_num_seqs=12)


def test_sparse_tile_weights(tmp_path, tmp_path_factory):
    sparse = write_pruned(source("llama", tmp_path_factory), tmp_path / "s", "bfloat16")
    for dtype in ("float32", "bfloat16"):
        assert_graphed_equals_eager(sparse, dtype=dtype)


def test_gguf_blocks(llama_dir, tmp_path):
    path = write_gguf(llama_dir, tmp_path / "tiny.gguf", qtype=Q.Q4_0)
    for dtype in ("float32", "bfloat16"):
        assert_graphed_equals_eager(path, dtype=dtype, quantization="gguf")


# -- the recorder ---------------------------------------------------------------------


def decode_inputs(rows: int, step: int) -> StepInputs:
    """Decode rows that each own two blocks of 16 and sit at position 10 + step."""
    return StepInputs(
        input_ids=np.array([100 + 7 * i + step for i in range(rows)]),
        positions=np.full(rows, 10 + step), slots=np.array([32 * i + 10 + step
                                                            for i in range(rows)]),
        block_tables=np.array([[2 * i, 2 * i + 1] for i in range(rows)], dtype=np.int32),
        seq_lens=np.full(rows, 11 + step), query_start=np.arange(rows + 1),
        sample_rows=np.arange(rows), sample_reqs=np.arange(rows), max_query_len=1,
        request_lengths=None, swap_out=[], swap_in=[])


@pytest.fixture
def runner(llama_dir):
    with LLM(str(llama_dir), dtype="float32", enforce_eager=True, **OPTIONS) as llm:
        yield llm.engine.runner


def test_every_kernel_of_the_library_records():
    # A call site holds what the library gives it: every entry point, declared or not
    # (the attention's `_lse` forms), is a recording Kernel, and no raw ctypes function
    # sits in the library for a call site to reach.
    from fusegen.kernels.paged_attention_cpu import _kernel

    lib = native.library()
    for name in native._SIGNATURES:
        assert isinstance(getattr(lib, name), native.Kernel), name
    assert isinstance(_kernel("paged_decode_f32_lse"), native.Kernel)
    raw = [n for n, v in vars(lib).items() if isinstance(v, ctypes._CFuncPtr)]
    assert raw == []
    calls = []
    x = torch.tensor([[1.0, 5.0, 2.0]])
    out = torch.empty(1, dtype=torch.int64)
    with native.recording(calls):
        lib.argmax_f32(x.data_ptr(), out.data_ptr(), 1, 3, 3, 1)
    assert [(fn.__name__, args[2:]) for fn, args, _ in calls] == [("argmax_f32", (1, 3, 3, 1))]


def test_an_ops_tensors_are_found_as_tree_flatten_finds_them():
    from torch.utils._pytree import tree_flatten

    from fusegen.engine.cpu_graphs import _tensors

    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    nested = ((a, 3, [b, None, {"x": c, "y": (1.5, d)}]), {"out": a}, torch.Size([2]))
    want = [t for t in tree_flatten(nested)[0] if isinstance(t, torch.Tensor)]
    assert [id(t) for t in _tensors(nested)] == [id(t) for t in want] and len(want) == 5


@torch.inference_mode()
def test_a_replay_makes_every_kernel_call_of_the_step(runner):
    # Recorded at one step's inputs, replayed at the next step's: bit for bit what the
    # eager step computes there. A kernel call that escaped the recording (run at
    # recording, missing from the replay) leaves its output stale and fails this.
    graphs = CpuDecodeGraphs(runner, 4, runner.config.max_model_len)
    graphs.small[:, :3] = graphs_module.small_inputs(decode_inputs(3, 0), 3, False)
    graphs.block_tables[:3, :2] = torch.from_numpy(decode_inputs(3, 0).block_tables)
    forward = graphs._forward(3, 11, head=False)
    graph, out = record(forward)
    assert graph.num_calls > 0 and graph.nbytes > 0
    for step in (1, 2):
        inputs = decode_inputs(3, step)
        graphs.small[:, :3] = graphs_module.small_inputs(inputs, 3, False)
        graph.replay()
        x, residual = runner.forward(inputs)
        assert torch.equal(out[0], x) and torch.equal(out[1], residual)
    # the same number of C calls as the eager step makes, no more, no fewer
    calls = []
    with native.recording(calls):
        forward()
    assert len(calls) == graph.num_calls


def test_escaped_call_is_caught(runner, monkeypatch):
    # The check above, shown to fail: the final norm called past the recorder.
    real = native.library().rms_norm_f32
    with torch.inference_mode():
        graphs = CpuDecodeGraphs(runner, 4, runner.config.max_model_len)
        graphs.small[:, :1] = graphs_module.small_inputs(decode_inputs(1, 0), 1, False)
        forward = graphs._forward(1, 11, head=False)
        monkeypatch.setattr(native.library(), "rms_norm_f32", real.fn)  # a raw function
        graph, out = record(forward)
        monkeypatch.setattr(native.library(), "rms_norm_f32", real)
        inputs = decode_inputs(1, 1)
        graphs.small[:, :1] = graphs_module.small_inputs(inputs, 1, False)
        graph.replay()
        x, _ = runner.forward(inputs)
        assert not torch.equal(out[0], x)


def test_work_outside_the_recorder_is_caught_at_the_first_replay(llama_dir, monkeypatch,
                                                                caplog):
    """A step that computes past the recorder (here every RMSNorm, called as the raw
    ctypes function: as a Triton kernel in the interpreter or numpy on a tensor's memory
    would be) records a graph that replays wrong; its first replay is checked against
    the step run eagerly, so the engine goes eager with eager's tokens."""
    want, _, _ = generate(llama_dir, greedy(), True, dtype="float32")
    monkeypatch.setattr(native.library(), "rms_norm_f32", native.library().rms_norm_f32.fn)
    with caplog.at_level(logging.WARNING, logger="fusegen.engine"):
        got, _, graphs = generate(llama_dir, greedy(), False, dtype="float32")
    assert got == want
    assert graphs.failed.startswith("RuntimeError: its outputs differ from the same step")
    assert graphs.replays == 0
    warnings = [r.getMessage() for r in caplog.records if "CPU graph" in r.getMessage()]
    assert len(warnings) == 1 and "runs every step eagerly" in warnings[0]


def test_a_kernel_status_other_than_recorded_leaves_the_engine_eager(llama_dir, caplog):
    want, _, _ = generate(llama_dir, greedy(), True, dtype="float32")
    with LLM(str(llama_dir), dtype="float32", **OPTIONS) as llm:
        graphs = llm.engine.runner.graphs
        llm.generate(PROMPTS[:2], greedy([6, 6]))  # records the 2-row graph
        assert graphs.replays > 0
        for by_head in graphs.graphs.values():
            for graph, _ in by_head.values():
                fn, args, status = graph.steps[-1]  # the head's argmax: None
                graph.steps[-1] = (fn, args, "never")  # a status it cannot return
        with torch.inference_mode(), pytest.raises(ReplayMismatch,
                                                   match="'never' at recording"):
            next(iter(graphs.graphs.values()))[True][0].replay()
        replays = graphs.replays
        with caplog.at_level(logging.WARNING, logger="fusegen.engine"):
            outs = llm.generate(PROMPTS, greedy())
        # rows 7 to 3 record, 3 replays once, then 2's graph fails: eager from then on
        assert graphs.failed.startswith("ReplayMismatch") and graphs.replays == replays + 1
        assert {rows for rows, _ in graphs.graphs} == {7, 6, 5, 4, 3, 2}
    warnings = [r.getMessage() for r in caplog.records if "CPU graph" in r.getMessage()]
    assert len(warnings) == 1 and "runs every step eagerly" in warnings[0]
    assert [o.token_ids for o in outs] == want


def test_a_failed_recording_leaves_the_step_and_engine_eager(llama_dir, monkeypatch,
                                                              caplog):
    want, _, _ = generate(llama_dir, greedy(), True, dtype="float32")

    def refuse(forward):
        forward()  # part of the step ran before the failure: the eager rerun redoes it
        raise RuntimeError("refused")

    monkeypatch.setattr(graphs_module, "record", refuse)
    with caplog.at_level(logging.WARNING, logger="fusegen.engine"):
        got, _, graphs = generate(llama_dir, greedy(), False, dtype="float32")
    assert got == want
    assert graphs.failed == "RuntimeError: refused" and graphs.graphs == {}
    warnings = [r.getMessage() for r in caplog.records if "CPU graph" in r.getMessage()]
    assert len(warnings) == 1 and "runs every step eagerly" in warnings[0]


def test_bad_block_tables_raise_before_a_replay(runner):
    inputs = decode_inputs(2, 0)
    inputs.block_tables[1, 1] = runner.num_blocks  # one past the cache
    with torch.inference_mode():
        with pytest.raises(IndexError) as eager:
            runner.forward(inputs)
        graphs = CpuDecodeGraphs(runner, 4, runner.config.max_model_len)
        with pytest.raises(IndexError) as graphed:
            graphs.run(inputs)
    assert str(graphed.value) == str(eager.value)
    assert f"ids 0..{runner.num_blocks}" in str(eager.value)
    assert graphs.graphs == {} and graphs.failed is None


def test_memory_cap_leaves_new_row_counts_eager(llama_dir, monkeypatch):
    want, _, _ = generate(llama_dir, greedy(), True, dtype="float32")
    _, _, graphs = generate(llama_dir, greedy(), False, dtype="float32")
    sizes = {rows: by_head[True][0].nbytes for (rows, _), by_head in graphs.graphs.items()}
    assert graphs.nbytes == sum(sizes.values()) and graphs.rows == 7
    # room for the graphs of 1..6 rows: the first graph (7 rows, the first decode
    # step's) lowers the rows served to 6 and is dropped; its step is eager
    kept = sum(sizes[rows] for rows in range(1, 7))
    assert rows_within(sizes[7] / 7, kept) == 6
    monkeypatch.setattr(graphs_module, "CPU_GRAPH_BYTES", kept)
    got, _, capped = generate(llama_dir, greedy(), False, dtype="float32")
    assert got == want
    assert {rows for rows, _ in capped.graphs} == set(range(1, 7))
    assert capped.nbytes == kept
    # each graph recorded lowered `rows` to what its bytes per row plan for
    assert capped.rows == min(rows_within(sizes[rows] / rows, kept) for rows in sizes)
    assert capped.replays == graphs.replays  # the 7-row step never replayed a graph
    assert not capped.serves(decode_inputs(7, 0))  # 7 rows: the runner's eager path


@torch.inference_mode()
def test_a_graph_past_the_cap_is_dropped_and_larger_row_counts_run_eagerly(runner,
                                                                           monkeypatch):
    # Both head flags, whose graphs the bytes-per-row plan does not count twice: the
    # cap itself drops the graph that would pass it (the plan set aside here)
    sizes = {}
    for rows, head in ((4, True), (4, False), (3, True)):
        graphs = CpuDecodeGraphs(runner, 7, runner.config.max_model_len)
        graphs.run(decode_inputs(rows, 0), head=head)
        sizes[rows, head] = graphs.nbytes
    monkeypatch.setattr(graphs_module, "rows_within", lambda bytes_per_row, cap: 7)
    cap = sizes[4, True] + sizes[4, False] + sizes[3, True] - 1
    monkeypatch.setattr(graphs_module, "CPU_GRAPH_BYTES", cap)
    graphs = CpuDecodeGraphs(runner, 7, runner.config.max_model_len)
    graphs.run(decode_inputs(4, 0), head=True)
    graphs.run(decode_inputs(4, 0), head=False)
    assert graphs.rows == 7 and graphs.nbytes == sizes[4, True] + sizes[4, False]
    graphs.run(decode_inputs(3, 0), head=True)  # past the cap: dropped
    assert graphs.rows == 2 and graphs.nbytes == sizes[4, True] + sizes[4, False]
    assert set(graphs.graphs) == {(4, 1)} and set(graphs.graphs[4, 1]) == {True, False}
    # 3 rows take the runner's eager path from now on; the 4-row graphs kept replay
    assert not graphs.serves(decode_inputs(3, 0)) and graphs.serves(decode_inputs(2, 0))
    assert graphs.serves(decode_inputs(4, 1))
    graphs.run(decode_inputs(4, 1), head=True)
    assert graphs.replays == 1 and graphs.nbytes <= cap


def test_which_engines_record_cpu_graphs(llama_dir, monkeypatch):
    with LLM(str(llama_dir), dtype="float32", max_num_seqs=20, device="cpu") as llm:
        graphs = llm.engine.runner.graphs
        assert type(graphs) is CpuDecodeGraphs
        # every row count up to CPU_GRAPH_ROWS (16), until the cap says otherwise
        assert CPU_GRAPH_ROWS == 16
        assert graphs.buckets == list(range(1, 17)) and graphs.rows == 16
        assert graphs.serves(decode_inputs(16, 0))
        assert not graphs.serves(decode_inputs(17, 0))  # the runner's eager path
    monkeypatch.setenv("FUSEGEN_KERNELS", "reference")
    with LLM(str(llama_dir), dtype="float32", device="cpu") as llm:
        assert llm.engine.runner.graphs is None  # the torch reference's loops
