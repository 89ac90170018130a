"""JSONL and CSV inputs under hostile bytes: the plan and the reads agree on every row
(each input row comes out exactly once), a value never changes on its way into a column,
and a line nested too deep is that row's error, never the job's."""
import csv
import io
import json

import pyarrow as pa
import pytest

from fusegen.jobs import formats
from fusegen.jobs.formats import mark_line_errors
from fusegen.jobs.plan import plan_partitions
from fusegen.jobs.rows import RowPreparer
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from fusegen.jobs.storage import filesystem, list_input_files, read_partition
from jobs_fixtures import fake_engine, read_output  # noqa: F401


def _spec(model, inp, out, **kw):
    kw = {"max_tokens": 3, "partition_rows": 2, "progress": "none", **kw}
    return JobSpec(model=model, input=str(inp), output=str(out), **kw)


def _read_all(path, partition_rows):
    """Every partition of one file read back: (rows as dicts, {global row: message})."""
    files = list_input_files(str(path), {})
    fs, _ = filesystem(str(path), {})
    rows, errors = [], {}
    for part in plan_partitions(files, partition_rows):
        found = {}
        table = read_partition(fs, part, found)
        assert table.num_rows == part.num_rows
        errors.update({part.start + i: m for i, m in found.items()})
        rows += table.to_pylist()
    return rows, errors


# -- CSV: one record reader for the plan and the reads ------------------------------------

def test_a_stray_quote_is_a_literal_and_every_row_comes_out_once(fake_engine, tmp_path):
    # One stray quote (the rest of the file was one bad row) and two (rows read twice).
    one = 'id,prompt\n0,a\n1,5" screen\n2,b\n3,c\n4,d\n'
    two = 'id,prompt\n0,a\n1,5" screen\n2,b\n3,7" tablet\n4,d\n'
    for name, text in (("one", one), ("two", two)):
        (tmp_path / f"{name}.csv").write_text(text)
        expected = list(csv.DictReader(io.StringIO(text)))
        spec = _spec(fake_engine, tmp_path / f"{name}.csv", tmp_path / name)
        run_job(spec)
        got = read_output(tmp_path / name).to_pylist()
        assert [(r["row_id"], r["id"], r["prompt"], r["error"]) for r in got] == [
            (i, i, e["prompt"], None) for i, e in enumerate(expected)]
        run_job(spec)  # the rerun finds every part complete
        manifest = json.loads((tmp_path / name / "_manifest.json").read_text())
        assert manifest["runs"][-1]["parts_computed"] == 0
        assert manifest["runs"][-1]["parts_skipped"] == 3


HOSTILE_CSV = ("\ufeffid,text\r\n"  # BOM, CRLF
               '0,"two\nlines"\r\n'  # a quoted newline
               '1,5" screen\n'  # a stray quote
               "\n"  # an empty line
               '2,"say ""hi"""\r\n'  # doubled quotes
               '3,a"b"c\rx,"q"\r\n'  # a lone CR ends a record; quotes inside a field
               '4,"a "" quote\r\nand, a comma"\n'
               "   \n"  # blanks only
               '5,"' + "x" * (1 << 20) + '"\n'  # a 1 MB field
               '6,ends with "quote"\n'
               "7,no final newline")


@pytest.mark.parametrize("group_rows", [1, 2, 3, 256])
def test_hostile_csv_reads_as_pythons_csv_in_any_partitioning(tmp_path, monkeypatch,
                                                              group_rows):
    monkeypatch.setattr(formats, "GROUP_ROWS", group_rows)  # offsets at every kind of row
    path = tmp_path / "in.csv"
    path.write_bytes(HOSTILE_CSV.encode())
    csv.field_size_limit(2**31 - 1)  # the reference reads the 1 MB field too
    with open(path, newline="", encoding="utf-8-sig") as f:
        expected = [r for r in csv.reader(f) if r and "".join(r).strip()]
    header, expected = expected[0], expected[1:]
    assert header == ["id", "text"] and [r[0] for r in expected] == [
        "0", "1", "2", "3", "x", "4", "5", "6", "7"]
    for partition_rows in (1, 2, 4, 100):
        rows, errors = _read_all(path, partition_rows)
        # "x,"q\r\n..." holds an id that is no integer: the id column is text
        assert [[r["id"], r["text"]] for r in rows] == expected, partition_rows
        assert errors == {}
    (file,) = list_input_files(str(path), {})
    assert file.num_rows == 9


