"""Jobs over the real engine and the tiny random checkpoint: token-exact against the
engine alone, the batch staying full across partitions, chat templates."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusegen.engine import LLM, SamplingParams
from fusegen.jobs.errors import JobError
from fusegen.jobs.rows import row_seed
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import read_output, tiny_model_dir


def _spec(inp, out, **kw):
    kw = {"model": tiny_model_dir(), "max_tokens": 6, "partition_rows": 8, "max_num_seqs": 8,
          "progress": "none", **kw}
    return JobSpec(input=str(inp), output=str(out), **kw)


def test_job_matches_engine_alone_token_for_token(tmp_path):
    prompts = [("the quick brown fox " * (i % 5 + 1)) + str(i) for i in range(30)]
    max_tokens = [None if i % 3 else 2 + i % 4 for i in range(30)]
    pq.write_table(pa.table({"prompt": prompts, "max_tokens": max_tokens}),
                   tmp_path / "in.parquet", row_group_size=7)
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "out", temperature=0.8, seed=3,
                  top_k=50, output_token_ids=True))
    out = read_output(tmp_path / "out")
    params = [SamplingParams(max_tokens=m or 6, temperature=0.8, top_k=50,
                             seed=row_seed(3, i)) for i, m in enumerate(max_tokens)]
    with LLM(tiny_model_dir(), max_num_seqs=8) as llm:
        expected = llm.generate(prompts, params)
    assert out.column("generated_token_ids").to_pylist() == [e.token_ids for e in expected]
    assert out.column("generated_text").to_pylist() == [e.text for e in expected]
    assert out.column("num_prompt_tokens").to_pylist() == [e.num_prompt_tokens for e in expected]
    assert out.column("finish_reason").to_pylist() == [e.finish_reason for e in expected]


def _mean_running(out_dir) -> float:
    manifest = json.loads((out_dir / "_manifest.json").read_text())
    (stats,) = manifest["runs"][-1]["engine_stats"]
    return stats["mean_running"] / stats["max_num_seqs"]


def test_batch_stays_full_across_partition_boundaries(tmp_path):
    # 8-row partitions and an 8-sequence engine: one partition alone would drain the
    # batch at its tail; four in flight keep it full until the job's own tail.
    # Lengths vary within each partition (max_tokens 2..16), so a lone partition drains.
    pq.write_table(pa.table({"prompt": [f"row {i} " + "word " * (i % 7) for i in range(160)],
                             "max_tokens": [2 + (i * 5) % 15 for i in range(160)]}),
                   tmp_path / "in.parquet")
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "fused", partitions_per_worker=4))
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "serial", partitions_per_worker=1))
    fused, serial = _mean_running(tmp_path / "fused"), _mean_running(tmp_path / "serial")
    print(f"mean running / max_num_seqs: fused {fused:.3f}, serial {serial:.3f}")
    assert fused >= 0.9, fused
    assert serial < fused - 0.1, (serial, fused)


def test_chat_template_over_messages_and_over_prompt(tmp_path):
    msgs = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            [{"role": "user", "content": "hello there"}]]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "m.parquet")
    pq.write_table(pa.table({"prompt": ["hello there"]}), tmp_path / "p.parquet")
    run_job(_spec(tmp_path / "m.parquet", tmp_path / "m", chat=True, temperature=0))
    run_job(_spec(tmp_path / "p.parquet", tmp_path / "p", chat=True, temperature=0))
    with LLM(tiny_model_dir()) as llm:
        tok = llm.tokenizer
        ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in msgs]
        expected = llm.generate(ids, SamplingParams(max_tokens=6, temperature=0))
    m, p = read_output(tmp_path / "m").to_pylist(), read_output(tmp_path / "p").to_pylist()
    assert [r["num_prompt_tokens"] for r in m] == [len(i) for i in ids]
    assert [r["generated_text"] for r in m] == [e.text for e in expected]
    assert p[0]["generated_text"] == m[1]["generated_text"]


def test_prompt_longer_than_context_is_an_error_row(tmp_path):
    pq.write_table(pa.table({"prompt": ["short", "long " * 100]}), tmp_path / "in.parquet")
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "out", max_model_len=64))
    rows = read_output(tmp_path / "out").to_pylist()
    assert rows[0]["error"] is None and rows[0]["num_generated_tokens"] > 0
    assert rows[1]["finish_reason"] == "error"
    assert rows[1]["error"].startswith("prompt_too_long: ")


def test_model_that_does_not_load_fails_before_generation(tmp_path):
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "in.parquet")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    spec = _spec(tmp_path / "in.parquet", tmp_path / "out")
    spec.model = str(broken)
    with pytest.raises(JobError, match=r"loading the model: ModelLoadError: .*config.json: "
                                       r"not valid JSON"):
        run_job(spec)
    assert not list((tmp_path / "out").glob("part-*"))
    spec.model = tiny_model_dir()  # fixed: the same output starts afresh, no --overwrite
    assert run_job(spec).num_rows == 1


def test_device_memory_budget_end_to_end(tmp_path):
    # A device budget too small for every layer: the job streams layers from disk,
    # prints the memory plan, records the memory report, and writes the same tokens.
    import io

    from checkpoints import make_hf_checkpoint
    from fusegen.engine.memory.placement import budget_for_resident_layers

    model = make_hf_checkpoint(tmp_path / "model", "llama", "bpe", num_hidden_layers=6)
    prompts = [f"row {i} " + "word " * (i % 6) for i in range(12)]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")
    with LLM(str(model), max_num_seqs=8, dtype="float32") as llm:
        sizes = llm.placement.sizes
    budget = budget_for_resident_layers(sizes, 1)
    stream = io.StringIO()
    stream.isatty = lambda: True  # the bar mode prints the plan on the stream
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "offload", temperature=0.0,
                  dtype="float32", device_memory=budget, host_memory=0, progress="bar",
                  output_token_ids=True, model=str(model)), progress_stream=stream)
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "plain", temperature=0.0,
                  dtype="float32", output_token_ids=True, model=str(model)))
    tokens = read_output(tmp_path / "offload").column("generated_token_ids").to_pylist()
    assert tokens == read_output(tmp_path / "plain").column("generated_token_ids").to_pylist()
    assert "memory plan (per worker)" in stream.getvalue()
    assert "1 layers + embed/head" in stream.getvalue()
    manifest = json.loads((tmp_path / "offload" / "_manifest.json").read_text())
    (stats,) = manifest["runs"][-1]["engine_stats"]
    assert stats["memory"]["layers"] == {"device": 1, "host": 0, "disk": sizes.num_layers - 1}
    assert stats["memory"]["device"]["peak"] <= budget
    assert manifest["config"]["device_memory"] == budget


def test_bad_memory_budget_fails_before_loading(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="device_memory: cannot read '12 potatoes'"):
        _spec(tmp_path / "in.parquet", tmp_path / "out", device_memory="12 potatoes")
