"""Issue 28, OpenAI batch files: a line that is no request (nested too deep, a lone
surrogate, bytes that are not UTF-8, a custom_id other lines share, a conversation too
large to render) is that line's error line, and the job completes."""
import json

from fusegen.engine import SamplingParams
from fusegen.engine.tokenizer import PromptLimit
from fusegen.jobs.openai_batch import _check_line, parse_request
from fusegen.jobs.params import MAX_DEPTH
from fusegen.jobs.plan import plan_partitions
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from fusegen.jobs.storage import list_input_files
from jobs_fixtures import fake_engine, tiny_model_dir  # noqa: F401

DEEP = (f"is nested more than {MAX_DEPTH} levels deep (lists and objects); fusegen reads "
        f"at most {MAX_DEPTH}: flatten it")
SURROGATE = "which is not valid Unicode (UTF-8 cannot hold it); remove it"
DUPLICATE = ("a result is matched to its request by custom_id, so none of them is served: "
             "give each request its own")


def _line(custom_id, url="/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(tmp_path, data: bytes | dict[str, bytes], model: str,
         **spec) -> tuple[list[dict], list[dict]]:
    """A job over one request file (`data`), or a folder of them ({name: data})."""
    tmp_path.mkdir(exist_ok=True)
    if isinstance(data, bytes):
        (tmp_path / "requests.jsonl").write_bytes(data)
        inp = tmp_path / "requests.jsonl"
    else:
        (inp := tmp_path / "requests").mkdir()
        for name, content in data.items():
            (inp / name).write_bytes(content)
    # max_error_rate 1: files made of bad lines, which must not stop the job
    run_job(JobSpec(model=model, input=str(inp), output=str(tmp_path / "results"),
                    progress="none", max_error_rate=1.0, **spec))
    manifest = json.loads((tmp_path / "results" / "_manifest.json").read_text())
    assert manifest["status"] == "complete"
    return [[json.loads(line) for line in (tmp_path / "results" / name).read_bytes().splitlines()]
            for name in ("output.jsonl", "errors.jsonl")]


def _errors(lines: list[dict]) -> list[tuple]:
    return [(e["custom_id"], e["error"]["code"], e["error"]["message"]) for e in lines]


def test_deeply_nested_fields_are_error_lines(fake_engine, tmp_path):
    depth = 500  # a field too deep to read recursively, the line still JSON Python reads
    lists, objects = "[" * depth + "1" + "]" * depth, '{"a": ' * depth + "1" + "}" * depth
    lines = [_line("ok", prompt="x", max_tokens=2)]
    for field, value in [("stop_token_ids", lists), ("response_format", objects),
                         ("logit_bias", objects), ("tools", lists)]:
        lines.append(_line(field, prompt="y", max_tokens=2).replace(
            '"max_tokens": 2', f'"max_tokens": 2, "{field}": {value}'))
    lines.append(_line("messages", "/v1/chat/completions", max_tokens=2, messages=[
        {"role": "user", "content": "x", "extra": 0}]).replace('"extra": 0',
                                                                f'"extra": {lists}'))
    lines.append(_line("json", prompt="x").replace('"x"', "[" * 5000 + "]" * 5000))
    at_limit = "[" * MAX_DEPTH + "1" + "]" * MAX_DEPTH
    lines.append(_line("at_limit", prompt="x", max_tokens=2).replace(
        '"max_tokens": 2', f'"max_tokens": 2, "stop_token_ids": {at_limit}'))
    out, errors = _run(tmp_path, ("\n".join(lines) + "\n").encode(), fake_engine,
                       partition_rows=3)
    assert [o["custom_id"] for o in out] == ["ok"]
    assert _errors(errors)[:-1] == [
        (name, "invalid_request", f"line {n} (custom_id {name!r}): body.{name} {DEEP}")
        for n, name in enumerate(["stop_token_ids", "response_format", "logit_bias", "tools",
                                  "messages"], 2)] + [  # too deep for json.loads itself
        ("json", "invalid_request", f"line 7 (custom_id 'json'): {DEEP}")]
    assert _errors(errors)[-1] == (  # at the limit: read, then the engine's check refuses it
        "at_limit", "invalid_request", "line 8 (custom_id 'at_limit'): body: stop_token_ids "
        f"must be non-negative integers, got {at_limit}")


