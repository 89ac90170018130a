"""Rows -> requests: prompts, templates, chat, per-row parameters, coded errors."""
import pyarrow as pa
import pytest

from fusegen.jobs.errors import JobError
from fusegen.jobs.rows import RowPreparer, row_seed
from fusegen.jobs.spec import JobSpec


def _prep(chat=None, **kw):
    spec = JobSpec(**{"model": "/m", "input": "i", "output": "o", **kw})
    return RowPreparer(spec, chat=chat)


def test_prompt_column_rows_and_errors():
    table = pa.table({"id": [7, 8, 9, 10], "prompt": ["hi", None, "", "yo"]})
    reqs = _prep(id_column="id").prepare(table, first_row=100)
    assert reqs[0].prompt == "hi" and reqs[0].error is None
    assert reqs[1].error == "null_prompt: row 101 (id=8): column 'prompt' is null"
    assert reqs[2].error == "empty_prompt: row 102 (id=9): column 'prompt' is empty"
    assert reqs[3].prompt == "yo"


def test_non_string_prompt_column_is_an_error_per_row():
    reqs = _prep().prepare(pa.table({"prompt": [1, 2]}), 0)
    assert [r.error for r in reqs] == [
        "invalid_prompt: row 0: column 'prompt' holds int, not a string",
        "invalid_prompt: row 1: column 'prompt' holds int, not a string"]


def test_row_seed_is_derived_from_job_seed_and_global_row():
    prep = _prep(seed=5)
    reqs = prep.prepare(pa.table({"prompt": ["a", "b"]}), 10)
    assert [r.params.seed for r in reqs] == [row_seed(5, 10), row_seed(5, 11)]
    assert row_seed(5, 10) != row_seed(5, 11) != row_seed(6, 11)
    assert 0 <= row_seed(2**40, 3) < 2**63
    assert _prep(seed=None).prepare(pa.table({"prompt": ["a"]}), 0)[0].params.seed is None


def test_per_row_parameter_columns_override_job_values():
    table = pa.table({"prompt": ["a", "b", "c", "d"],
                      "max_tokens": [3.0, None, -1, 5],
                      "temperature": [0, None, None, None],
                      "stop": [None, "x", None, None],
                      "seed": [None, 42, None, None]})
    reqs = _prep(max_tokens=9, stop=["END"]).prepare(table, 0)
    assert (reqs[0].params.max_tokens, reqs[0].params.temperature) == (3, 0.0)
    assert (reqs[1].params.max_tokens, reqs[1].params.stop, reqs[1].params.seed) == (9, ["x"], 42)
    assert reqs[2].error.startswith("invalid_params: row 2: max_tokens must be an integer >= 1, got -1")
    assert reqs[3].params.max_tokens == 5 and reqs[3].params.stop == ["END"]


def test_invalid_param_type_is_a_row_error():
    table = pa.table({"prompt": ["a"], "top_p": ["high"]})
    assert _prep().prepare(table, 0)[0].error == (
        "invalid_params: row 0: column 'top_p' must be a number, got 'high' (per-row column)")


def test_template_over_columns_with_row_failures():
    table = pa.table({"text": ["bonjour", None, "x"], "n": [1, 2, None]})
    prep = _prep(prompt_template="Translate {{ text | upper }} ({{ n + 1 }})")
    assert prep.input_columns(table.column_names) == ["n", "text"]
    reqs = prep.prepare(table, 0)
    assert reqs[0].prompt == "Translate BONJOUR (2)"
    assert reqs[1].error == ("template_error: row 1: prompt_template: UndefinedError: "
                             "'text' is undefined (null in this row)")
    assert reqs[2].error.endswith("'n' is undefined (null in this row)")
    bad = _prep(prompt_template="{{ n / 0 }}").prepare(pa.table({"n": [1]}), 0)[0]
    assert bad.error.startswith("template_error: row 0: prompt_template: ZeroDivisionError")
    kept = _prep(prompt_template="{{ text | default('?') }}").prepare(table, 0)
    assert [r.prompt for r in kept] == ["bonjour", "?", "x"]


