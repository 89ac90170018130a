"""The decode graph's body with the head and argmax inside it (engine/graphs.py:
`decode_body`, `greedy_head`), run eagerly on a CPU in place of a replay, token-exact
against the ungraphed engine; and the step's inputs as arrays (engine/step_inputs.py)
against a per-token reference."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fusegen.engine import LLM, SamplingParams
from fusegen.engine.graphs import DecodeGraphs, greedy_head
from fusegen.engine.runner_api import LOGITS_CHUNK
from fusegen.engine.scheduler import ScheduledBatch
from fusegen.engine.step_inputs import SMALL_BATCH, step_inputs
from test_engine_equality import PROMPTS
from test_engine_graphs import BUDGETS, replaying


def generate(model_dir, params, graphed: bool):
    """(token ids per prompt, the graphs' keys with whether each holds the head)."""
    with LLM(str(model_dir), dtype="float32", device="cpu") as llm:
        runner = llm.engine.runner
        if graphed:
            runner.graphs = DecodeGraphs(runner, len(PROMPTS), runner.config.max_model_len)
        outs = llm.generate(PROMPTS, params)
        keys = None if not graphed else {(bucket, head) for (bucket, _), by_head
                                         in runner.graphs.graphs.items() for head in by_head}
        return [o.token_ids for o in outs], keys, runner.graphs


def test_greedy_steps_run_the_head_in_the_graph_token_exact(llama_dir, monkeypatch):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in BUDGETS]
    eager, _, _ = generate(llama_dir, params, graphed=False)
    monkeypatch.setattr(DecodeGraphs, "_capture", replaying)
    graphed, keys, graphs = generate(llama_dir, params, graphed=True)
    assert graphed == eager
    assert keys == {(8, True), (4, True), (2, True), (1, True)} and graphs.replays > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recorded_greedy_head_on_cuda_equals_eager(llama_dir):
    # The real capture: greedy decode steps replay graphs that end in the argmax.
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in BUDGETS]
    with LLM(str(llama_dir), dtype="float32", device="cuda", enforce_eager=True) as llm:
        eager = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(llama_dir), dtype="float32", device="cuda") as llm:
        graphed = [o.token_ids for o in llm.generate(PROMPTS, params)]
        graphs = llm.engine.runner.graphs
        assert graphs.failed is None and graphs.replays > 0
        assert any(True in by_head for by_head in graphs.graphs.values())
    assert graphed == eager


def test_sampled_rows_keep_the_head_outside_the_graph(llama_dir, monkeypatch):
    # The requests of budgets 1, 4 and 7 sample with their own seeds: the steps they are
    # in return (x, residual) from their graphs and sample eagerly; once they are done
    # (the last two requests, greedy) the graphs hold the head again.
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) if i % 2 == 0
              else SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9, top_p=0.8,
                                  top_k=20, seed=100 + i)
              for i, n in enumerate(BUDGETS)]
    eager, _, _ = generate(llama_dir, params, graphed=False)
    monkeypatch.setattr(DecodeGraphs, "_capture", replaying)
    graphed, keys, _ = generate(llama_dir, params, graphed=True)
    assert graphed == eager
    assert keys == {(8, False), (4, False), (2, True), (1, True)}


def test_greedy_head_chunks_rows_as_the_eager_path(llama_dir):
    # More rows than a chunk: the graph's head takes them LOGITS_CHUNK at a time.
    with LLM(str(llama_dir), dtype="float32", device="cpu") as llm:
        model = llm.engine.runner.model
        rows = LOGITS_CHUNK + 37
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, model.cfg.hidden_size, generator=g)
        residual = torch.randn(rows, model.cfg.hidden_size, generator=g)
        tokens = greedy_head(model, x, residual)
        assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
        assert tokens.tolist() == model.logits(x, residual).argmax(-1).tolist()


