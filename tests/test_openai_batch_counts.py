"""An OpenAI batch job counts what went wrong in the lines it served, as a Parquet job
counts its rows: lines cut at their length limit and lines whose structured output is
invalid, per part (its record under _parts/), in the manifest's totals and the summary."""
import json

from fusegen.engine import LLM, SamplingParams
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import tiny_model_dir

PROMPT = "the quick brown fox"
CHOICE = ["positive", "negative"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _line(custom_id, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": PROMPT, "temperature": 0, **body}})


# custom_id -> (body, cut at the length limit, invalid structured output)
LINES = {
    "choice": ({"guided_choice": CHOICE, "max_tokens": 16}, False, False),
    "choice-cut": ({"guided_choice": CHOICE, "max_tokens": 1}, True, True),
    "plain-cut": ({"max_tokens": 3}, True, False),
    "json-cut": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA}}, "max_tokens": 4}, True, True),
    "two-cut": ({"guided_choice": CHOICE, "max_tokens": 2, "n": 2}, True, True),  # once
}


def test_batch_parts_count_cut_and_invalid_lines(tmp_path):
    # What the engine alone makes of each line: the counts below are not the job's guess.
    with LLM(tiny_model_dir()) as llm:
        outs = llm.generate([PROMPT] * 5, [
            SamplingParams(max_tokens=16, temperature=0, choice=CHOICE),
            SamplingParams(max_tokens=1, temperature=0, choice=CHOICE),
            SamplingParams(max_tokens=3, temperature=0),
            SamplingParams(max_tokens=4, temperature=0, json_schema=SCHEMA),
            SamplingParams(max_tokens=2, temperature=0, choice=CHOICE, n=2)], use_tqdm=False)
    assert [[(c.finish_reason, c.structured_valid) for c in o.outputs] for o in outs] == [
        [("stop", True)], [("length", False)], [("length", None)], [("length", False)],
        [("length", False), ("length", False)]]
    lines = [_line(cid, **body) for cid, (body, _, _) in LINES.items()]
    lines.insert(2, "not json")  # an error line: counted as an error, not as cut
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    result = run_job(JobSpec(model=tiny_model_dir(), input=str(tmp_path / "requests.jsonl"),
                             output=str(tmp_path / "results"), partition_rows=2,
                             progress="none", max_error_rate=1.0))
    results = tmp_path / "results"
    served = [json.loads(x)["custom_id"] for x in (results / "output.jsonl").open()]
    assert served == list(LINES)
    # Parts of two lines: [choice, choice-cut], [not json, plain-cut], [json-cut, two-cut].
    parts = [json.loads((results / "_parts" / f"part-0000{i}.jsonl.json").read_text())["stats"]
             for i in range(3)]
    assert [(p["num_rows"], p["num_errors"], p["num_truncated"], p["num_structured_invalid"])
            for p in parts] == [(2, 0, 1, 1), (2, 1, 1, 0), (2, 0, 2, 2)]
    totals = json.loads((results / "_manifest.json").read_text())["totals"]
    assert (totals["num_rows"], totals["num_errors"], totals["num_truncated"],
            totals["num_structured_invalid"]) == (6, 1, 4, 3)
    assert (result.num_truncated, result.num_structured_invalid) == (4, 3)
    assert "rows: 6, errors: 1 (invalid_request 1), cut at the length limit: 4, invalid " \
        "structured output: 3" in result.summary()
