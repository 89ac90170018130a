"""CUDA graphs for decode steps (engine/graphs.py): which steps and engines record
them, how a batch is padded to its bucket, and, on a GPU, tokens equal to transformers'
with the graphs replaying."""
import pytest
import torch

from checkpoints import hf_greedy, make_hf_checkpoint
from fusegen.engine import LLM, EngineConfigError, SamplingParams
from fusegen.engine.graphs import PAD, DecodeGraphs, bucket_for, decode_buckets, small_inputs
from fusegen.engine.model_runner import StepInputs
from test_engine_equality import PROMPTS
from test_models_gemma import gemma2_dir  # noqa: F401 - the fixture
from test_models_phi3 import (ORIGINAL, RECOMPUTES_AT_THE_SWITCH, longrope,  # noqa: F401
                             phi3_dir)  # phi3_dir: the fixture

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Budgets 1..13: the batch shrinks from 7 rows through the buckets 8, 4, 2, 1 as
# requests finish.
BUDGETS = [13, 1, 9, 4, 2, 7, 3]


def budgets(ns=BUDGETS):
    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in ns]


def assert_transformers_tokens(model_dir, tokenizer, prompts, outs, ns=BUDGETS):
    for prompt, out, n in zip(prompts, outs, ns):
        assert out.token_ids == hf_greedy(model_dir, tokenizer.encode(prompt), n), prompt


def decode_inputs(rows: int, lengths=None) -> StepInputs:
    return StepInputs(input_ids=[100 + i for i in range(rows)],
                      positions=[10 + i for i in range(rows)],
                      slots=[64 + i for i in range(rows)],
                      block_tables=[[i, i + 1] for i in range(rows)],
                      seq_lens=[11 + i for i in range(rows)],
                      query_start=list(range(rows + 1)), sample_rows=list(range(rows)),
                      sample_reqs=list(range(rows)), max_query_len=1,
                      request_lengths=lengths, swap_out=[], swap_in=[])


@pytest.mark.parametrize("max_rows, buckets", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 24]), (256, [1, 2, 4] + list(range(8, 257, 8))),
])
def test_buckets_cover_every_batch_size(max_rows, buckets):
    assert decode_buckets(max_rows) == buckets
    for rows in range(1, max_rows + 1):
        bucket = bucket_for(buckets, rows)
        assert bucket >= rows and all(b < rows for b in buckets if b < bucket)


def test_padding_rows_write_no_kv_and_attend_to_one_key():
    host = small_inputs(decode_inputs(3), 8, with_lengths=False)
    assert host.dtype == torch.int64 and host.shape == (5, 8)
    assert host[:, :3].tolist() == [[100, 101, 102], [10, 11, 12], [64, 65, 66],
                                    [11, 12, 13], [1, 1, 1]]
    assert host[:, 3:].tolist() == [[p] * 5 for p in PAD]
    assert PAD[2] == -1 and PAD[3] == 1  # no slot: the cache kernel skips it; one key
    with_lengths = small_inputs(decode_inputs(2, lengths=[40, 7]), 4, with_lengths=True)
    assert with_lengths[4].tolist() == [40, 7, 1, 1]


def test_eager_engines_record_nothing(llama_dir):
    # (CPU engines record CPU graphs otherwise: tests/test_cpu_graphs.py)
    with LLM(str(llama_dir), dtype="float32", device="cpu", enforce_eager=True) as llm:
        assert llm.engine.runner.graphs is None
    with pytest.raises(EngineConfigError, match="enforce_eager must be true or false"):
        LLM(str(llama_dir), enforce_eager="yes")


def test_models_with_host_syncs_or_streamed_layers_are_not_recorded(llama_dir, monkeypatch):
    # The decision, on a CPU engine made to look like a GPU one.
    from fusegen.engine.models.moe import MoeLayer
    from fusegen.engine.model_runner import ModelRunner

    assert MoeLayer.graphable is False
    with LLM(str(llama_dir), dtype="float32", device="cpu") as llm:
        runner = llm.engine.runner
        monkeypatch.setattr(runner, "device", torch.device("cuda"))
        assert ModelRunner._records_decode_steps(runner)
        monkeypatch.setattr(runner.model.layers[1], "graphable", False)
        assert not ModelRunner._records_decode_steps(runner)
        monkeypatch.setattr(runner.model.layers[1], "graphable", True)
        monkeypatch.setattr(runner.model, "streamer", object())
        assert not ModelRunner._records_decode_steps(runner)
        monkeypatch.setattr(runner.model, "streamer", None)
        monkeypatch.setattr(runner.config.options, "deterministic", True)
        assert not ModelRunner._records_decode_steps(runner)


