"""`fusegen workflow check` on adversarial files: every problem is a validation error that
names the step and key (exit 2), never a traceback, and a file that would fail at run time
for a reason that can be seen up front is not called valid."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from fusegen.jobs.cli import main
from fusegen.workflows.errors import ValidationError
from fusegen.workflows.expr import Expression, ExpressionError
from fusegen.workflows.resolve import resolve
from fusegen.workflows.run import run_workflow
from fusegen.workflows.spec import load_workflow, parse_workflow
from fusegen.workflows.store import open_store
from jobs_fixtures import tiny_model_dir

RUN_DATE = "2024-05-01"
MAX_DEPTH, MAX_LENGTH = 100, 10_000  # a filter's nesting and length limits


@pytest.fixture
def data(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "topic": ["a", "b"]}), tmp_path / "topics.parquet")
    return tmp_path


def _doc(data, model=None, **keep):
    return {"name": "wf", "workdir": str(data / "work"), "steps": {
        "draft": {"input": str(data / "topics.parquet"),
                  "generate": {"model": model or tiny_model_dir(), "prompt_column": "topic"}},
        "keep": {"from": "draft", "filter": "error is null", **keep}}}


def _check(data, doc):
    path = data / "wf.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, CliRunner().invoke(main, ["workflow", "check", str(path)])


def _refused(result, line):
    assert result.exit_code == 2, result.output
    assert not isinstance(result.exception, (KeyError, TypeError, ValueError, RecursionError))
    assert "Traceback" not in result.output
    assert line in result.output


@pytest.mark.parametrize("cron", ["0 0 31 2 *", "0 0 30 2 *", "15 3 31 4,6,9,11 *"])
def test_a_schedule_that_never_fires_is_invalid(data, cron):
    doc = _doc(data)
    doc["schedule"] = {"cron": cron}
    doc["workdir"] = str(data / "work" / "{{ run_date }}")
    path, result = _check(data, doc)
    _refused(result, f"key 'schedule.cron': {cron!r} never fires (no such date); check the "
             "day-of-month and month fields")
    schedule = CliRunner().invoke(main, ["workflow", "schedule", str(path), "--store",
                                         f"sqlite:///{data}/runs.db"])
    _refused(schedule, "never fires")


def test_a_leap_day_schedule_is_valid(data):
    doc = _doc(data)
    doc["schedule"] = {"cron": "0 0 29 2 *"}
    doc["workdir"] = str(data / "work" / "{{ run_date }}")
    assert parse_workflow(doc, "wf.yaml").schedule.cron == "0 0 29 2 *"


@pytest.mark.parametrize("text, message", [
    ("topic in ['a', 1]", "the list after `in` mixes types (str, int); use values of one "
     "type: x in ['a', 'b'] or x in [1, 2]"),
    ("id in [True, 2]", "the list after `in` mixes types (bool, int)"),
    ("abs(" * 150 + "id" + ")" * 150 + " > 0", f"nested more than {MAX_DEPTH} levels deep"),
    ("not " * 1000 + "id > 0", "nested more than"),
    ("-" * 5000 + "id > 0", "nested more than"),
    (" + ".join(["id"] * 3000) + " > 0", f"longer than {MAX_LENGTH} characters"),
], ids=["mixed-str-int", "mixed-bool-int", "calls", "nots", "negations", "too-long"])
def test_bad_filters_are_validation_errors(data, text, message):
    with pytest.raises(ExpressionError) as info:
        Expression(text)
    assert message in str(info.value)
    _, result = _check(data, _doc(data, filter=text))
    _refused(result, "step 'keep', key 'filter': ")
    assert message in result.output


def test_long_flat_filters_still_work(data):
    text = " and ".join(["id > 0"] * 100) + " and " + "(" * 150 + "id in [1, 2.5]" + ")" * 150
    assert Expression(text).mask(pa.table({"id": [0, 1]})).to_pylist() == [False, True]


@pytest.mark.parametrize("where", ["name", "step", "param"])
def test_names_ending_in_a_newline_are_refused(data, where):
    doc = _doc(data)
    if where == "name":
        doc["name"] = "wf\n"
        expected = (None, "name")
    elif where == "step":
        doc["steps"]["draft\n"] = doc["steps"].pop("draft")
        doc["steps"]["keep"]["from"] = "draft\n"
        expected = ("draft\n", None)
    else:
        doc["params"] = {"n\n": 1}
        expected = (None, "params.n\n")
    with pytest.raises(ValidationError) as info:
        parse_workflow(doc, "wf.yaml")
    assert [(p.step, p.key) for p in info.value.problems] == [expected]


def test_a_missing_model_folder_fails_check_and_run(data):
    missing = data / "no-such-model"
    doc = _doc(data, model=str(missing))
    path, result = _check(data, doc)
    _refused(result, f"step 'draft', key 'generate.model': model folder {missing} does not "
             "exist")
    assert "valid" not in result.output.splitlines()[-1]
    store = open_store(data / "runs.db")
    with pytest.raises(ValidationError, match="model folder .* does not exist"):
        run_workflow(load_workflow(str(path)), store, run_date=RUN_DATE)
    assert store.runs() == []  # refused before anything was recorded or run


def test_a_model_folder_without_config_is_named(data):
    (data / "empty-model").mkdir()
    _, result = _check(data, _doc(data, model=str(data / "empty-model")))
    _refused(result, f"key 'generate.model': {data}/empty-model/config.json: not found")


def test_a_model_read_by_cluster_workers_is_not_checked_here(data):
    doc = _doc(data, model=str(data / "on-the-workers"))
    doc["steps"]["draft"]["generate"]["scheduler"] = "tcp://10.0.0.1:8786"
    path, result = _check(data, doc)
    assert result.exit_code == 0, result.output
    assert f"draft: model {data}/on-the-workers is read by the workers of " \
           "tcp://10.0.0.1:8786; not checked here" in result.output
    assert result.output.splitlines()[-1] == f"{path}: valid"


def test_check_masks_credentials_in_the_urls_it_prints(data):
    doc = _doc(data)
    doc["steps"]["keep"]["output"] = "memory://user:PW-hidden@bucket/out"
    _, result = _check(data, doc)
    assert result.exit_code == 0, result.output
    assert "PW-hidden" not in result.output and "memory://***@bucket/out" in result.output


def test_the_resolved_check_is_unchanged_for_a_valid_file(data):
    resolved = resolve(parse_workflow(_doc(data), "wf.yaml"), None, RUN_DATE)
    assert [s.name for s in resolved.steps] == ["draft", "keep"]
