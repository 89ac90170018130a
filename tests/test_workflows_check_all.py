"""`fusegen workflow check` lists every problem in one pass: the file's keys, and for the
steps that can still be built their columns and model folders, across every file given;
one problem a line naming the file, step and key; exit 2 if any."""
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from click.testing import CliRunner

from fusegen.jobs.cli import main
from fusegen.workflows.check import check_file
from jobs_fixtures import tiny_model_dir

RUN_DATE = "2024-05-01"


def _write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return path


def _broken(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "topic": ["a", "b"]}), tmp_path / "topics.parquet")
    return {"name": "wf", "workdir": str(tmp_path / "work"), "steps": {
        "draft": {"input": str(tmp_path / "topics.parquet"),
                  "generate": {"model": tiny_model_dir(), "prompt_column": "topic",
                               "temprature": 0}},                  # 1: an unknown job key
        "keep": {"from": "draft", "select": ["nope"]},          # 2: a column draft lacks
        "short": {"from": "draft", "filter": "len(headline) < 3"},  # 3: another one
        "again": {"from": "short", "generate": {"model": str(tmp_path / "no-model")}},
        "odd": {"input": str(tmp_path / "topics.parquet"), "select": "topic"},  # 4: a key
        "after_odd": {"from": "odd", "filter": "id > 0"},
    }}


def test_every_problem_of_every_step_in_one_pass(tmp_path):
    report = check_file(str(_write(tmp_path, "wf.yaml", _broken(tmp_path))), None, RUN_DATE)
    assert [(p.step, p.key) for p in report.problems] == [
        ("draft", "generate.temprature"), ("odd", "select"),
        ("keep", "select"), ("short", "filter"), ("again", "generate.model")]
    assert "column 'headline' is not provided by step 'draft'" in report.problems[3].message
    # `again` reads `short`, whose filter is wrong: its model is checked, its columns not
    assert report.notes == [
        "again: columns not checked: step 'short', which it reads, has problems",
        "after_odd: not checked further: it reads step 'odd', which has problems"]


def test_model_problems_come_with_the_column_problems(tmp_path):
    doc = _broken(tmp_path)
    doc["steps"]["short"]["filter"] = "len(topic) < 3"
    report = check_file(str(_write(tmp_path, "wf.yaml", doc)), None, RUN_DATE)
    assert [(p.step, p.key) for p in report.problems] == [
        ("draft", "generate.temprature"), ("odd", "select"), ("keep", "select"),
        ("again", "from"), ("again", "generate.model")]


def test_cli_lists_each_problem_on_its_own_line_for_every_file(tmp_path):
    bad = _write(tmp_path, "bad.yaml", _broken(tmp_path))
    doc = _broken(tmp_path)
    doc["steps"] = {"draft": doc["steps"]["draft"]}
    doc["steps"]["draft"]["generate"].pop("temprature")
    good = _write(tmp_path, "good.yaml", doc)
    doc["params"] = {"run_date": 1}
    worse = _write(tmp_path, "worse.yaml", doc)
    result = CliRunner().invoke(main, ["workflow", "check", str(bad), str(good), str(worse),
                                       "--run-date", RUN_DATE])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert f"{bad}: step 'draft', key 'generate.temprature': unknown key; did you mean " \
           "'temperature'?" in lines
    assert any(line.startswith(f"{bad}: step 'keep', key 'select': column 'nope'")
               for line in lines)
    assert any(line.startswith(f"{bad}: step 'short', key 'filter': column 'headline'")
               for line in lines)
    assert f"{bad}: not valid: 5 problem(s)" in lines
    assert f"{good}: valid" in lines
    assert any(line.startswith(f"{worse}: key 'params.run_date'") for line in lines)
    assert lines[-1] == "Error: 6 problem(s) in 3 file(s); each is listed above with its " \
                        "step and key"
