"""OpenAI Batch API request files: body fields -> SamplingParams, errors naming the
custom_id and field, the batch output format token-exact against the engine alone, and
exactly-once results across an interrupted run."""
import dataclasses
import json
import os
from types import SimpleNamespace

from fusegen.engine import LLM, SamplingParams
from fusegen.jobs.openai_batch import (BODY_FIELDS, chat_logprobs, completion_logprobs,
                                       parse_request)
from fusegen.jobs.rows import row_seed
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import fake_engine, tiny_model_dir  # noqa: F401

BASE = SamplingParams(max_tokens=64, seed=0)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _line(custom_id, url="/v1/chat/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _chat(messages):
    return f"<{messages[-1]['content']}>"


def test_body_fields_map_onto_sampling_params():
    req = parse_request(_line(
        "a", model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=5, temperature=0, top_p=0.5, seed=7, stop="x", n=2, top_k=3,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
        user="u1"), 1, BASE, 0, _chat)
    assert req.error is None and req.custom_id == "a" and req.prompt == "<hi>"
    assert req.params == dataclasses.replace(BASE, max_tokens=5, temperature=0.0, top_p=0.5,
                                             seed=7, stop=["x"], n=2, top_k=3,
                                             json_schema=SCHEMA)
    req = parse_request(_line("b", "/v1/completions", prompt=[5, 6, 7], max_tokens=2), 4,
                        BASE, 12)
    assert req.prompt == [5, 6, 7] and req.url == "/v1/completions"
    assert req.params == dataclasses.replace(BASE, max_tokens=2, seed=row_seed(0, 12))


def test_malformed_lines_and_unsupported_fields_name_the_line_and_field():
    def error(text, line=3):
        return parse_request(text, line, BASE, 0, _chat).error

    assert error('{"custom_id": "a", ') == {"code": "invalid_request", "message":
        "line 3 (custom_id 'a'): is not JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 20 (char 19))"}
    assert error(json.dumps({"url": "/v1/completions", "body": {}})) == {
        "code": "invalid_request",
        "message": "line 3: has no string custom_id; give every request a unique custom_id"}
    assert error(_line("a", "/v1/embeddings", input="x"))["message"] == (
        "line 3 (custom_id 'a'): url must be /v1/chat/completions or /v1/completions, got "
        "'/v1/embeddings'")
    assert error(_line("d", messages=[{"role": "user", "content": "x"}], tools=[{"t": 1}])) \
        == {"code": "unsupported_field", "message": "line 3 (custom_id 'd'): body.tools="
            "[{\"t\": 1}] is not supported by fusegen's batch runner; drop it"}
    assert error(_line("e", "/v1/completions", prompt="x", foo=1)) == {
        "code": "unsupported_field", "message": "line 3 (custom_id 'e'): body.foo is not a "
        f"field fusegen supports; drop it (supported: {', '.join(BODY_FIELDS)})"}
    assert error(_line("f", messages=[])) == {"code": "invalid_request", "message":
        "line 3 (custom_id 'f'): body.messages must be a non-empty list of {role: string, "
        "content: string} messages; got an empty list"}
    assert error(_line("g", "/v1/completions", prompt="x", max_tokens=0))["message"].startswith(
        "line 3 (custom_id 'g'): body: max_tokens")
    assert error(_line("h", "/v1/completions", prompt="x", max_tokens=2,
                       max_completion_tokens=3))["message"] == (
        "line 3 (custom_id 'h'): body.max_tokens and body.max_completion_tokens differ; "
        "give one")
    # A body field is mapped onto its SamplingParams field.
    req = parse_request(_line("i", messages=[{"role": "user", "content": "x"}],
                              presence_penalty=0.5), 3, BASE, 0, _chat)
    assert req.error is None and req.params.presence_penalty == 0.5


def test_logprobs_in_openai_shapes():
    lp = lambda v, r, t: SimpleNamespace(logprob=v, rank=r, decoded_token=t)  # noqa: E731
    positions = [{7: lp(-0.1, 1, "a"), 8: lp(-2.0, 2, "é")},
                 {9: lp(-3.0, 3, "b"), 4: lp(-0.5, 1, "c"), 5: lp(-1.0, 2, "d")}]
    text_of = lambda t, p: p.decoded_token  # noqa: E731
    assert chat_logprobs([7, 9], positions, 2, text_of) == {"refusal": None, "content": [
        {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
            {"token": "a", "logprob": -0.1, "bytes": [97]},
            {"token": "é", "logprob": -2.0, "bytes": [195, 169]}]},
        {"token": "b", "logprob": -3.0, "bytes": [98], "top_logprobs": [
            {"token": "c", "logprob": -0.5, "bytes": [99]},
            {"token": "d", "logprob": -1.0, "bytes": [100]}]}]}
    assert completion_logprobs([7, 9], positions, 1, text_of) == {
        "tokens": ["a", "b"], "token_logprobs": [-0.1, -3.0],
        "top_logprobs": [{"a": -0.1}, {"c": -0.5}], "text_offset": [0, 1]}


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_file_round_trip_matches_the_engine_alone(tmp_path):
    chat_messages = [{"role": "user", "content": "hello there"}]
    lines = [_line("a", model="gpt-4o-mini", messages=chat_messages, max_tokens=4,
                   temperature=0),
             _line("b", "/v1/completions", prompt="the quick brown fox", max_tokens=5,
                   temperature=0, n=2),
             '{"custom_id": "c", "body": ',
             _line("d", "/v1/completions", prompt="x", logit_bias={"5": 1}, suffix="!"),
             _line("e", messages=chat_messages, max_completion_tokens=3, temperature=0)]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    run_job(JobSpec(model=tiny_model_dir(), input=str(tmp_path / "requests.jsonl"),
                    output=str(tmp_path / "results"), partition_rows=2, progress="none",
                    output_token_ids=True, max_error_rate=1.0))  # error lines on purpose
    results = tmp_path / "results"
    out, errors = _read(results / "output.jsonl"), _read(results / "errors.jsonl")
    assert [o["custom_id"] for o in out] == ["a", "b", "e"]
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
        ("c", None, "invalid_request"), ("d", None, "unsupported_field")]
    assert errors[1]["error"]["message"] == ("line 4 (custom_id 'd'): body.suffix=\"!\" is "
                                             "not supported by fusegen's batch runner; drop it")
    with LLM(tiny_model_dir()) as llm:
        chat_ids = llm.tokenizer.encode_chat(chat_messages, add_generation_prompt=True)
        expected = llm.generate([chat_ids, "the quick brown fox", chat_ids], [
            SamplingParams(max_tokens=4, temperature=0),
            SamplingParams(max_tokens=5, temperature=0, n=2),
            SamplingParams(max_tokens=3, temperature=0)], use_tqdm=False)
        for o, e in zip(out, expected):
            body = o["response"]["body"]
            assert o["response"]["status_code"] == 200 and o["error"] is None
            chat = body["object"] == "chat.completion"
            texts = [c["message"]["content"] if chat else c["text"] for c in body["choices"]]
            assert texts == [c.text for c in e.outputs]
            assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in e.outputs]
            assert [c["index"] for c in body["choices"]] == list(range(len(e.outputs)))
            assert [c["finish_reason"] for c in body["choices"]] == ["length"] * len(e.outputs)
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert body["usage"] == {
                "prompt_tokens": e.num_prompt_tokens,
                "completion_tokens": e.num_generated_tokens,
                "total_tokens": e.num_prompt_tokens + e.num_generated_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}
            assert 0 <= cached < e.num_prompt_tokens
    assert [o["response"]["body"]["object"] for o in out] == [
        "chat.completion", "text_completion", "chat.completion"]
    assert [o["response"]["body"]["id"].split("-")[0] for o in out] == [
        "chatcmpl", "cmpl", "chatcmpl"]
    assert {o["response"]["body"]["model"] for o in out} == {os.path.basename(tiny_model_dir())}
    assert out[1]["response"]["body"]["usage"]["completion_tokens"] == 10


