"""Sampling options of a job: per-row columns and flags reach SamplingParams exactly; bad
cells are row errors naming row and column; columns that look meant as parameters warn."""
import dataclasses
import json

import pyarrow as pa
import pytest
from click.testing import CliRunner

from fusegen.jobs.cli import main
from fusegen.jobs.errors import JobError
from fusegen.jobs.params import ROW_PARAM_COLUMNS, SAMPLING_FIELDS, ParamError, coerce
from fusegen.jobs.progress import JobResult
from fusegen.jobs.rows import RowPreparer, row_seed
from fusegen.jobs.spec import JobSpec


def _prep(**kw):
    return RowPreparer(JobSpec(**{"model": "/m", "input": "i", "output": "o", **kw}),
                       chat=lambda messages: messages)


# field -> (cell as a Parquet column holds it, the SamplingParams value it must become)
CELLS = {
    "max_tokens": (7.0, 7), "temperature": (0, 0.0), "top_p": (0.5, 0.5), "top_k": (3.0, 3),
    "min_p": (0.25, 0.25), "seed": (5.0, 5), "stop": ("x", ["x"]),
    "stop_token_ids": ("[3, 4]", [3, 4]), "ignore_eos": (True, True), "n": (2.0, 2),
    "presence_penalty": (1, 1.0), "frequency_penalty": (-0.5, -0.5),
    "repetition_penalty": (1.25, 1.25), "min_tokens": (2.0, 2),
    "logit_bias": ('{"5": -100, "7": 2}', {5: -100.0, 7: 2.0}),
    "bad_words": ('["foo", "bar baz"]', ["foo", "bar baz"]), "logprobs": (3.0, 3),
    "prompt_logprobs": (0, 0), "json_schema": ('{"type": "object"}', {"type": "object"}),
    "regex": ("[a-z]+", "[a-z]+"), "choice": ('["yes", "no"]', ["yes", "no"]),
    "grammar": ('start: "a"', 'start: "a"'), "skip_special_tokens": ("false", False),
    "include_stop_str_in_output": (True, True),
}


def test_the_cell_table_covers_every_sampling_field():
    assert set(CELLS) == set(SAMPLING_FIELDS)
    assert ROW_PARAM_COLUMNS[:len(SAMPLING_FIELDS)] == SAMPLING_FIELDS


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_each_row_column_reaches_sampling_params_exactly(name):
    cell, expected = CELLS[name]
    prep = _prep(max_tokens=9)
    table = pa.table({"prompt": ["a", "b"], name: [cell, None]})
    assert prep.column_warnings(table.column_names) == []
    with_cell, without = prep.prepare(table, 0)
    assert with_cell.error is None and without.error is None
    assert getattr(with_cell.params, name) == expected
    assert type(getattr(with_cell.params, name)) is type(expected)
    job_value = row_seed(0, 1) if name == "seed" else getattr(prep.base, name)
    assert getattr(without.params, name) == job_value  # null: the job's value
    changed = {f.name for f in dataclasses.fields(with_cell.params)
               if getattr(with_cell.params, f.name) != getattr(without.params, f.name)}
    assert changed <= {name, "seed"}  # the cell changes its own field only


def test_arrow_structs_and_lists_as_parameter_cells():
    schema = pa.struct([("type", pa.string()), ("properties", pa.struct(
        [("a", pa.struct([("type", pa.string())])), ("b", pa.struct([("type", pa.string())]))]))])
    table = pa.table({
        "prompt": ["a", "b"],
        "json_schema": pa.array([{"type": "object", "properties": {"a": {"type": "string"}}},
                                 None], schema),
        "choice": pa.array([None, ["x", "y"]], pa.list_(pa.string())),
        "stop_token_ids": pa.array([[1, 2], None], pa.list_(pa.int32()))})
    first, second = _prep().prepare(table, 0)
    # keys a struct has in other rows only are dropped, not passed on as nulls
    assert first.params.json_schema == {"type": "object", "properties": {"a": {"type": "string"}}}
    assert first.params.stop_token_ids == [1, 2] and first.params.choice is None
    assert second.params.choice == ["x", "y"] and second.params.json_schema is None


def test_response_format_column_becomes_the_rows_json_schema():
    formats = [json.dumps({"type": "json_schema", "json_schema": {
                   "name": "label", "schema": {"type": "object", "required": ["label"]}}}),
               '{"type": "json_object"}', '{"type": "text"}', None, '{"type": "xml"}']
    table = pa.table({"prompt": ["p"] * 5, "response_format": formats})
    reqs = _prep(regex="[0-9]+").prepare(table, 0)
    assert reqs[0].params.json_schema == {"type": "object", "required": ["label"]}
    assert (reqs[1].params.json_schema, reqs[1].params.regex) == ({"type": "object"}, None)
    assert (reqs[2].params.json_schema, reqs[2].params.regex) == (None, "[0-9]+")  # text
    assert reqs[3].params.regex == "[0-9]+"  # null: the job's constraint
    assert reqs[4].error == (
        "invalid_params: row 4: column 'response_format' is not a valid response_format: "
        'response_format.type must be "text", "json_object" or "json_schema", got \'xml\' '
        "(per-row column)")