def test_missing_columns_fail_before_generation():
    with pytest.raises(JobError, match=r"column 'prompt' \(from --prompt-column\) not in the "
                                       r"input; its columns are text"):
        _prep().input_columns(["text"])
    with pytest.raises(JobError, match=r"'zz' \(from --prompt-template\)"):
        _prep(prompt_template="{{ zz }}").input_columns(["text"])
    with pytest.raises(JobError, match=r"'key' \(from --id-column\)"):
        _prep(id_column="key").input_columns(["prompt"])
    with pytest.raises(JobError, match="input already has output column"):
        _prep().input_columns(["prompt", "generated_text"])


def test_chat_over_messages_column_and_over_plain_prompt():
    seen = []

    def chat(messages):
        seen.append(messages)
        return [1, 2, len(messages)]

    msgs = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            None, [{"role": "user"}]]
    prep = RowPreparer(JobSpec(model="/m", input="i", output="o", chat=True), chat=chat)
    reqs = prep.prepare(pa.table({"messages": msgs}), 0)
    assert reqs[0].prompt == [1, 2, 2] and seen[0] == msgs[0]
    assert reqs[1].error == "null_prompt: row 1: column 'messages' is null"
    assert reqs[2].error.startswith("invalid_prompt: row 2: column 'messages' must be")
    reqs = prep.prepare(pa.table({"prompt": ["hello"]}), 0)
    assert seen[-1] == [{"role": "user", "content": "hello"}]


def test_chat_template_failure_is_a_row_error():
    def chat(messages):
        raise ValueError("roles must alternate")

    prep = RowPreparer(JobSpec(model="/m", input="i", output="o", chat=True), chat=chat)
    assert prep.prepare(pa.table({"prompt": ["x"]}), 0)[0].error == \
        "template_error: row 0: chat template: ValueError: roles must alternate"


def _utf8_column(*values) -> pa.Array:
    """A string column holding raw bytes, valid UTF-8 or not (as a foreign writer leaves it)."""
    return pa.array(values, pa.binary()).view(pa.string())


def test_seed_outside_64_bits_is_a_row_error():
    table = pa.table({"prompt": ["a"] * 5, "seed": [1e20, 2.0**64, -1.0, 2.0**63, None]})
    reqs = _prep(seed=7).prepare(table, 0)
    assert [r.error for r in reqs[:3]] == [
        f"invalid_params: row {i}: seed must be an integer in [0, 2**64) or None, got {v} "
        "(per-row column override)" for i, v in
        enumerate(("100000000000000000000", "18446744073709551616", "-1"))]
    assert reqs[3].params.seed == 2**63 and reqs[4].params.seed == row_seed(7, 4)
    largest = pa.table({"prompt": ["a"], "seed": pa.array([2**64 - 1], pa.uint64())})
    assert _prep().prepare(largest, 0)[0].params.seed == 2**64 - 1


@pytest.mark.parametrize("values,shown", [
    ([7, None, 0], ["7", None, "0"]),
    ([1.5, None, 0.0], ["1.5", None, "0.0"]),
    ([True, None, False], ["True", None, "False"]),
    ([{"END": "x"}, None, {"END": None}], ["{'END': 'x'}", None, "{'END': None}"]),
    ([[1, 2], None, [3]], ["[1, 2]", None, "[3]"]),
])
def test_stop_column_of_non_strings_is_a_row_error(values, shown):
    table = pa.table({"prompt": ["a", "b", "c"], "stop": values})
    reqs = _prep(stop=["END"]).prepare(table, 0)
    assert [r.error for r in reqs] == [
        None if s is None else f"invalid_params: row {i}: stop must be a list of non-empty "
        f"strings, got {s} (per-row column override)" for i, s in enumerate(shown)]
    assert reqs[1].params.stop == ["END"]