def test_lone_surrogates_are_error_lines_and_the_part_commits(fake_engine, tmp_path):
    lines = [_line("ok", prompt="x", max_tokens=2),
             '{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", '
             '"body": {"prompt": "y", "max_tokens": 2}}',
             _line("prompt", prompt="y\ud800", max_tokens=2),
             _line("chat", "/v1/chat/completions", max_tokens=2,
                   messages=[{"role": "user", "content": "hi"},
                             {"role": "user", "content": "ab\udc00"}]),
             _line("stop", prompt="y", max_tokens=2, stop=["\ud83d"]),
             _line("key", prompt="y", max_tokens=2).replace('"max_tokens"', '"\\udfff"')]
    data = ("\n".join(lines) + "\n").encode()
    assert b"\\ud800" in data and b"\\ud83d" in data  # escaped: valid JSON, valid UTF-8
    out, errors = _run(tmp_path, data, fake_engine, partition_rows=2)
    assert [o["custom_id"] for o in out] == ["ok"]
    assert _errors(errors) == [
        ("\ud800", "invalid_request", f"line 2 (custom_id '\\ud800'): custom_id holds a lone "
         f"surrogate U+D800 at character 0, {SURROGATE}"),
        ("prompt", "invalid_request", f"line 3 (custom_id 'prompt'): body.prompt holds a lone "
         f"surrogate U+D800 at character 1, {SURROGATE}"),
        ("chat", "invalid_request", f"line 4 (custom_id 'chat'): body.messages[1].content "
         f"holds a lone surrogate U+DC00 at character 2, {SURROGATE}"),
        ("stop", "invalid_request", f"line 5 (custom_id 'stop'): body.stop[0] holds a lone "
         f"surrogate U+D83D at character 0, {SURROGATE}"),
        ("key", "invalid_request", f"line 6 (custom_id 'key'): body key '\\udfff' holds a "
         f"lone surrogate U+DFFF at character 0, {SURROGATE}")]
    raw = (tmp_path / "results" / "errors.jsonl").read_bytes()
    assert b'"custom_id": "\\ud800"' in raw  # the custom_id as the request wrote it
    raw.decode("utf-8")


def test_chat_lines_are_sized_before_the_template_renders_them(tmp_path):
    content = "hello world " * 100_000  # 1.2 MB: ~300,000 tokens had it been tokenized
    lines = [_line("big", "/v1/chat/completions", max_tokens=2,
                   messages=[{"role": "user", "content": content}]),
             _line("small", "/v1/chat/completions", max_tokens=2,
                   messages=[{"role": "user", "content": "hi"}])]
    out, errors = _run(tmp_path, ("\n".join(lines) + "\n").encode(), tiny_model_dir(),
                       temperature=0)
    assert [o["custom_id"] for o in out] == ["small"]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "prompt_too_long"
    assert errors[0]["error"]["message"].startswith(
        "line 1 (custom_id 'big'): the messages' content has 1,200,000 bytes; no text over ")


def test_parse_request_never_renders_a_conversation_over_the_limit():
    rendered = []

    def chat(messages):
        rendered.append(messages)
        return [1, 2]

    limit = PromptLimit(max_model_len=10, max_token_bytes=5)  # 50 bytes
    message = [{"role": "user", "content": "x" * 10}]
    req = parse_request(_line("a", "/v1/chat/completions", messages=message), 1,
                        SamplingParams(), 0, chat, "s" * 40, limit)
    assert req.error is None and req.prompt == [1, 2]
    assert rendered == [[{"role": "system", "content": "s" * 40}, *message]]
    req = parse_request(_line("b", "/v1/chat/completions", messages=message), 2,
                        SamplingParams(), 0, chat, "s" * 41, limit)  # the system prompt counts
    assert req.error == {"code": "prompt_too_long", "message": (
        "line 2 (custom_id 'b'): the messages' content has 51 bytes; no text over 50 bytes "
        "fits the context (max_model_len 10 tokens x 5 bytes, the longest token); shorten it")}
    assert len(rendered) == 1


def test_lines_that_are_not_utf8_are_error_lines(fake_engine, tmp_path):
    data = b"".join(line.encode() + b"\n" for line in [
        _line("ok", prompt="x", max_tokens=2), _line("latin", prompt="cafXX", max_tokens=2),
        _line("idXX", prompt="y", max_tokens=2), _line("fine", prompt="\ufffd", max_tokens=2)])
    data = data.replace(b"cafXX", b"caf\xe9").replace(b"idXX", b"id\xff\xfe")  # latin-1
    out, errors = _run(tmp_path, data, fake_engine, partition_rows=2)
    assert [o["custom_id"] for o in out] == ["ok", "fine"]  # a real U+FFFD is text
    assert _errors(errors) == [
        ("latin", "invalid_request", "line 2 (custom_id 'latin'): is not valid UTF-8 (byte "
         "0xe9 at byte 90 of the line); save the file as UTF-8"),
        (None, "invalid_request", "line 3: is not valid UTF-8 (byte 0xff at byte 17 of the "
         "line); save the file as UTF-8")]


