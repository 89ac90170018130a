"""Sampling options of a job over the real engine and the tiny random checkpoint: the
per-row columns' requests equal the engine's own, token for token; n rows per input row;
a constrained row's structured_valid; the engine's load for the progress line."""
import pyarrow as pa
import pyarrow.parquet as pq

from fusegen.engine import LLM, SamplingParams
from fusegen.jobs.rows import row_seed
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import read_output, tiny_model_dir


def test_option_columns_match_the_engine_alone(tmp_path):
    prompts = ["the quick brown fox", "jumps over", "the lazy dog", "again and again"]
    table = pa.table({"prompt": prompts, "n": [2, None, 1, 3],
                      "choice": [None, '["yes", "no"]', None, None],
                      "min_p": [None, None, 0.05, None],
                      "stop_token_ids": [None, None, None, [7]]})
    pq.write_table(table, tmp_path / "in.parquet")
    run_job(JobSpec(model=tiny_model_dir(), input=str(tmp_path / "in.parquet"),
                    output=str(tmp_path / "out"), max_tokens=5, temperature=0.9, seed=4,
                    progress="none", output_token_ids=True))
    out = read_output(tmp_path / "out")
    common = {"max_tokens": 5, "temperature": 0.9}
    params = [SamplingParams(n=2, seed=row_seed(4, 0), **common),
              SamplingParams(choice=["yes", "no"], seed=row_seed(4, 1), **common),
              SamplingParams(min_p=0.05, seed=row_seed(4, 2), **common),
              SamplingParams(n=3, stop_token_ids=[7], seed=row_seed(4, 3), **common)]
    with LLM(tiny_model_dir()) as llm:
        expected = llm.generate(prompts, params)
        generated = sum(len(c.token_ids) for e in expected for c in e.outputs)
        assert llm.engine_load() == {"running": 0, "waiting": 0, "kv_used": 0.0,
                                     "num_generated_tokens": generated}
    completions = [(i, c) for i, e in enumerate(expected) for c in e.outputs]
    assert out.column("row_id").to_pylist() == [i for i, _ in completions] == [0, 0, 1, 2, 3, 3, 3]
    assert out.column("completion_index").to_pylist() == [c.index for _, c in completions]
    assert out.column("generated_token_ids").to_pylist() == [c.token_ids for _, c in completions]
    assert out.column("generated_text").to_pylist() == [c.text for _, c in completions]
    valid = out.column("structured_valid").to_pylist()
    assert valid == [c.structured_valid for _, c in completions]
    assert [v is None for v in valid] == [True, True, False, True, True, True, True]


def test_jsonl_parts_carry_openai_logprobs(tmp_path):
    # --output-format jsonl: each completion's logprobs in OpenAI's chat shape, with the
    # row's own number of alternatives (a per-row `logprobs` column beside the job's 2).
    # fp32 on every CPU: the two runs batch rows their own ways, and in bf16 (the "auto"
    # of CPUs with bf16 units) that moves logprobs by more than float rounding.
    import json

    prompts = ["the quick brown fox", "jumps over", "the lazy dog"]
    table = pa.table({"prompt": prompts, "logprobs": [None, 0, 3]})
    pq.write_table(table, tmp_path / "in.parquet")
    run_job(JobSpec(model=tiny_model_dir(), input=str(tmp_path / "in.parquet"),
                    output=str(tmp_path / "out"), max_tokens=4, temperature=0.0, logprobs=2,
                    progress="none", output_format="jsonl", dtype="float32"))
    rows = [json.loads(line) for part in sorted((tmp_path / "out").glob("part-*.jsonl"))
            for line in part.read_text().splitlines()]
    params = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=k) for k in (2, 0, 3)]
    with LLM(tiny_model_dir(), dtype="float32") as llm:
        expected = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [r["generated_text"] for r in rows] == [c.text for c in expected]
    for row, c, k in zip(rows, expected, (2, 0, 3)):
        content = row["logprobs"]["content"]
        assert row["logprobs"]["refusal"] is None and len(content) == len(c.token_ids) == 4
        # the job batches rows its own way: logprobs agree to float rounding
        for entry, token_id, position in zip(content, c.token_ids, c.logprobs):
            chosen = position[token_id]
            assert entry["token"] == chosen.decoded_token
            assert abs(entry["logprob"] - chosen.logprob) < 1e-4
            assert entry["bytes"] == list(chosen.decoded_token.encode("utf-8"))
            top = sorted((lp for lp in position.values() if lp.rank <= k), key=lambda lp: lp.rank)
            assert [t["token"] for t in entry["top_logprobs"]] == [lp.decoded_token for lp in top]
            assert all(abs(t["logprob"] - lp.logprob) < 1e-4
                       for t, lp in zip(entry["top_logprobs"], top))
            assert len(entry["top_logprobs"]) == k