def test_csv_quote_left_open_at_the_end_is_one_error_row(fake_engine, tmp_path):
    (tmp_path / "in.csv").write_text('id,prompt\n0,a\n1,"open\n2,b\n3,c\n')
    run_job(_spec(fake_engine, tmp_path / "in.csv", tmp_path / "out"))
    got = read_output(tmp_path / "out").to_pylist()
    assert [(r["row_id"], r["id"], r["prompt"], r["error_code"]) for r in got] == [
        (0, 0, "a", None), (1, None, None, "invalid_line")]
    assert got[1]["error"] == (f"invalid_line: row 1: {tmp_path}/in.csv line 3 opens a "
                               "quoted field that never closes: the rest of the file is in "
                               "it; fix or drop the line")


def test_csv_header_only_and_header_left_open(tmp_path):
    (tmp_path / "h.csv").write_text("id,prompt")
    (file,) = list_input_files(str(tmp_path / "h.csv"), {})
    assert (file.num_rows, file.columns) == (0, ("id", "prompt"))
    (tmp_path / "bad.csv").write_text('id,"prompt\n0,a\n')
    with pytest.raises(formats.JobError, match=r"bad.csv: the CSV header \(line 1\) opens "
                                                "a quoted field that never closes"):
        list_input_files(str(tmp_path / "bad.csv"), {})


def test_csv_bad_records_cost_their_row_only(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "GROUP_ROWS", 2)
    path = tmp_path / "in.csv"
    path.write_bytes(b'n,s\n1,a\n2,"b\xff"\n3,c,extra\n4,"d\n"\n5,e\n')
    rows, errors = _read_all(path, 2)
    assert rows == [{"n": 1, "s": "a"}, {"n": None, "s": None}, {"n": None, "s": None},
                    {"n": 4, "s": "d\n"}, {"n": 5, "s": "e"}]
    assert errors == {
        1: f"{path} line 3 is not valid UTF-8 (byte 4 of the record); fix or drop the line",
        2: f"{path} line 4 has 3 fields where the header has 2; fix or drop the line"}


# -- JSONL: a value never changes on its way into a column --------------------------------

TEMPERATURES = [0, 0.9, True, "hot", None, 1]


def test_jsonl_mixed_column_keeps_every_value_or_errors_its_row(fake_engine, tmp_path):
    lines = [json.dumps({"prompt": f"p{i}", "temperature": t})
             for i, t in enumerate(TEMPERATURES)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    run_job(_spec(fake_engine, tmp_path / "in.jsonl", tmp_path / "out"))
    got = read_output(tmp_path / "out").to_pylist()
    path = f"{tmp_path}/in.jsonl"
    assert [(r["row_id"], r["temperature"], r["error"]) for r in got] == [
        (0, 0.0, None), (1, 0.9, None),
        (2, None, f"invalid_line: row 2: {path} line 3 has true in column 'temperature', "
                  "which holds double (set by the column's first value in the file); fix "
                  "or drop the line"),
        (3, None, f"invalid_line: row 3: {path} line 4 has \"hot\" in column "
                  "'temperature', which holds double (set by the column's first value in "
                  "the file); fix or drop the line"),
        (4, None, None), (5, 1.0, None)]
    # The sampling parameters each row ran with.
    (file,) = list_input_files(path, {})
    (part,) = plan_partitions([file], 10)
    errors = {}
    table = read_partition(filesystem(path, {})[0], part, errors)
    reqs = mark_line_errors(RowPreparer(JobSpec(model="/m", input=path, output="/o",
                                                temperature=0.5)).prepare(table, 0), errors)
    assert [None if r.error else r.params.temperature for r in reqs] == [
        0.0, 0.9, None, None, 0.5, 1.0]


def test_a_lone_surrogate_in_a_jsonl_cell_is_named_as_one(fake_engine, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "e\\ud800"}\n')
    run_job(_spec(fake_engine, tmp_path / "in.jsonl", tmp_path / "out"))
    got = read_output(tmp_path / "out").to_pylist()
    assert [r["error"] for r in got] == [
        None, f"invalid_line: row 1: {tmp_path}/in.jsonl line 2 has \"e\\ud800\" in column "
              "'prompt': a lone surrogate (an escaped \\ud800-\\udfff without its pair), "
              "which is no Unicode text; fix or drop the line"]


def test_jsonl_column_kind_is_the_files_across_row_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(formats, "GROUP_ROWS", 2)  # 0, 0 | "hot", 0.9 | 7, 2**60 + 1
    values = [0, 0, "hot", 0.9, 7, 2**60 + 1]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"t": v}) + "\n" for v in values))
    (file,) = list_input_files(str(path), {})
    assert file.text.schema == pa.schema([("t", pa.float64())])
    rows, errors = _read_all(path, 3)
    assert [r["t"] for r in rows] == [0.0, 0.0, None, 0.9, 7.0, None]
    assert errors == {
        2: f"{path} line 3 has \"hot\" in column 't', which holds double (set by the "
           "column's first value in the file); fix or drop the line",
        5: f"{path} line 6 has 1152921504606846977 in column 't', which holds double (set "
           "by the column's first value in the file); fix or drop the line"}