def test_duplicate_custom_ids_are_error_lines_on_every_line(fake_engine, tmp_path):
    ids = ["a", "b", "a", "c", "", "a", "d", "b", ""]
    lines = [_line(i, prompt=f"p{n}", max_tokens=2) for n, i in enumerate(ids)]
    out, errors = _run(tmp_path, ("\n".join(lines) + "\n").encode(), fake_engine,
                       partition_rows=2)  # duplicates across partitions
    assert [o["custom_id"] for o in out] == ["c", "d"]
    assert _errors(errors) == [
        ("a", "duplicate_custom_id", f"line 1 (custom_id 'a'): the custom_id is also on "
         f"lines 3, 6; {DUPLICATE}"),
        ("b", "duplicate_custom_id", f"line 2 (custom_id 'b'): the custom_id is also on line "
         f"8; {DUPLICATE}"),
        ("a", "duplicate_custom_id", f"line 3 (custom_id 'a'): the custom_id is also on "
         f"lines 1, 6; {DUPLICATE}"),
        ("", "duplicate_custom_id", f"line 5: the custom_id is also on line 9; {DUPLICATE}"),
        ("a", "duplicate_custom_id", f"line 6 (custom_id 'a'): the custom_id is also on "
         f"lines 1, 3; {DUPLICATE}"),
        ("b", "duplicate_custom_id", f"line 8 (custom_id 'b'): the custom_id is also on line "
         f"2; {DUPLICATE}"),
        ("", "duplicate_custom_id", f"line 9: the custom_id is also on line 5; {DUPLICATE}")]


def test_the_plan_finds_shared_custom_ids_and_bad_bytes(tmp_path):
    lines = [_line("x") for _ in range(8)] + ["", "not json", _line("y"), "[1]"]
    data = "\n".join(lines).encode() + b"\n" + _line("zz").encode().replace(b"zz", b"z\x80")
    (tmp_path / "b.jsonl").write_bytes(data)
    (file,) = list_input_files(str(tmp_path / "b.jsonl"), {})
    checks, path = file.text.checks, file.path
    assert list(checks.shared_lines) == list(range(1, 9))  # line 9 blank, 10 no JSON
    assert (list(checks.bad_lines), list(checks.bad_at)) == ([13], [16 * 256 + 0x80])
    assert (checks.shared_with(path, 10), checks.shared_with(path, 13)) == (None, None)
    req = parse_request(_line("x", prompt="p"), 4, SamplingParams(), 0)
    assert req.error is None and _check_line(req, checks, path).error["message"] == (
        f"line 4 (custom_id 'x'): the custom_id is also on lines 1, 2, 3, 5, 6 and 2 more; "
        f"{DUPLICATE}")


def _file(*lines: str) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def test_line_1_after_a_bom_is_read_as_every_other_line(fake_engine, tmp_path):
    bom = b"\xef\xbb\xbf"
    lines = [_line(i, prompt=f"p{n}", max_tokens=2) for n, i in enumerate("abac")]
    out, errors = _run(tmp_path / "dup", bom + b"".join(line.encode() + b"\r\n"
                                                         for line in lines),
                       fake_engine, partition_rows=2)  # CRLF; line 1 and 3 in two parts
    assert [o["custom_id"] for o in out] == ["b", "c"]
    assert _errors(errors) == [
        ("a", "duplicate_custom_id", f"line 1 (custom_id 'a'): the custom_id is also on line "
         f"3; {DUPLICATE}"),
        ("a", "duplicate_custom_id", f"line 3 (custom_id 'a'): the custom_id is also on line "
         f"1; {DUPLICATE}")]
    latin = _line("e", prompt="cafXX", max_tokens=2)
    data = bom + latin.replace("XX", "\xe9").encode("latin-1") + b"\r\n" + _file(
        _line("f", prompt="x", max_tokens=2))
    out, errors = _run(tmp_path / "bytes", data, fake_engine)
    assert [o["custom_id"] for o in out] == ["f"]
    assert _errors(errors) == [("e", "invalid_request", f"line 1 (custom_id 'e'): is not "
                                f"valid UTF-8 (byte 0xe9 at byte {latin.index('XX')} of the "
                                "line); save the file as UTF-8")]  # counted after the BOM


def test_a_batch_file_in_latin_1_is_a_batch_file_of_error_lines(fake_engine, tmp_path):
    data = _file(*(_line(i, prompt="cafXX", max_tokens=2) for i in ("a", "b")))
    out, errors = _run(tmp_path, data.replace(b"XX", b"\xe9"), fake_engine)
    assert out == [] and [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("a", "invalid_request"), ("b", "invalid_request")]