def test_bad_cells_are_row_errors_naming_row_and_column():
    table = pa.table({"id": ["a", "b", "c", "d"], "prompt": ["p"] * 4,
                      "json_schema": ["{bad", None, None, '{"type": "object"}'],
                      "choice": [None, "yes", None, None],
                      "stop_token_ids": [None, None, '["x"]', None],
                      "response_format": [None, None, None, '{"type": "json_object"}']})
    reqs = _prep(id_column="id").prepare(table, 10)
    assert [r.error for r in reqs] == [
        "invalid_params: row 10 (id='a'): column 'json_schema' is not JSON (Expecting "
        "property name enclosed in double quotes: line 1 column 2 (char 1)); write it as a "
        "JSON Schema object (per-row column)",
        "invalid_params: row 11 (id='b'): column 'choice' is not JSON (Expecting value: line "
        '1 column 1 (char 0)); write it as a JSON list of strings, e.g. ["yes", "no"] '
        "(per-row column)",
        "invalid_params: row 12 (id='c'): stop_token_ids must be non-negative integers, got "
        "['x'] (per-row column override)",
        "invalid_params: row 13 (id='d'): columns 'json_schema' and 'response_format' are "
        "both set; a row's schema comes from one of them: leave the other null (per-row "
        "column)"]


@pytest.mark.parametrize("name, cell, message", [
    ("logit_bias", '{"five": 1}', "keys must be token ids (integers), got 'five'"),
    ("logit_bias", '{"5": "high"}', "values must be numbers, got 'high' for token 5"),
    ("logit_bias", "[1, 2]", 'must map token ids to biases, e.g. {"50256": -100}'),
    ("logit_bias", "7", "must map token ids to biases, got int"),
])
def test_logit_bias_cells_that_cannot_be_read(name, cell, message):
    with pytest.raises(ParamError) as info:
        coerce(name, cell)
    assert str(info.value) == message


def test_logit_bias_from_arrow_maps_and_structs():
    cells = pa.array([[(5, -1.5), (9, 2.0)]], pa.map_(pa.int64(), pa.float64())).to_pylist()
    assert coerce("logit_bias", cells[0]) == {5: -1.5, 9: 2.0}
    assert coerce("logit_bias", {"5": 1, "6": None}) == {5: 1.0}  # struct: absent keys null
    assert coerce("bad_words", "plain words") == ["plain words"]  # text that is no JSON list


def test_columns_that_look_meant_as_parameters_warn_up_front():
    columns = ["id", "prompt", "max_token", "Temperature", "best_of", "text", "label",
               "question", "answer", "context", "lang", "source", "category"]
    assert _prep().column_warnings(columns) == [
        "column 'max_token' is not a parameter fusegen knows (did you mean 'max_tokens'?); "
        "it is kept as data and does not change generation",
        "column 'Temperature' is not a parameter column: they are named exactly like the "
        "parameter ('temperature'); it is kept as data and does not change generation",
        "column 'best_of' names a sampling parameter this fusegen does not take; it is kept "
        "as data and does not change generation"]


def test_a_column_the_prompt_is_made_of_stays_data():
    prep = _prep(prompt_template="{{ text }} (seed {{ seed }})")
    table = pa.table({"text": ["a"], "seed": [3], "top_k": [4]})
    assert prep.parameters(table.column_names) == ["top_k"]
    assert prep.column_warnings(table.column_names) == [
        "column 'seed' feeds the prompt, so it is data, not the per-row 'seed' parameter; "
        "list it in --param-columns to make it both"]
    req = prep.prepare(table, 0)[0]
    assert (req.prompt, req.params.top_k, req.params.seed) == ("a (seed 3)", 4, row_seed(0, 0))
    both = _prep(prompt_template="{{ text }} {{ seed }}", param_columns=["seed", "top_k"])
    req = both.prepare(table, 0)[0]
    assert (req.params.seed, req.params.top_k) == (3, 4)


def test_param_columns_names_exactly_the_parameter_columns():
    prep = _prep(param_columns="top_k")
    table = pa.table({"prompt": ["a"], "top_k": [4], "temperature": [0.0], "max_token": [1]})
    assert prep.column_warnings(table.column_names) == []  # the user said which
    assert prep.parameters(table.column_names) == ["top_k"]
    req = prep.prepare(table, 0)[0]
    assert (req.params.top_k, req.params.temperature) == (4, 1.0)
    with pytest.raises(JobError) as info:
        _prep(param_columns=["top_k", "max_token"])
    assert str(info.value) == (
        f"param_columns: 'max_token' is not a sampling parameter; did you mean 'max_tokens'? "
        f"parameters: {', '.join(ROW_PARAM_COLUMNS)}")


