"""Every bad-file case is refused before anything runs, with the step and key named."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from fusegen.jobs.cli import main
from fusegen.workflows.errors import Problem, ValidationError
from fusegen.workflows.resolve import resolve
from fusegen.workflows.spec import load_workflow, parse_workflow

RUN_DATE = "2024-05-01"


@pytest.fixture
def data(tmp_path):
    pq.write_table(pa.table({"id": [1, 2], "topic": ["a", "b"], "score": [0.5, 0.9]}),
                   tmp_path / "topics.parquet")
    return tmp_path


def _doc(data, **steps):
    base = {
        "draft": {"input": str(data / "topics.parquet"),
                  "generate": {"model": str(data / "model"), "prompt_column": "topic"}},
        "keep": {"from": "draft", "filter": "error is null", "select": ["id", "generated_text"]},
    }
    base.update(steps)
    return {"name": "wf", "params": {"n": 3}, "workdir": str(data / "work" / "{{ run_date }}"),
            "steps": {k: v for k, v in base.items() if v is not None}}


def _problems(doc, params=None) -> list[Problem]:
    with pytest.raises(ValidationError) as info:
        resolve(parse_workflow(doc, "wf.yaml"), params, RUN_DATE)
    return info.value.problems


def _where(problems) -> list[tuple]:
    return [(p.step, p.key) for p in problems]


def test_a_valid_file_resolves_with_schemas(data):
    resolved = resolve(parse_workflow(_doc(data), "wf.yaml"), None, RUN_DATE)
    assert [s.name for s in resolved.steps] == ["draft", "keep"]
    assert resolved.steps[1].schema.names == ["id", "generated_text"]
    assert resolved.steps[1].input == resolved.steps[0].output == f"{data}/work/{RUN_DATE}/draft"


def test_unknown_keys_at_every_level(data):
    doc = _doc(data)
    doc["schedulle"] = {}
    doc["steps"]["draft"]["generate"]["max_tokenz"] = 3
    doc["steps"]["keep"]["fliter"] = "x"
    doc["schedule"] = {"cron": "0 2 * * *", "tz": "UTC"}
    problems = _problems(doc)
    assert set(_where(problems)) >= {(None, "schedulle"), ("draft", "generate.max_tokenz"),
                                     ("keep", "fliter"), (None, "schedule.tz")}
    text = "\n".join(map(str, problems))
    assert "did you mean 'schedule'?" in text and "did you mean 'max_tokens'?" in text
    assert "did you mean 'filter'?" in text


def test_cycle_is_named(data):
    doc = _doc(data, draft={"from": "keep", "generate": {"model": "m"}},
               keep={"from": "draft", "filter": "id > 1"})
    problems = _problems(doc)
    assert _where(problems) == [("keep", "from")]
    assert "steps form a cycle: keep -> draft -> keep" in str(problems[0])


def test_from_an_unknown_step(data):
    problems = _problems(_doc(data, keep={"from": "drfat", "filter": "id > 1"}))
    assert _where(problems) == [("keep", "from")]
    assert "did you mean 'draft'?" in problems[0].message


@pytest.mark.parametrize("step, key, column", [
    ({"from": "draft", "filter": "error is null and scroe > 1"}, "filter", "scroe"),
    ({"from": "draft", "select": ["id", "text"]}, "select", "text"),
    ({"from": "draft", "rename": {"generated": "headline"}}, "rename", "generated"),
    ({"input": "{in}", "drop_errors": True}, "drop_errors", "error"),
    ({"input": "{in}", "generate": {"model": "m", "prompt_template": "About {{ subject }}"}},
     "generate.prompt_template", "subject"),
    ({"input": "{in}", "generate": {"model": "m", "prompt_column": "prompt"}},
     "generate.prompt_column", "prompt"),
    ({"input": "{in}", "generate": {"model": "m", "prompt_column": "topic", "id_column": "key"}},
     "generate.id_column", "key"),
])
def test_a_column_no_earlier_step_provides(data, step, key, column):
    if step.get("input") == "{in}":
        step["input"] = str(data / "topics.parquet")
    problems = _problems(_doc(data, keep=step))
    assert _where(problems) == [("keep", key)]
    assert f"column {column!r} is not provided by" in problems[0].message
    assert "its columns are id, topic, score" in problems[0].message or \
        "generated_text" in problems[0].message


def test_columns_flow_through_transforms(data):
    doc = _doc(data, keep={"from": "draft", "select": ["id", "generated_text"],
                           "rename": {"generated_text": "headline"}},
               expand={"from": "keep", "generate": {"model": "m",
                                                    "prompt_template": "{{ generated_text }}"}})
    problems = _problems(doc)
    assert _where(problems) == [("expand", "generate.prompt_template")]
    assert "not provided by step 'keep'; its columns are id, headline" in problems[0].message


def test_generating_again_over_generation_columns(data):
    doc = _doc(data, keep={"from": "draft", "generate": {"model": "m",
                                                         "prompt_column": "topic"}})
    problems = _problems(doc)
    assert _where(problems) == [("keep", "from")]
    assert "select:" in problems[0].message


def test_filter_type_and_syntax_errors(data):
    problems = _problems(_doc(data, keep={"from": "draft", "filter": "topic > 3"}))
    assert _where(problems) == [("keep", "filter")]
    assert "string, int64" in problems[0].message
    problems = _problems(_doc(data, keep={"from": "draft", "filter": "id >"}))
    assert _where(problems) == [("keep", "filter")] and "syntax error" in problems[0].message
    problems = _problems(_doc(data, keep={"from": "draft", "filter": "id + 1"}))
    assert "must be true or false" in problems[0].message
    problems = _problems(_doc(data, keep={"from": "draft", "filter": "__import__('os')"}))
    assert "unknown function __import__()" in problems[0].message


@pytest.mark.parametrize("schedule, key, words", [
    ({"cron": "0 25 * * *"}, "schedule.cron", "not a valid cron expression"),
    ({"cron": "every day"}, "schedule.cron", "five fields"),
    ({"cron": "0 2 * * *", "timezone": "Mars/Olympus"}, "schedule.timezone", "time zone"),
    ({"cron": "0 2 * * *", "missed": "backfill"}, "schedule.missed", "skip, catch_up"),
    ({"cron": "0 2 * * *", "overlap": "allow"}, "schedule.overlap", "forbid"),
    ({"timezone": "UTC"}, "schedule", "cron"),
])
def test_bad_schedule(data, schedule, key, words):
    doc = _doc(data)
    doc["schedule"] = schedule
    problems = _problems(doc)
    assert _where(problems) == [(None, key)]
    assert words in problems[0].message


def test_scheduled_outputs_must_depend_on_run_date(data):
    doc = _doc(data)
    doc["schedule"] = {"cron": "0 2 * * *"}
    doc["steps"]["keep"]["output"] = str(data / "out")
    doc["workdir"] = str(data / "work")
    assert _where(_problems(doc)) == [(None, "workdir"), ("keep", "output")]


def test_unknown_variables_and_params(data):
    doc = _doc(data)
    doc["steps"]["keep"]["output"] = "out/{{ rundate }}"
    problems = _problems(doc)
    assert _where(problems) == [("keep", "output")]
    assert "unknown variable 'rundate'" in problems[0].message
    problems = _problems(_doc(data), params={"m": 1})
    assert _where(problems) == [(None, "params")] and "declares: n" in problems[0].message


def test_step_shapes(data):
    problems = _problems(_doc(data,
                              keep={"from": "draft", "input": "x.parquet", "filter": "id > 1"},
                              extra={"from": "draft"},
                              both={"from": "draft", "generate": {"model": "m"},
                                    "filter": "id > 1"},
                              nomodel={"from": "draft", "generate": {"prompt_column": "x"}}))
    assert set(_where(problems)) == {("keep", "input"), ("extra", None), ("both", "filter"),
                                     ("nomodel", "generate.model")}


def test_missing_input_is_named(data):
    doc = _doc(data)
    doc["steps"]["draft"]["input"] = str(data / "{{ run_date }}" / "in.parquet")
    problems = _problems(doc)
    assert _where(problems) == [("draft", "input")]
    assert f"{data}/{RUN_DATE}/in.parquet does not exist" in problems[0].message


def test_cli_check_exits_2_with_every_problem(data):
    import yaml

    doc = _doc(data, keep={"from": "draft", "select": ["nope"]})
    doc["steps"]["draft"]["generate"]["temprature"] = 0
    path = data / "wf.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["workflow", "check", str(path)])
    assert result.exit_code == 2
    assert "step 'draft', key 'generate.temprature': unknown key" in result.output
    result = CliRunner().invoke(main, ["workflow", "run", str(path), "--store",
                                       f"sqlite:///{data}/runs.db"])
    assert result.exit_code == 2 and "temprature" in result.output
    # nothing ran, nothing was recorded
    assert not (data / "work").exists()
    doc["steps"]["draft"]["generate"].pop("temprature")
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["workflow", "check", str(path)])
    assert result.exit_code == 2
    assert "step 'keep', key 'select': column 'nope' is not provided by step 'draft'" \
        in result.output
    assert load_workflow(str(path)).order == ["draft", "keep"]


def test_the_example_file_is_valid(tmp_path):
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "workflows" / "examples" / "headlines.yaml"
    wf = load_workflow(str(example))
    assert wf.order == ["draft", "usable", "article"] and wf.schedule.missed == "catch_up"
    topics = tmp_path / RUN_DATE / "topics.parquet"
    topics.parent.mkdir()
    pq.write_table(pa.table({"topic": ["rain", "tides"]}), topics)
    resolved = resolve(wf, {"topics": str(tmp_path / "{{ run_date }}" / "topics.parquet"),
                            "model": str(tmp_path / "model"), "out": str(tmp_path / "out")},
                       RUN_DATE)
    assert resolved.steps[0].input == str(topics)
    assert resolved.steps[2].output == f"{tmp_path}/out/{RUN_DATE}/articles"
    assert resolved.steps[2].job.model == str(tmp_path / "model")
    assert resolved.steps[2].schema.names[:2] == ["topic", "headline"]
