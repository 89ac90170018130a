"""JSONL and CSV inputs beside Parquet, and JSONL parts: the same rows and ids as the
Parquet input gives, unreadable lines as error rows, bounded partitions, resume."""
import csv
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusegen.jobs.errors import JobError
from fusegen.jobs.plan import plan_partitions
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from fusegen.jobs.storage import filesystem, list_input_files, read_partition
from jobs_fixtures import fake_engine, read_output  # noqa: F401

ROWS = [{"id": i, "prompt": f"prompt {i}, with a comma" if i % 3 else f"line\nbreak {i}",
         "score": i / 4, "tag": None if i == 5 else f"t{i}"} for i in range(11)]


def _spec(model, inp, out, **kw):
    kw = {"max_tokens": 3, "partition_rows": 4, "progress": "none", **kw}
    return JobSpec(model=model, input=str(inp), output=str(out), **kw)


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(list(rows[0]))
        for row in rows:
            writer.writerow(["" if v is None else v for v in row.values()])


def _jsonl_rows(out_dir) -> list[dict]:
    names = sorted(n for n in os.listdir(out_dir) if n.startswith("part-"))
    assert names and all(n.endswith(".jsonl") for n in names), names
    return [json.loads(line) for n in names for line in (out_dir / n).read_text().splitlines()]


def test_jsonl_and_csv_give_the_rows_and_ids_of_parquet(fake_engine, tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    _write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in ROWS])
    _write_csv(tmp_path / "in.csv", ROWS)
    for name in ("parquet", "jsonl", "csv"):
        run_job(_spec(fake_engine, tmp_path / f"in.{name}", tmp_path / name))
    expected = read_output(tmp_path / "parquet")
    assert expected.column("row_id").to_pylist() == list(range(11))
    assert read_output(tmp_path / "jsonl").to_pylist() == expected.to_pylist()
    assert read_output(tmp_path / "jsonl").schema == expected.schema
    # CSV has no nulls in text columns: an empty cell is the empty string
    got = read_output(tmp_path / "csv").to_pylist()
    assert got == [{**r, "tag": r["tag"] or ""} for r in expected.to_pylist()]


def test_unreadable_lines_are_error_rows_naming_file_and_line(fake_engine, tmp_path):
    lines = [json.dumps({"prompt": "a"}), "", '{"prompt": oops}', "[1, 2]",
             json.dumps({"prompt": 7}), json.dumps({"prompt": "b"})]
    _write_jsonl(tmp_path / "in.jsonl", lines)
    (tmp_path / "in.csv").write_text('prompt,k\n"x",1\n"y",1,2\n"z",2\n')
    run_job(_spec(fake_engine, tmp_path / "in.jsonl", tmp_path / "j"))
    run_job(_spec(fake_engine, tmp_path / "in.csv", tmp_path / "c"))
    j = read_output(tmp_path / "j").to_pylist()
    path = f"{tmp_path}/in.jsonl"
    assert [(r["row_id"], r["prompt"], r["error"]) for r in j] == [
        (0, "a", None),
        (1, None, f"invalid_line: row 1: {path} line 3 is not JSON (Expecting value: line 1 "
                  "column 12 (char 11)); fix or drop the line"),
        (2, None, f"invalid_line: row 2: {path} line 4 is a JSON list, not an object of "
                  "column: value; fix or drop the line"),
        (3, None, f"invalid_line: row 3: {path} line 5 has 7 in column 'prompt', which "
                  "holds string (set by the column's first value in the file); fix or drop "
                  "the line"),
        (4, "b", None)]
    assert [r["error_code"] for r in j] == [None] + ["invalid_line"] * 3 + [None]
    c = read_output(tmp_path / "c").to_pylist()
    assert [(r["prompt"], r["k"], r["error"]) for r in c] == [
        ("x", 1, None),
        (None, None, f"invalid_line: row 1: {tmp_path}/in.csv line 3 has 3 fields where "
                     "the header has 2; fix or drop the line"),
        ("z", 2, None)]


def test_text_partitions_start_anywhere_and_read_only_their_rows(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [json.dumps({"i": i}) for i in range(600)])
    (tmp_path / "b.csv").write_text("i\n" + "".join(f"{i}\n" for i in range(600, 700)))
    files = list_input_files(str(tmp_path), {})
    assert [f.row_groups for f in files] == [(256, 256, 88), (100,)]
    assert files[0].text.lines == (1, 257, 513) and files[1].text.lines == (2,)
    assert files[0].text.offsets == (0, 10 * 9 + 90 * 10 + 156 * 11,
                                     files[0].text.offsets[2])
    plan = plan_partitions(files, 250, ".jsonl")
    assert [(p.start, p.stop, p.first_row, p.text.line, p.text.skip) for p in plan] == [
        (0, 250, 0, 1, 0), (250, 500, 250, 1, 250), (500, 600, 500, 257, 244),
        (0, 100, 600, 2, 0)]
    assert plan[0].name == "part-00000.jsonl"
    fs, _ = filesystem(str(tmp_path), {})
    ids = [i for p in plan for i in read_partition(fs, p).column("i").to_pylist()]
    assert ids == list(range(700))


def test_a_read_without_line_errors_fails_naming_the_line(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ['{"i": 1}', "{"])
    (part,) = plan_partitions(list_input_files(str(tmp_path / "a.jsonl"), {}), 10)
    with pytest.raises(JobError, match=r"a.jsonl line 2 is not JSON"):
        read_partition(filesystem(str(tmp_path), {})[0], part)
    errors = {}
    table = read_partition(filesystem(str(tmp_path), {})[0], part, errors)
    assert table.column("i").to_pylist() == [1, None] and list(errors) == [1]


def test_mixed_types_widen_per_column(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ['{"x": 1, "y": null}'] * 300 + ['{"x": 1.5, "y": "s"}'])
    (tmp_path / "b.csv").write_text("x\n" + "1\n" * 300 + "a\n")
    jf, cf = list_input_files(str(tmp_path), {})
    assert jf.text.schema == pa.schema([("x", pa.float64()), ("y", pa.string())])
    assert cf.text.schema == pa.schema([("x", pa.string())])


def test_jsonl_parts_commit_with_a_record_and_resume(fake_engine, tmp_path):
    _write_jsonl(tmp_path / "in.jsonl", [json.dumps({"prompt": f"p{i}"}) for i in range(10)])
    spec = _spec(fake_engine, tmp_path / "in.jsonl", tmp_path / "out", output_format="jsonl")
    run_job(spec)
    out = tmp_path / "out"
    first = _jsonl_rows(out)
    assert [r["row_id"] for r in first] == list(range(10))
    assert sorted(os.listdir(out / "_parts")) == [f"part-0000{i}.jsonl.json" for i in range(3)]
    record = json.loads((out / "_parts" / "part-00001.jsonl.json").read_text())
    assert record["files"] == {"part-00001.jsonl": (out / "part-00001.jsonl").stat().st_size}
    assert record["stats"]["num_rows"] == 4
    # Killed after moving part 1's file, before its record; part 2's file cut short.
    (out / "_parts" / "part-00001.jsonl.json").unlink()
    with open(out / "part-00002.jsonl", "r+b") as f:
        f.truncate(5)
    run_job(spec)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["runs"][-1]["parts_computed"] == 2
    assert manifest["runs"][-1]["parts_skipped"] == 1
    assert _jsonl_rows(out) == first
