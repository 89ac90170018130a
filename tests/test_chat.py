"""Chat: `LLM.chat` token-exact against transformers' `apply_chat_template(...,
tokenize=True)` and greedy `generate`; jobs over a `--messages-column` (Parquet
list<struct<role, content>> or JSON text), its malformed rows and its flag checks."""
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from checkpoints import hf_greedy
from fusegen.engine import LLM, SamplingParams
from fusegen.jobs.cli import main
from fusegen.jobs.errors import JobError
from fusegen.jobs.rows import RowPreparer
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec, build_spec
from jobs_fixtures import read_output, tiny_model_dir

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "Où est la gare ? 🚉"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hello "},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "the sea"}],
    [{"role": "user", "content": "中文 and emoji 🎉", "name": None}],  # None keys are dropped
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _hf_ids(hf_tok, conversation, **kw):
    return hf_tok.apply_chat_template(conversation, tokenize=True, **kw)["input_ids"]


@pytest.mark.parametrize("fixture", ["llama_dir", "mistral_sp_dir"])
def test_chat_is_token_exact_with_transformers(request, fixture):
    path = request.getfixturevalue(fixture)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    conversations = CONVERSATIONS if fixture == "llama_dir" else \
        [c for c in CONVERSATIONS if c[-1]["role"] == "user" and len(c) == 1]
    with LLM(str(path), dtype="float32", max_num_seqs=4) as llm:
        outs = llm.chat(conversations, GREEDY)
        for conv, out in zip(conversations, outs):
            ids = _hf_ids(hf_tok, conv, add_generation_prompt=True)
            assert llm.tokenizer.encode_chat(conv) == ids
            assert ids.count(llm.tokenizer.bos_token_id) == 1  # the template's BOS only
            assert out.num_prompt_tokens == len(ids)
            assert out.token_ids == hf_greedy(path, ids, 8)
        no_prompt = llm.tokenizer.encode_chat(conversations[0], add_generation_prompt=False)
        assert no_prompt == _hf_ids(hf_tok, conversations[0], add_generation_prompt=False)


def test_one_conversation_and_a_template_of_ones_own(llama_dir):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<bot>"
    hf_tok = transformers.AutoTokenizer.from_pretrained(llama_dir)
    with LLM(str(llama_dir), dtype="float32") as llm:
        (one,) = llm.chat(CONVERSATIONS[1], GREEDY)
        assert one.token_ids == llm.chat(CONVERSATIONS, GREEDY)[1].token_ids
        ids = _hf_ids(hf_tok, CONVERSATIONS[1], chat_template=template)
        assert llm.tokenizer.encode_chat(CONVERSATIONS[1], chat_template=template) == ids
        (own,) = llm.chat(CONVERSATIONS[1], GREEDY, chat_template=template)
        assert own.num_prompt_tokens == len(ids) and own.token_ids == hf_greedy(llama_dir, ids, 8)


def test_bad_conversations_fail_alone_in_input_order(mistral_sp_dir):
    good = CONVERSATIONS[0]
    with LLM(str(mistral_sp_dir), dtype="float32") as llm:
        outs = llm.chat([good, [{"role": "user"}], [{"role": "tool", "content": "x"}], "hi",
                         good], GREEDY)
        expected = llm.chat(good, GREEDY)[0].token_ids
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert outs[0].token_ids == outs[4].token_ids == expected
    assert outs[1].error == ("invalid_prompt: a conversation must be a non-empty list of "
                             "{role: string, content: string} messages; message 0 has no "
                             "string 'content'")
    assert outs[2].error == ("invalid_prompt: the chat template failed: TemplateError: "
                             "Unknown role: tool")
    assert outs[3].error.endswith("messages; got str")


def _without_chat_template(form: str, tmp_path):
    """The tiny model with no chat template, as a directory or (like Gemma 3's files) as
    a GGUF file; and where the error says the template was missing."""
    if form == "gguf":
        from gguf_checkpoints import write_gguf  # here: it skips without the gguf package

        path = write_gguf(Path(tiny_model_dir()), tmp_path / "model.gguf",
                          drop=("tokenizer.chat_template",))
        return path, "tokenizer.chat_template", "GGUF metadata"
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model, "chat_template", "tokenizer files"