def test_undecodable_cells_fail_their_row_only():
    table = pa.table({"id": _utf8_column(b"a", b"k\xff", b"c", b"d", b"e"),
                      "prompt": _utf8_column(b"fine", None, b"bad \xe2\x82", b"ok", b"ok"),
                      "stop": pa.ListArray.from_arrays([0, 0, 0, 0, 1, 2],
                                                       _utf8_column(b"\xc3(", b"x"))})
    reqs = _prep(id_column="id").prepare(table, 10)
    assert reqs[0].prompt == "fine" and reqs[0].error is None
    assert reqs[1].error == r"null_prompt: row 11 (id='k\\xff'): column 'prompt' is null"
    assert reqs[2].error == ("invalid_prompt: row 12 (id='c'): column 'prompt' is not valid "
                             "UTF-8 (byte 0xe2 at offset 4: unexpected end of data); fix or "
                             "drop this value in the input")
    assert reqs[3].error == ("invalid_params: row 13 (id='d'): column 'stop' is not valid "
                             "UTF-8 (byte 0xc3 at offset 0: invalid continuation byte); fix "
                             "or drop this value in the input")
    assert (reqs[4].prompt, reqs[4].params.stop) == ("ok", ["x"])


def test_undecodable_id_alone_does_not_fail_the_row():
    table = pa.table({"id": _utf8_column(b"k\xff"), "prompt": ["hello"]})
    req = _prep(id_column="id").prepare(table, 0)[0]
    assert (req.prompt, req.error) == ("hello", None)


def test_template_producing_a_lone_surrogate_is_a_row_error():
    prep = _prep(prompt_template='{{ text }} \ud800 {{ "\\udfff" }}')
    reqs = prep.prepare(pa.table({"text": ["abc", None]}), 0)
    assert reqs[0].error == ("invalid_prompt: row 0: the prompt is not valid Unicode: lone "
                             "surrogate U+D800 at character 4; remove it from the text")


def _limited(max_bytes, **kw):
    from fusegen.engine.tokenizer import PromptLimit

    spec = JobSpec(**{"model": "/m", "input": "i", "output": "o", **kw})
    return RowPreparer(spec, chat=lambda m: [1, 2], prompt_limit=PromptLimit(10, max_bytes // 10))


TOO_LONG = ("prompt_too_long: row {i}: the prompt has {n:,} bytes; no text over {m:,} bytes "
            "fits the context (max_model_len 10 tokens x {b} bytes, the longest token); "
            "shorten it")


def test_prompt_over_the_byte_limit_is_rejected_before_tokenizing():
    text = pa.table({"prompt": ["é" * 50, "x" * 101, "x" * 8_000_000, "x" * 100]})
    reqs = _limited(100).prepare(text, 0)
    assert [r.error for r in reqs] == [
        None, TOO_LONG.format(i=1, n=101, m=100, b=10),
        TOO_LONG.format(i=2, n=8_000_000, m=100, b=10), None]
    chat = pa.table({"messages": [[{"role": "user", "content": "y" * 60},
                                   {"role": "user", "content": "y" * 41}]]})
    assert _limited(100, chat=True).prepare(chat, 0)[0].error == \
        TOO_LONG.format(i=0, n=101, m=100, b=10).replace("the prompt", "the messages' content")


def test_template_bounded_by_the_byte_limit():
    prep = _limited(1000, prompt_template="{{ text * 100000000 }}")
    assert prep.prepare(pa.table({"text": ["ab"]}), 0)[0].error == (
        "template_error: row 0: prompt_template: TemplateSizeError: '*' would build a value "
        "of 200,000,000 characters or items; a prompt template may build at most 1,000")


def test_undecodable_id_that_is_also_the_prompt_fails_the_row():
    reqs = _prep(id_column="prompt").prepare(pa.table({"prompt": _utf8_column(b"k\xff", b"ok")}), 0)
    assert reqs[0].error == (r"invalid_prompt: row 0 (prompt='k\\xff'): column 'prompt' is not "
                             "valid UTF-8 (byte 0xff at offset 1: invalid start byte); fix or "
                             "drop this value in the input")
    assert reqs[1].prompt == "ok"