def reference_inputs(batch, block_size):
    """The step's inputs a token at a time, as plain lists."""
    ids, positions, slots, query_start, rows, reqs = [], [], [], [0], [], []
    for i, (req, n) in enumerate(zip(batch.requests, batch.num_scheduled_tokens)):
        start = req.num_computed_tokens
        for p in range(start, start + n):
            ids.append(req.token_ids[p])
            positions.append(p)
            slots.append(req.block_table[p // block_size] * block_size + p % block_size)
        query_start.append(query_start[-1] + n)
        if start + n == len(req.token_ids):
            rows.append(query_start[-1] - 1)
            reqs.append(i)
    return ids, positions, slots, query_start, rows, reqs


def fake_request(tokens, computed, table):
    return SimpleNamespace(token_ids=tokens, num_computed_tokens=computed, block_table=table,
                           num_tokens=len(tokens))


@pytest.mark.parametrize("decode", [True, False])
def test_step_inputs_as_arrays_equal_a_token_by_token_reference(decode):
    block_size = 4
    requests = [fake_request(list(range(100, 109)), 8, [7, 3, 9]),
                fake_request(list(range(200, 211)), 4 if not decode else 10, [5, 6, 1]),
                fake_request(list(range(300, 302)), 1, [4]),
                fake_request(list(range(400, 414)), 5 if not decode else 13, [2, 8, 10, 11])]
    counts = [1, 1, 1, 1] if decode else [1, 3, 1, 6]  # request 3: a chunk, not its last
    batch = ScheduledBatch(requests, counts)
    inputs = step_inputs(batch, block_size, with_lengths=True)
    ids, positions, slots, query_start, rows, reqs = reference_inputs(batch, block_size)
    assert inputs.input_ids.tolist() == ids and inputs.positions.tolist() == positions
    assert inputs.slots.tolist() == slots and inputs.query_start.tolist() == query_start
    assert inputs.sample_rows.tolist() == rows and inputs.sample_reqs.tolist() == reqs
    assert inputs.block_tables.dtype == np.int32
    assert inputs.block_tables.tolist() == [[7, 3, 9, 0], [5, 6, 1, 0], [4, 0, 0, 0],
                                            [2, 8, 10, 11]]
    assert inputs.seq_lens.tolist() == [r.num_computed_tokens + n
                                        for r, n in zip(requests, counts)]
    assert inputs.request_lengths.tolist() == [9, 11, 2, 14]
    assert inputs.max_query_len == max(counts) and inputs.max_seq_len == max(
        inputs.seq_lens.tolist())
    assert inputs.is_decode == decode
    assert step_inputs(batch, block_size, with_lengths=False).request_lengths is None


@pytest.mark.parametrize("num_reqs", [3, SMALL_BATCH, 40])
@pytest.mark.parametrize("decode", [True, False])
def test_small_and_large_batches_build_the_same_inputs(num_reqs, decode):
    # Below SMALL_BATCH requests the rows come from one Python pass, from it on from
    # numpy; both equal the token-by-token reference, ragged tables and chunks included.
    block_size = 4
    requests, counts = [], []
    for i in range(num_reqs):
        length = 5 + (i * 7) % 23
        computed = length - 1 if decode or i % 3 == 0 else (i * 5) % (length - 1)
        count = 1 if decode else min(length - computed, 1 + i % 4)
        table = [(i * 11 + j * 3) % 97 for j in range(-(-(computed + count) // block_size))]
        requests.append(fake_request(list(range(1000 * i, 1000 * i + length)), computed, table))
        counts.append(count)
    batch = ScheduledBatch(requests, counts)
    inputs = step_inputs(batch, block_size, with_lengths=True)
    ids, positions, slots, query_start, rows, reqs = reference_inputs(batch, block_size)
    assert [inputs.input_ids.tolist(), inputs.positions.tolist(), inputs.slots.tolist(),
            inputs.query_start.tolist(), inputs.sample_rows.tolist(),
            inputs.sample_reqs.tolist()] == [ids, positions, slots, query_start, rows, reqs]
    width = max(len(r.block_table) for r in requests)
    assert inputs.block_tables.tolist() == [r.block_table + [0] * (width - len(r.block_table))
                                            for r in requests]
    assert all(a.dtype == np.int64 for a in (inputs.input_ids, inputs.positions, inputs.slots,
                                             inputs.seq_lens, inputs.query_start))
    assert inputs.request_lengths.tolist() == [len(r.token_ids) for r in requests]
    assert inputs.is_decode == (decode or all(c == 1 for c in counts) and len(reqs) == num_reqs)