def test_system_prompt_implies_chat_and_leads_each_conversation():
    prep = _prep(system_prompt="Answer in French.")
    assert prep.spec.chat
    table = pa.table({"prompt": ["hi"]})
    assert prep.prepare(table, 0)[0].prompt == [
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"}]
    own = [[{"role": "system", "content": "mine"}, {"role": "user", "content": "x"}]]
    assert prep.prepare(pa.table({"messages": own}), 0)[0].prompt == own[0]


FLAG_VALUES = {  # field -> (command-line words, the SamplingParams value they must give)
    "n": (["--n", "3"], 3), "min_p": (["--min-p", "0.1"], 0.1),
    "stop_token_ids": (["--stop-token-ids", "5", "--stop-token-ids", "6"], [5, 6]),
    "ignore_eos": (["--ignore-eos"], True),
    "presence_penalty": (["--presence-penalty", "0.5"], 0.5),
    "frequency_penalty": (["--frequency-penalty", "-1"], -1.0),
    "repetition_penalty": (["--repetition-penalty", "1.1"], 1.1),
    "min_tokens": (["--min-tokens", "2"], 2),
    "logit_bias": (["--logit-bias", '{"11": -100}'], {11: -100.0}),
    "bad_words": (["--bad-words", "foo", "--bad-words", "bar"], ["foo", "bar"]),
    "logprobs": (["--logprobs", "2"], 2), "prompt_logprobs": (["--prompt-logprobs", "1"], 1),
    "json_schema": (["--json-schema", '{"type": "object"}'], {"type": "object"}),
    "regex": (["--regex", "a+"], "a+"), "choice": (["--choice", "x", "--choice", "y"], ["x", "y"]),
    "grammar": (["--grammar", 'start: "a"'], 'start: "a"'),
    "skip_special_tokens": (["--no-skip-special-tokens"], False),
    "include_stop_str_in_output": (["--include-stop-str-in-output"], True),
}


def _run_flags(monkeypatch, words):
    from fusegen.jobs import driver

    seen = {}

    def fake_run_job(spec, **_):  # run_cmd also passes resume=
        seen["spec"] = spec
        return JobResult("o")

    monkeypatch.setattr(driver, "run_job", fake_run_job)
    res = CliRunner().invoke(main, ["run", "--model", "/m", "--input", "i", "--output", "o",
                                    *words])
    return res, seen.get("spec")


def test_the_flag_table_covers_every_new_sampling_field():
    assert set(FLAG_VALUES) == set(SAMPLING_FIELDS) - {
        "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}


@pytest.mark.parametrize("name", sorted(FLAG_VALUES))
def test_each_sampling_flag_reaches_sampling_params_exactly(monkeypatch, name):
    words, expected = FLAG_VALUES[name]
    res, spec = _run_flags(monkeypatch, words)
    assert res.exit_code == 0, res.output
    params = spec.sampling_params()
    assert getattr(params, name) == expected and type(getattr(params, name)) is type(expected)
    default = JobSpec(model="/m", input="i", output="o").sampling_params()
    changed = {f.name for f in dataclasses.fields(params)
               if getattr(params, f.name) != getattr(default, f.name)}
    assert changed == {name}


def test_response_format_and_job_file_options(monkeypatch, tmp_path):
    res, spec = _run_flags(monkeypatch, ["--response-format", '{"type": "json_object"}'])
    assert res.exit_code == 0 and spec.sampling_params().json_schema == {"type": "object"}
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "required": ["a"]}')
    res, spec = _run_flags(monkeypatch, ["--json-schema", str(schema), "--output-format",
                                         "jsonl", "--report", "--param-columns",
                                         "seed,top_k", "--chat-template", "{{ messages }}"])
    assert res.exit_code == 0, res.output
    assert spec.sampling_params().json_schema == {"type": "object", "required": ["a"]}
    assert (spec.output_format, spec.report, spec.param_columns, spec.chat_template) == (
        "jsonl", True, ["seed", "top_k"], "{{ messages }}")
    res, _ = _run_flags(monkeypatch, ["--json-schema", '{"type": "object"}',
                                      "--response-format", '{"type": "json_object"}'])
    assert "Error: json_schema and response_format are both set; the schema comes from one " \
           "of them: drop one" in res.output
    res, _ = _run_flags(monkeypatch, ["--json-schema", str(tmp_path / "none.json")])
    assert f"Error: json_schema: cannot read '{tmp_path / 'none.json'}' (No such file or " \
           "directory); pass the JSON text or the path of a JSON file" in res.output


def test_new_options_enter_the_fingerprint_only_when_set():
    base = JobSpec(model="/m", input="i", output="o")
    assert set(base.output_config()) == {
        "model", "prompt_column", "id_column", "prompt_template", "chat", "max_tokens",
        "temperature", "top_p", "top_k", "seed", "stop", "output_token_ids", "dtype",
        "block_size", "max_model_len", "deterministic", "partition_rows"}
    assert JobSpec(model="/m", input="i", output="o", min_p=0.1).fingerprint([]) != \
        base.fingerprint([])