def test_workers_never_read_a_batch_file_again_for_its_checks(fake_engine, tmp_path,
                                                              monkeypatch):
    from fsspec.implementations.local import LocalFileSystem

    opened = []
    real_open = LocalFileSystem._open

    def spy(self, path, mode="rb", *args, **kwargs):
        if str(path).endswith("requests.jsonl"):
            opened.append(mode)
        return real_open(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "_open", spy)
    lines = [_line(i, prompt="p", max_tokens=2) for i in ("a", "b", "XX", "a", "c")]
    data = _file(*lines).replace(b"XX", b"\xff")
    out, errors = _run(tmp_path, data, fake_engine, partition_rows=2)
    assert [o["custom_id"] for o in out] == ["b", "c"]
    assert [e["error"]["code"] for e in errors] == [
        "duplicate_custom_id", "invalid_request", "duplicate_custom_id"]
    assert opened == ["rb"] * 4  # the plan's scan, then one read per partition (3)


def test_each_partition_carries_the_problem_lines_of_its_stretch(tmp_path):
    ids = [f"r{i}" for i in range(1000)]
    ids[10] = ids[900] = "dup"  # lines 11 and 901
    data = _file(*(_line(i, prompt="p") for i in ids))
    data = data.replace(b'"r500", "method": "POST", "url": "/v1/completions", '
                        b'"body": {"prompt": "p"', b'"r500", "method": "POST", "url": '
                        b'"/v1/completions", "body": {"prompt": "\xff"')  # line 501
    (tmp_path / "b.jsonl").write_bytes(data)
    (tmp_path / "ok.jsonl").write_bytes(_file(*(_line(f"o{i}") for i in range(600))))
    files = list_input_files(str(tmp_path), {})
    plan = plan_partitions(files, 300, ".jsonl")
    path = files[0].path
    # Row groups start at rows 0, 256, 512, 768 (lines 1, 257, 513, 769): a partition
    # gets the lines from its first row's group to the group after its last row.
    checks = [p.text.checks for p in plan]
    assert [(list(c.bad_lines), list(c.shared_lines)) if c else None for c in checks] == [
        ([501], [11]), ([501], []), ([], [901]), ([], [901]), None, None]
    assert (checks[0].shared_with(path, 11), checks[3].shared_with(path, 901)) == (
        "line 901", "line 11")
    assert checks[3].ids.paths == (path,) and list(checks[3].ids.counts) == [2]
    assert files[1].text.checks is None  # a file without problems keeps nothing


def test_a_custom_id_in_two_files_is_an_error_on_every_line_holding_it(fake_engine,
                                                                       tmp_path):
    ids = {"a.jsonl": ["x", "y", "w"], "c.jsonl": ["z", "x", "v", "x", "y"]}
    out, errors = _run(tmp_path, {name: _file(*(_line(i, prompt=f"{name}{n}", max_tokens=2)
                                                for n, i in enumerate(held)))
                                  for name, held in ids.items()},
                       fake_engine, partition_rows=2)  # duplicates across parts and files
    a, c = (f"{tmp_path}/requests/{name}" for name in ids)
    assert [o["custom_id"] for o in out] == ["w", "z", "v"]
    assert _errors(errors) == [
        ("x", "duplicate_custom_id", f"line 1 (custom_id 'x'): the custom_id is also on "
         f"lines 2, 4 of {c}; {DUPLICATE}"),
        ("y", "duplicate_custom_id", f"line 2 (custom_id 'y'): the custom_id is also on line "
         f"5 of {c}; {DUPLICATE}"),
        ("x", "duplicate_custom_id", f"line 2 (custom_id 'x'): the custom_id is also on line "
         f"4 of this file and line 1 of {a}; {DUPLICATE}"),
        ("x", "duplicate_custom_id", f"line 4 (custom_id 'x'): the custom_id is also on line "
         f"2 of this file and line 1 of {a}; {DUPLICATE}"),
        ("y", "duplicate_custom_id", f"line 5 (custom_id 'y'): the custom_id is also on line "
         f"2 of {a}; {DUPLICATE}")]


def test_an_empty_file_among_batch_files_adds_no_line(fake_engine, tmp_path):
    out, errors = _run(tmp_path, {
        "a.jsonl": _file(_line("p", prompt="x", max_tokens=2)), "b.jsonl": b"",
        "c.jsonl": b"\r\n \n", "d.jsonl": _file(_line("q", prompt="y", max_tokens=2))},
        fake_engine, partition_rows=2)
    assert ([o["custom_id"] for o in out], errors) == (["p", "q"], [])
    manifest = json.loads((tmp_path / "results" / "_manifest.json").read_text())
    assert [(i["path"].rsplit("/", 1)[-1], i["num_rows"]) for i in manifest["inputs"]] == [
        ("a.jsonl", 1), ("b.jsonl", 0), ("c.jsonl", 0), ("d.jsonl", 1)]
