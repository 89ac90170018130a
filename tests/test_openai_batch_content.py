"""OpenAI batch files as OpenAI's API takes them: message content as a list of text parts
(joined with newlines; a part of another type is the line's `unsupported_content`
error), vLLM's detokenizer fields in the body, `usage.prompt_tokens_details.cached_tokens`
from the prefix cache, and `--output x.jsonl` refused with where the results go."""
import json

from click.testing import CliRunner

from fusegen.engine import LLM, SamplingParams
from fusegen.jobs.cli import main
from fusegen.jobs.driver import run_job
from fusegen.jobs.openai_batch import BODY_FIELDS, parse_request
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import fake_engine, tiny_model_dir, write_prompts  # noqa: F401

BASE = SamplingParams(max_tokens=64, seed=0)


def _line(custom_id, url="/v1/chat/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _chat(messages):
    return " | ".join(f"{m['role']}: {m['content']}" for m in messages)


def _text(*texts):
    return [{"type": "text", "text": t} for t in texts]


def test_content_given_as_text_parts_is_joined_with_newlines():
    req = parse_request(_line("a", messages=[
        {"role": "system", "content": _text("Be brief.")},
        {"role": "user", "content": _text("first", "second")},
        {"role": "assistant", "content": "plain"}]), 1, BASE, 0, _chat)
    assert req.error is None
    assert req.prompt == "system: Be brief. | user: first\nsecond | assistant: plain"


def test_a_part_that_is_not_text_is_the_lines_coded_error():
    def error(content):
        return parse_request(_line("a", messages=[{"role": "user", "content": content}]), 2,
                             BASE, 0, _chat).error

    image = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}
    assert error([*_text("what is this?"), image]) == {
        "code": "unsupported_content", "message": "line 2 (custom_id 'a'): "
        "body.messages[0].content[1] is a \"image_url\" part; fusegen runs text models: "
        "send text parts ({\"type\": \"text\", \"text\": ...}) or the content as a string"}
    assert error([{"type": "input_audio", "input_audio": {}}])["code"] == "unsupported_content"
    assert error([{"text": "no type"}]) == {
        "code": "invalid_request", "message": "line 2 (custom_id 'a'): "
        "body.messages[0].content[0] must be a part such as {\"type\": \"text\", \"text\": "
        "\"...\"}, got {\"text\": \"no type\"}"}
    assert error([{"type": "text", "text": 5}])["code"] == "invalid_request"
    assert error(["bare string"])["code"] == "invalid_request"


def test_vllm_detokenizer_fields_in_the_body():
    assert BODY_FIELDS["skip_special_tokens"] == "skip_special_tokens"
    assert BODY_FIELDS["include_stop_str_in_output"] == "include_stop_str_in_output"
    req = parse_request(_line("a", messages=[{"role": "user", "content": "x"}],
                              skip_special_tokens=False, include_stop_str_in_output=True,
                              spaces_between_special_tokens=False), 1, BASE, 0, _chat)
    assert req.error is None
    assert (req.params.skip_special_tokens, req.params.include_stop_str_in_output) == \
        (False, True)


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_parts_and_cached_tokens_end_to_end(tmp_path):
    shared = "Answer the question about the text below in one word. " * 4
    lines = [_line("parts", messages=[{"role": "user", "content": _text(shared, "Why?")}],
                   max_tokens=3, temperature=0),
             _line("again", messages=[{"role": "user", "content": shared + "\nHow?"}],
                   max_tokens=3, temperature=0),
             _line("image", messages=[{"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": "x"}}]}])]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    # one row a partition: the second request finds the first's blocks in the cache
    run_job(JobSpec(model=tiny_model_dir(), input=str(tmp_path / "requests.jsonl"),
                    output=str(tmp_path / "results"), partition_rows=1, progress="none",
                    output_token_ids=True))
    out = _read(tmp_path / "results" / "output.jsonl")
    errors = _read(tmp_path / "results" / "errors.jsonl")
    assert [o["custom_id"] for o in out] == ["parts", "again"]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == \
        [("image", "unsupported_content")]
    with LLM(tiny_model_dir()) as llm:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": shared + "\nWhy?"}])
        (want,) = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0),
                               use_tqdm=False)
        block_size = llm.config.options.block_size
    body = out[0]["response"]["body"]
    assert body["choices"][0]["token_ids"] == want.token_ids  # "a\nb" as the parts' text
    usage = [o["response"]["body"]["usage"] for o in out]
    assert usage[0]["prompt_tokens"] == len(ids)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    # whichever partition ran second found the shared prefix's full blocks cached
    assert max(cached) > 0 and min(cached) == 0
    assert all(c % block_size == 0 and c < u["prompt_tokens"] for c, u in zip(cached, usage))


def test_usage_carries_the_outputs_cached_tokens():
    from fusegen.engine.outputs import CompletionOutput, RequestOutput
    from fusegen.jobs.openai_batch import BatchRequest, response_line

    out = RequestOutput(7, None, list(range(40)), [CompletionOutput(0, "hi", [5, 6], "stop")],
                        num_cached_tokens=32)
    line = response_line(BatchRequest(1, "a", prompt="x", params=BASE), out, "m", 0,
                         lambda t, lp: str(t), "f" * 16)
    assert line["response"]["body"]["usage"] == {
        "prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32}}


def test_output_named_like_a_jsonl_file_is_refused_with_where_results_go(fake_engine,
                                                                          tmp_path):
    write_prompts(tmp_path / "in.parquet", 2)
    target = tmp_path / "results.jsonl"
    res = CliRunner().invoke(main, ["run", "--model", fake_engine, "--input",
                                    str(tmp_path / "in.parquet"), "--output", str(target)])
    assert res.exit_code == 1 and not target.exists()
    assert res.output == (
        f"Error: --output {target} names a file, but a job's output is a directory: its "
        "parts and _manifest.json, from which a rerun resumes, and for an OpenAI batch file "
        f"output.jsonl and errors.jsonl; pass a directory, --output {tmp_path / 'results'}, "
        f"and read {tmp_path / 'results'}/output.jsonl\n")
    target.mkdir()  # a directory of that name (an earlier job's output) is still one
    res = CliRunner().invoke(main, ["run", "--model", fake_engine, "--input",
                                    str(tmp_path / "in.parquet"), "--output", str(target),
                                    "--progress", "none"])
    assert res.exit_code == 0, res.output
    assert (target / "_manifest.json").is_file()


def test_vllm_guided_body_fields_constrain_the_line():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    base = SamplingParams(max_tokens=8, regex="[0-9]+")  # the job's constraint

    def params(**body):
        req = parse_request(_line("a", messages=[{"role": "user", "content": "x"}], **body),
                            1, base, 0, _chat)
        return req.error or {k: getattr(req.params, k) for k in
                             ("json_schema", "regex", "choice", "grammar")}

    none = dict.fromkeys(("json_schema", "regex", "choice", "grammar"))
    assert params(guided_json=schema) == {**none, "json_schema": schema}
    assert params(guided_json=json.dumps(schema)) == {**none, "json_schema": schema}
    assert params(guided_choice=["yes", "no"]) == {**none, "choice": ["yes", "no"]}
    assert params(guided_regex="[a-z]+") == {**none, "regex": "[a-z]+"}
    assert params(guided_grammar='start: "x"') == {**none, "grammar": 'start: "x"'}
    assert params() == {**none, "regex": "[0-9]+"}  # the job's
    assert params(guided_regex="a", guided_choice=["b"]) == {
        "code": "invalid_request", "message": "line 1 (custom_id 'a'): body.guided_regex and "
        "body.guided_choice both constrain the output; give one"}