def test_interrupted_batch_rerun_writes_each_custom_id_once(fake_engine, tmp_path):
    lines = ["not json"] + [_line(f"r{i}", "/v1/completions", prompt=f"p{i}", max_tokens=2)
                            for i in range(7)]
    lines.append(_line("long", "/v1/completions", prompt="z" * 70))  # the engine refuses it
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    spec = JobSpec(model=fake_engine, input=str(tmp_path / "requests.jsonl"),
                   output=str(tmp_path / "results"), partition_rows=3, progress="none")
    run_job(spec)
    results = tmp_path / "results"
    first = _read(results / "output.jsonl")
    assert [o["custom_id"] for o in first] == [f"r{i}" for i in range(7)]
    assert sorted(os.listdir(results / "_parts")) == sorted(
        [f"part-0000{i}{s}" for i in range(3) for s in (".jsonl", ".errors.jsonl",
                                                          ".jsonl.json")])
    # Killed as part 1 committed (its files moved, its record not), before the merge.
    (results / "_parts" / "part-00001.jsonl.json").unlink()
    (results / "output.jsonl").unlink()
    manifest = json.loads((results / "_manifest.json").read_text())
    manifest["status"] = "interrupted"
    (results / "_manifest.json").write_text(json.dumps(manifest))
    run_job(spec)
    again = _read(results / "output.jsonl")
    assert [o["custom_id"] for o in again] == [f"r{i}" for i in range(7)]
    assert [o["id"] for o in again] == [o["id"] for o in first]
    assert [(e["custom_id"], e["error"]["message"]) for e in _read(results / "errors.jsonl")] \
        == [(None, "line 1: is not JSON (Expecting value: line 1 column 1 (char 0))"),
            ("long", "line 9 (custom_id 'long'): 71 tokens > max_model_len 64")]
    manifest = json.loads((results / "_manifest.json").read_text())
    assert (manifest["runs"][-1]["parts_computed"], manifest["runs"][-1]["parts_skipped"]) \
        == (1, 2)
    assert manifest["totals"]["num_rows"] == 9 and manifest["totals"]["num_errors"] == 2
    assert manifest["totals"]["errors_by_code"] == {"invalid_request": 1, "prompt_too_long": 1}