@pytest.mark.parametrize("form", ["dir", "gguf"])
def test_a_model_without_a_chat_template_says_how_to_pass_one(form, tmp_path):
    model, key, home = _without_chat_template(form, tmp_path)
    with LLM(str(model)) as llm:
        with pytest.raises(ValueError) as err:
            llm.chat(CONVERSATIONS[0])
        assert str(err.value) == (
            f"{model} has no chat template (no {key} in its {home}): pass "
            "one, llm.chat(conversations, chat_template=\"{% for m in messages %}...{% endfor "
            "%}\"), or use generate() with plain prompts")
        (out,) = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=2),
                          chat_template="{{ messages[0]['content'] }}")
        assert out.error is None and out.num_prompt_tokens > 0
        if form == "gguf":  # no files to add a template to
            with pytest.raises(ValueError) as err:
                llm.tokenizer.apply_chat_template(CONVERSATIONS[0])
            assert str(err.value) == (
                "this tokenizer has no chat template (no tokenizer.chat_template in its GGUF "
                "metadata): pass plain-text prompts, or pass a template (LLM.chat(..., "
                "chat_template=...))")
    spec = _spec(tmp_path / "in.parquet", tmp_path / "out", model=str(model))
    pq.write_table(pa.table({"conv": [json.dumps(CONVERSATIONS[0])]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match="--messages-column needs a chat template, but .* has "
                       f"none in its {home}; drop --messages-column"):
        run_job(spec)


def _spec(inp, out, **kw):
    kw = {"model": tiny_model_dir(), "max_tokens": 5, "temperature": 0, "partition_rows": 4,
          "messages_column": "conv", "progress": "none", **kw}
    return JobSpec(input=str(inp), output=str(out), **kw)


def test_a_messages_column_job_equals_llm_chat(tmp_path):
    # Parquet list<struct<role, content>> in one file, the same lists as JSON text in another.
    structs = [[{k: m[k] for k in ("role", "content")} for m in c] for c in CONVERSATIONS]
    pq.write_table(pa.table({"id": [0, 1, 2], "conv": structs}), tmp_path / "s.parquet")
    pq.write_table(pa.table({"conv": [json.dumps(c) for c in structs]}), tmp_path / "j.parquet")
    run_job(_spec(tmp_path / "s.parquet", tmp_path / "s", output_token_ids=True))
    run_job(_spec(tmp_path / "j.parquet", tmp_path / "j", output_token_ids=True))
    with LLM(tiny_model_dir()) as llm:
        expected = llm.chat(structs, SamplingParams(max_tokens=5, temperature=0))
    for name in ("s", "j"):
        rows = read_output(tmp_path / name).to_pylist()
        assert [r["generated_token_ids"] for r in rows] == [e.token_ids for e in expected]
        assert [r["num_prompt_tokens"] for r in rows] == [e.num_prompt_tokens for e in expected]


def test_malformed_message_rows_are_error_rows_naming_row_and_column(tmp_path):
    cells = [json.dumps(CONVERSATIONS[0]), None, '[{"role": "user", ', '{"role": "user"}',
             json.dumps([{"role": "user"}]), "[]", json.dumps([{"role": "user", "content": 3}])]
    pq.write_table(pa.table({"key": list("abcdefg"), "conv": cells}), tmp_path / "in.parquet")
    run_job(_spec(tmp_path / "in.parquet", tmp_path / "out", id_column="key"))
    errors = [r["error"] for r in read_output(tmp_path / "out").to_pylist()]
    shape = "must be a non-empty list of {role: string, content: string} messages"
    assert errors == [
        None,
        "null_prompt: row 1 (key='b'): column 'conv' is null",
        "invalid_prompt: row 2 (key='c'): column 'conv' is not a JSON list of messages "
        "(Expecting property name enclosed in double quotes: line 1 column 19 (char 18))",
        f"invalid_prompt: row 3 (key='d'): column 'conv' {shape}; got dict",
        f"invalid_prompt: row 4 (key='e'): column 'conv' {shape}; message 0 has no string "
        "'content'",
        f"invalid_prompt: row 5 (key='f'): column 'conv' {shape}; got an empty list",
        f"invalid_prompt: row 6 (key='g'): column 'conv' {shape}; message 0 has no string "
        "'content'",
    ]


def test_messages_column_excludes_prompt_column_and_template(tmp_path):
    base = ["run", "--model", tiny_model_dir(), "--input", "i.parquet", "--output", "o",
            "--messages-column", "conv"]
    for extra, name in ((["--prompt-column", "text"], "prompt_column"),
                        (["--prompt-template", "{{ x }}"], "prompt_template")):
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 1
        assert (f"Error: messages_column and {name} are both set; a row's prompt comes from "
                "one of them: drop one") in result.output
    with pytest.raises(JobError, match="messages_column must name an input column"):
        build_spec({"messages_column": "generated_text"}, {"model": "/m", "input": "i",
                                                          "output": "o"})
    with pytest.raises(JobError, match=r"column 'conv' \(from --messages-column\) not in the "
                       "input; its columns are prompt"):
        RowPreparer(_spec("i", "o")).input_columns(["prompt"])


def test_messages_column_from_a_job_file(tmp_path):
    pq.write_table(pa.table({"conv": [json.dumps(CONVERSATIONS[1])]}), tmp_path / "in.parquet")
    (tmp_path / "job.yaml").write_text(
        f"model: {tiny_model_dir()}\ninput: {tmp_path / 'in.parquet'}\noutput: "
        f"{tmp_path / 'out'}\nmessages-column: conv\nmax_tokens: 3\ntemperature: 0\n")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--progress", "none"])
    assert result.exit_code == 0, result.output
    (row,) = read_output(tmp_path / "out").to_pylist()
    with LLM(tiny_model_dir()) as llm:
        (expected,) = llm.chat(CONVERSATIONS[1], SamplingParams(max_tokens=3, temperature=0))
    assert (row["error"], row["generated_text"]) == (None, expected.text)


def test_fields_added_later_keep_old_outputs_fingerprints():
    plain = JobSpec(model="/m", input="i", output="o")
    assert "messages_column" not in plain.output_config()
    assert "revision" not in plain.output_config()
    pinned = JobSpec(model="/m", input="i", output="o", messages_column="c", revision="v2")
    assert (pinned.output_config()["messages_column"], pinned.output_config()["revision"]) == \
        ("c", "v2")
    assert pinned.fingerprint([]) != plain.fingerprint([])