@cuda
@pytest.mark.parametrize("fixture", ["llama_dir", "gemma2_dir", "phi3_dir"])
def test_recorded_decode_steps_equal_transformers(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    with LLM(str(model_dir), dtype="float32", device="cuda") as llm:
        outs = llm.generate(PROMPTS, budgets())
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.replays > 0
        assert {bucket for bucket, _ in graphs.graphs} == {8, 4, 2, 1}
        assert_transformers_tokens(model_dir, llm.tokenizer, PROMPTS, outs)


def replaying(graphs, forward):
    """DecodeGraphs._capture on a CPU: the step runs now, and each replay runs it again
    into the same output tensors, as a graph replays into its own."""
    out = forward()

    class Replay:
        def replay(self):
            for dst, src in zip(out, forward()):
                dst.copy_(src)

    return Replay(), out


def longrope_dir(tmp_path):
    return make_hf_checkpoint(tmp_path, "phi3", "bpe", seed=3, rope_parameters=longrope(1.0),
                              original_max_position_embeddings=ORIGINAL)


@pytest.mark.parametrize("fixture", ["llama_dir", "gemma2_dir",
                                     pytest.param("longrope", marks=RECOMPUTES_AT_THE_SWITCH)])
def test_padded_buckets_equal_transformers(fixture, request, tmp_path, monkeypatch):
    # engine/graphs.py's buffers, padding rows, buckets and cut, on a CPU engine whose
    # "graphs" run each replay eagerly. LongRoPE reads each request's whole length
    # from the buffers too; its prompts cross the switch (recomputed steps run eagerly).
    model_dir = longrope_dir(tmp_path) if fixture == "longrope" else \
        request.getfixturevalue(fixture)
    prompts = PROMPTS if fixture != "longrope" else [PROMPTS[0], PROMPTS[4], PROMPTS[1],
                                                     PROMPTS[3]]
    ns = BUDGETS if fixture != "longrope" else [40, 30, 20, 1]
    monkeypatch.setattr(DecodeGraphs, "_capture", replaying)
    with LLM(str(model_dir), dtype="float32", device="cpu") as llm:
        runner = llm.engine.runner
        runner.graphs = DecodeGraphs(runner, len(prompts), runner.config.max_model_len)
        assert runner.graphs.with_lengths == (fixture == "longrope")
        outs = llm.generate(prompts, budgets(ns))
        assert runner.graphs.replays > 0
        used = {bucket for bucket, _ in runner.graphs.graphs}
        assert used == ({8, 4, 2, 1} if fixture != "longrope" else {4, 2, 1})
        assert_transformers_tokens(model_dir, llm.tokenizer, prompts, outs, ns)


@cuda
def test_eager_and_recorded_steps_give_the_same_tokens(llama_dir):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(str(llama_dir), dtype="float32", device="cuda", enforce_eager=True) as llm:
        assert llm.engine.runner.graphs is None
        eager = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(llama_dir), dtype="float32", device="cuda") as llm:
        recorded = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.engine.runner.graphs.replays > 0
    assert recorded == eager


def test_a_failed_recording_leaves_the_engine_eager(llama_dir, monkeypatch, caplog):
    # The step whose recording fails keeps its eager result; every later step runs
    # eagerly; one warning says why; the tokens are transformers'.
    def refuse(graphs, forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "_capture", refuse)
    with LLM(str(llama_dir), dtype="float32", device="cpu") as llm:
        runner = llm.engine.runner
        runner.graphs = DecodeGraphs(runner, len(PROMPTS), runner.config.max_model_len)
        with caplog.at_level("WARNING", logger="fusegen.engine"):
            outs = llm.generate(PROMPTS, budgets())
        assert runner.graphs.failed == "RuntimeError: operation not permitted when stream " \
                                       "is capturing"
        assert runner.graphs.graphs == {} and runner.graphs.replays == 0
        assert_transformers_tokens(llama_dir, llm.tokenizer, PROMPTS, outs)
    warnings = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert len(warnings) == 1 and "runs every step eagerly" in warnings[0]