def test_jsonl_nested_values_are_kept_exactly(tmp_path):
    values = [{"a": 1, "b": [1, 2]}, {"a": 1.5, "c": "x"}, {"a": True}, [1, 2],
              {"b": ["s"]}, {"a": 2}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"v": v, "s": "\ud800" if i == 5 else "ok"}) + "\n"
                            for i, v in enumerate(values)))
    rows, errors = _read_all(path, 4)
    assert [r["v"] for r in rows] == [{"a": 1.0, "b": [1, 2], "c": None},
                                      {"a": 1.5, "b": None, "c": "x"}] + [None] * 4
    assert [r["s"] for r in rows] == ["ok"] * 2 + [None] * 4
    assert sorted(errors) == [2, 3, 4, 5]
    assert errors[2].endswith("line 3 has {\"a\": true} in column 'v', which holds "
                              "struct<a: double, b: list<item: int64>, c: string> (set by "
                              "the column's first value in the file); fix or drop the line")
    assert "line 6 has \"\\ud800\" in column 's'" in errors[5]


# -- JSON nested too deep: the row's error ------------------------------------------------

def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_a_deeply_nested_jsonl_line_is_its_rows_error(fake_engine, tmp_path):
    lines = ['{"prompt": "a", "x": [1]}', '{"prompt": "b", "x": ' + _deep(1000) + "}",
             '{"prompt": "c", "y": ' + _deep(31) + "}",  # 32 levels with the row's
             '{"prompt": "d", "y": ' + _deep(32) + "}"]
    deep_first = ['{"prompt": "z", "x": ' + _deep(999) + "}"]
    for name, first in (("mid", []), ("first", deep_first)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(first + lines) + "\n")
        run_job(_spec(fake_engine, tmp_path / f"{name}.jsonl", tmp_path / name,
                      max_error_rate=1.0))  # lines made to fail: none may stop the job
        got = read_output(tmp_path / name).to_pylist()
        path = f"{tmp_path}/{name}.jsonl"
        n = len(first)
        assert [r["prompt"] for r in got] == [None] * n + ["a", None, "c", None]
        assert [r["error_code"] for r in got] == ["invalid_line"] * n + [
            None, "invalid_line", None, "invalid_line"]
        assert got[n + 1]["error"] == (
            f"invalid_line: row {n + 1}: {path} line {n + 2} nests arrays and objects 1001 "
            "levels deep, past fusegen's limit of 32 levels; fix or drop the line")
        assert f"line {n + 4} nests arrays and objects 33 levels deep" in \
            got[n + 3]["error"]
    assert formats.MAX_JSON_DEPTH == 32


def test_a_deep_line_in_a_batch_file_plans(tmp_path):
    body = {"model": "m", "prompt": "hi"}
    lines = [json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                         "body": body}),
             '{"custom_id": "b", "body": ' + _deep(5000) + "}"]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    (file,) = list_input_files(str(tmp_path / "b.jsonl"), {})
    assert (file.text.format, file.num_rows) == ("openai_batch", 2)
    (tmp_path / "c.jsonl").write_text("\n".join(lines[::-1]) + "\n")  # the deep line first
    (file,) = list_input_files(str(tmp_path / "c.jsonl"), {})
    assert (file.text.format, file.num_rows) == ("openai_batch", 2)


def test_json_depth_counts_brackets_outside_strings_only():
    texts = ('1', '"[[["', '{"a": [1]}', '[{"k": "]]}"}, [[]]]', r'["\"[", [["\\"]]]',
             _deep(100_000))
    assert [formats.json_depth(t) for t in texts] == [
        0, 0, 2, 3, 3, 100_000]
    assert formats.json_depth(b'{"a": "\\u005b", "b": [[{}]]}') == 4
    limit = formats.MAX_JSON_DEPTH
    assert formats.load_json(_deep(limit)) == json.loads(_deep(limit))
    with pytest.raises(formats.JsonTooDeep, match="33 levels deep, past fusegen's limit "
                                                  "of 32 levels"):
        formats.load_json(_deep(limit + 1))
    assert formats.load_json('["' + "[" * 1000 + '"]') == ["[" * 1000]  # in a string
