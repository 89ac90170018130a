"""Python steps (`python: module:function`): exact rows over several partitions in both
formats, a failed partition resumed with every part committed once, an edited function
rerunning the step, bad returns and `workflow check`'s errors, each naming step, module,
function and partition."""
import collections
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from fusegen.jobs import output as jobs_output
from fusegen.workflows.check import check_file
from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.run import run_workflow
from fusegen.workflows.spec import load_workflow
from fusegen.workflows.store import open_store
from jobs_fixtures import read_output

RUN_DATE = "2024-05-01"
IDS = list(range(10))
TEXTS = [f"  Item {i}  " for i in IDS]

# arrow: keeps ids not divisible by 3, adds `clean` and `length`
ARROW_MODULE = '''
import os
import pyarrow as pa
import pyarrow.compute as pc

def tidy(table):
    if os.path.exists(os.path.join(os.path.dirname(__file__), "FAIL")) \\
            and 5 in table.column("id").to_pylist():
        raise ValueError("injected failure")
    table = table.filter(pc.not_equal(pc.modulo(table.column("id"), 3), 0))
    clean = pc.utf8_lower(pc.utf8_trim_whitespace(table.column("text")))
    return table.append_column("clean", clean).append_column("length", pc.utf8_length(clean))

def returns_none(table):
    return None

def drops_clean(table):
    return table.select(["id"])

NOT_CALLABLE = 3
'''
PANDAS_MODULE = '''
def tidy(df):
    df = df[df["id"] % 3 != 0].copy()
    df["clean"] = df["text"].str.strip().str.lower()
    df["length"] = df["clean"].str.len()
    return df
'''


def _expected():
    kept = [i for i in IDS if i % 3]
    return kept, [f"item {i}" for i in kept], [len(f"item {i}") for i in kept]


def _workflow(root, module: str, source: str, function="tidy", fmt=None, after=None):
    """10 rows in 3 partitions (4 rows each) -> py (module:function) -> keep."""
    pq.write_table(pa.table({"id": IDS, "text": TEXTS}), root / "in.parquet")
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    py = {"input": "in.parquet", "python": f"{module}:{function}", "partition_rows": 4}
    if fmt:
        py["format"] = fmt
    doc = {"name": "pysteps", "workdir": "work",
           "steps": {"py": py, "keep": after or {"from": "py", "select": ["id", "clean"],
                                                "partition_rows": 4}}}
    path = root / "wf.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def _run(root, path):
    store = open_store(f"sqlite:///{root}/runs.db")
    outcome = run_workflow(load_workflow(path), store, run_date=RUN_DATE)
    return store, {s.step: s for s in store.steps(outcome.run_id)}


@pytest.mark.parametrize("fmt,source", [(None, ARROW_MODULE), ("pandas", PANDAS_MODULE)])
def test_a_python_step_gives_exact_rows_over_three_partitions(tmp_path, fmt, source):
    module = f"tidy_{fmt or 'arrow'}"
    _, steps = _run(tmp_path, _workflow(tmp_path, module, source, fmt=fmt))
    kept, clean, length = _expected()
    py = read_output(tmp_path / "work" / "py")
    assert py.column_names == ["id", "text", "clean", "length"]
    assert py.column("id").to_pylist() == kept
    assert py.column("clean").to_pylist() == clean
    assert py.column("length").to_pylist() == length
    assert sorted(p.name for p in (tmp_path / "work" / "py").glob("part-*")) == \
        ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    keep = read_output(tmp_path / "work" / "keep")
    assert keep.column_names == ["id", "clean"] and keep.column("clean").to_pylist() == clean
    assert (steps["py"].kind, steps["py"].num_input_rows, steps["py"].num_rows,
            steps["py"].num_parts) == ("python", 10, 6, 3)
    config = jobs_output.Output(str(tmp_path / "work" / "py"), {}).read_manifest()["config"]
    assert config["python"] == f"{module}:tidy" and config["format"] == (fmt or "arrow")
    assert len(config["source_sha256"]) == 64


def test_a_failed_partition_resumes_committing_each_part_once(tmp_path, monkeypatch):
    path = _workflow(tmp_path, "tidy_resume", ARROW_MODULE)
    (tmp_path / "FAIL").write_text("")
    commits = collections.Counter()
    real = jobs_output.Output.commit

    def counting(self, table, stats):
        real(self, table, stats)
        if self.path.endswith("/py"):
            commits[stats.name] += 1

    monkeypatch.setattr(jobs_output.Output, "commit", counting)
    store = open_store(f"sqlite:///{tmp_path}/runs.db")
    with pytest.raises(WorkflowError) as failed:
        run_workflow(load_workflow(path), store, run_date=RUN_DATE)
    assert str(failed.value) == (
        f"step 'py' failed: step 'py', part-00001.parquet (rows 4-7 of "
        f"{tmp_path}/in.parquet): tidy_resume:tidy raised ValueError: injected failure "
        "(tidy_resume.py:9 in tidy)")
    first = set(commits)
    assert "part-00001.parquet" not in first

    (tmp_path / "FAIL").unlink()
    outcome = run_workflow(load_workflow(path), store, run_date=RUN_DATE)
    steps = {s.step: s for s in store.steps(outcome.run_id)}
    assert commits == {f"part-0000{i}.parquet": 1 for i in range(3)}
    assert (steps["py"].num_parts, steps["py"].num_parts_kept) == (3, len(first))
    assert read_output(tmp_path / "work" / "py").column("clean").to_pylist() == _expected()[1]


def test_an_edited_function_reruns_the_step_and_an_unchanged_one_keeps_it(tmp_path):
    path = _workflow(tmp_path, "tidy_edit", PANDAS_MODULE, fmt="pandas")
    _run(tmp_path, path)
    _, steps = _run(tmp_path, path)
    assert (steps["py"].num_parts_kept, steps["keep"].num_parts_kept) == (3, 3)

    (tmp_path / "tidy_edit.py").write_text(PANDAS_MODULE.replace(".lower()", ".upper()"))
    _, steps = _run(tmp_path, path)
    assert (steps["py"].num_parts_kept, steps["keep"].num_parts_kept) == (0, 0)
    assert read_output(tmp_path / "work" / "keep").column("clean").to_pylist() == \
        [c.upper() for c in _expected()[1]]


@pytest.mark.parametrize("function,message", [
    ("returns_none", "tidy_bad:returns_none returned None, not a pyarrow Table (format: "
                     "arrow; `format: pandas` passes and takes a DataFrame)"),
    ("drops_clean", "step 'keep', key 'select': column 'clean' is not provided by the table "
                    "tidy_bad:drops_clean returned; its columns are id"),
])
def test_a_bad_return_names_step_partition_and_what_came_back(tmp_path, function, message):
    path = _workflow(tmp_path, "tidy_bad", ARROW_MODULE, function=function)
    with pytest.raises(WorkflowError) as failed:
        _run(tmp_path, path)
    text = str(failed.value)
    assert text.startswith("step 'py' failed: step 'py', part-0000"), text
    assert text.endswith(message), text
    assert not list((tmp_path / "work" / "py").glob("part-*")), "a bad part never commits"


def test_a_dataframe_where_a_table_is_expected_is_named(tmp_path):
    path = _workflow(tmp_path, "tidy_df", PANDAS_MODULE)  # format left at arrow
    with pytest.raises(WorkflowError, match=r"step 'py', part-0000\d\.parquet \(rows \d-\d of "
                       r".*in\.parquet\): tidy_df:tidy raised TypeError: .*\(tidy_df\.py:3 in "
                       r"tidy\)$"):
        _run(tmp_path, path)


def test_parts_that_disagree_on_types_fail_the_step(tmp_path):
    source = '''
import pyarrow as pa

def typed(table):
    ids = table.column("id").to_pylist()
    value = [str(i) for i in ids] if 0 in ids else ids
    return pa.table({"id": ids, "value": value})
'''
    path = _workflow(tmp_path, "tidy_types", source, function="typed",
                     after={"from": "py", "select": ["id"]})
    with pytest.raises(WorkflowError, match="step 'py': tidy_types:typed returned other "
                       "columns or types for part-00001.parquet than for part-00000.parquet"):
        _run(tmp_path, path)


def _problems(tmp_path, python, fmt=None, source=ARROW_MODULE):
    path = _workflow(tmp_path, "tidy_check", source, fmt=fmt)
    doc = yaml.safe_load(open(path))
    doc["steps"]["py"]["python"] = python
    open(path, "w").write(yaml.safe_dump(doc, sort_keys=False))
    return [str(p) for p in check_file(path, None, RUN_DATE).problems]


def test_check_names_step_module_and_function(tmp_path):
    assert _problems(tmp_path, "tidy_check:tidy") == []
    assert _problems(tmp_path, "no_such_mod:tidy") == [
        f"step 'py', key 'python': cannot import module 'no_such_mod' for no_such_mod:tidy: "
        f"No module named 'no_such_mod'; put no_such_mod.py beside the workflow file "
        f"({tmp_path}) or install it where the workers run"]
    assert _problems(tmp_path, "tidy_check:tidyy") == [
        f"step 'py', key 'python': module 'tidy_check' ({tmp_path}/tidy_check.py) has no "
        "function 'tidyy' for tidy_check:tidyy; it defines: drops_clean, returns_none, tidy"]
    assert _problems(tmp_path, "tidy_check:NOT_CALLABLE") == [
        "step 'py', key 'python': tidy_check:NOT_CALLABLE is a int, not a function"]
    assert _problems(tmp_path, "tidy_check") == [
        "step 'py', key 'python': 'tidy_check' is not a function reference; write "
        "module:function, e.g. cleaners:strip_markup (cleaners.py beside the workflow "
        "file, or an installed module)"]
    assert _problems(tmp_path, "tidy_check:tidy", fmt="polars") == [
        "step 'py', key 'format': 'polars' is not one of arrow, pandas"]
    assert _problems(tmp_path, "tidy_check:tidy", source="def tidy(:\n") == [
        "step 'py', key 'python': importing module 'tidy_check' for tidy_check:tidy raised "
        "SyntaxError: invalid syntax (tidy_check.py, line 1)"]


def test_check_notes_the_columns_after_a_python_step(tmp_path):
    path = _workflow(tmp_path, "tidy_notes", ARROW_MODULE)
    report = check_file(path, None, RUN_DATE)
    assert report.problems == []
    assert report.notes == ["keep: columns checked as the run goes: step 'py' is a python "
                            "step, whose columns are known from what its function returns"]


WORKER_MODULE = '''
import os
import pandas as pd
from distributed import get_worker

def words(df):
    return pd.DataFrame({"id": df["id"], "num_words": df["generated_text"].str.split().str.len(),
                         "worker": get_worker().address, "pid": os.getpid()})
'''


def test_after_a_generate_step_it_runs_on_the_same_client(tmp_path, monkeypatch):
    import fusegen.jobs
    from jobs_fixtures import tiny_model_dir

    opened = []
    real = fusegen.jobs.open_client

    def counting(spec):
        opened.append(spec)
        return real(spec)

    monkeypatch.setattr(fusegen.jobs, "open_client", counting)
    pq.write_table(pa.table({"id": list(range(6)), "topic": [f"topic {i}" for i in range(6)]}),
                   tmp_path / "topics.parquet")
    (tmp_path / "words_gen.py").write_text(WORKER_MODULE)
    doc = {"name": "genpy", "workdir": "work",
           "defaults": {"model": tiny_model_dir(), "max_tokens": 4, "temperature": 0,
                        "partition_rows": 3, "progress": "none"},
           "steps": {"draft": {"input": "topics.parquet", "generate": {"prompt_column": "topic"}},
                     "count": {"from": "draft", "python": "words_gen:words", "format": "pandas",
                               "partition_rows": 2}}}
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    _, steps = _run(tmp_path, str(tmp_path / "wf.yaml"))

    draft = read_output(tmp_path / "work" / "draft")
    count = read_output(tmp_path / "work" / "count")
    assert count.column("id").to_pylist() == list(range(6))
    assert count.column("num_words").to_pylist() == [
        len(t.split()) for t in draft.column("generated_text").to_pylist()]
    assert {w.split("://")[0] for w in count.column("worker").to_pylist()} == {"inproc"}
    assert len(opened) == 1, "the python step reuses the generate step's client"
    # 2 draft parts of 3 rows, 2 rows a partition
    assert (steps["count"].num_parts, steps["count"].num_rows) == (4, 6)


def test_worker_processes_import_the_module_beside_the_workflow_file(tmp_path):
    """Two worker processes: the module is found through the workflow file's directory,
    and the reading step's filter reaches the tasks."""
    import os

    source = '''
import os
import pyarrow as pa

def tag(table):
    return table.append_column("pid", pa.array([os.getpid()] * table.num_rows))
'''
    # the filter travels to the workers with the task, which checks the columns it reads
    path = _workflow(tmp_path, "tag_procs", source, function="tag",
                     after={"from": "py", "filter": "pid > 0 and len(text) > 0",
                            "select": ["id", "pid"]})
    doc = yaml.safe_load(open(path))
    doc["defaults"] = {"workers": 2, "partitions_per_worker": 1}
    open(path, "w").write(yaml.safe_dump(doc, sort_keys=False))
    _, steps = _run(tmp_path, path)
    keep = read_output(tmp_path / "work" / "keep")
    assert keep.column("id").to_pylist() == IDS
    pids = set(keep.column("pid").to_pylist())
    assert os.getpid() not in pids and 1 <= len(pids) <= 2
    assert steps["py"].num_parts == 3


def test_the_example_explodes_json_answers_into_topics(tmp_path):
    import hashlib
    from pathlib import Path

    from fusegen.workflows.resolve import resolve

    examples = Path(__file__).resolve().parent.parent / "workflows" / "examples"
    wf = load_workflow(str(examples / "review_topics.yaml"))
    pq.write_table(pa.table({"review_id": [1, 2], "review": ["ok", "bad"]}),
                   tmp_path / "reviews.parquet")
    resolved = resolve(wf, {"reviews": str(tmp_path / "reviews.parquet"),
                            "model": str(tmp_path / "model"), "out": str(tmp_path / "out")},
                       RUN_DATE)
    label, topics, named = resolved.steps
    assert (topics.kind, topics.python.ref, topics.python.format, topics.readers) == \
        ("python", "review_tools:explode_topics", "pandas", [named])
    assert topics.python.source_sha256 == hashlib.sha256(
        (examples / "review_tools.py").read_bytes()).hexdigest()
    answers = pa.table({
        "review_id": [1, 2, 3, 4, 5],
        "generated_text": ['{"topics": ["Battery", " battery ", "UI"]}', None, "not json",
                           '{"topics": "price"}', '{"topics": ["Price", "shipping"]}'],
        "error": [None, "null_prompt", None, None, None]})
    table = topics.python.apply(topics.python.load("topics"), answers, "test")
    assert table.to_pydict() == {"review_id": [1, 1, 5, 5],
                                 "topic": ["battery", "ui", "price", "shipping"]}
    assert named.transform.apply(table).column("topic").to_pylist() == \
        ["battery", "price", "shipping"]


def test_steps_after_a_python_step_are_checked_once_their_input_exists(tmp_path):
    from click.testing import CliRunner

    from fusegen.jobs.cli import main

    path = _workflow(tmp_path, "tidy_late", ARROW_MODULE)
    doc = yaml.safe_load(open(path))
    doc["steps"]["final"] = {"from": "keep", "select": ["length"]}  # keep dropped it
    open(path, "w").write(yaml.safe_dump(doc, sort_keys=False))
    result = CliRunner().invoke(main, ["workflow", "check", path, "--run-date", RUN_DATE])
    assert result.exit_code == 0, result.output
    assert "py (python): " in result.output and "columns: what its function returns" in \
        result.output
    assert "final: columns checked as the run goes: step 'keep' follows a python step" in \
        result.output

    with pytest.raises(WorkflowError) as failed:
        _run(tmp_path, path)
    assert str(failed.value) == (
        f"step 'final' failed: workflow {path} is not valid:\n  - step 'final', key "
        "'select': column 'length' is not provided by step 'keep'; its columns are id, clean")
    assert not (tmp_path / "work" / "final").exists()


def test_two_workflows_with_same_named_modules_each_get_their_own(tmp_path):
    from fusegen.workflows.pyfunc import PythonFunction

    table = pa.table({"id": [1]})
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shared_name.py").write_text(
            f"def f(t):\n    return t.append_column('who', [[{name!r}]])\n")
    found = {name: PythonFunction.find("shared_name:f", "arrow", str(tmp_path / name))
             for name in ("a", "b", "a")}
    for name, function in found.items():
        out = function.apply(function.load("py"), table, "test")
        assert out.column("who").to_pylist() == [name]
    assert found["a"].source_sha256 != found["b"].source_sha256


def test_a_worker_whose_module_differs_from_the_drivers_is_refused(tmp_path):
    import dataclasses

    from fusegen.workflows.pyfunc import PythonFunction

    (tmp_path / "drifted.py").write_text("def f(t):\n    return t\n")
    function = PythonFunction.find("drifted:f", "arrow", str(tmp_path))
    other = dataclasses.replace(function, source_sha256="0" * 64)  # what another file hashed
    with pytest.raises(WorkflowError) as refused:
        other.load("py")
    assert str(refused.value) == (
        f"step 'py': the worker's module 'drifted' ({tmp_path}/drifted.py) is not the file "
        "the driver read for drifted:f; install the same version on every worker, or keep "
        "it beside the workflow file on storage every worker reads")


def test_a_python_step_takes_no_transform_or_generate_keys(tmp_path):
    from fusegen.workflows.spec import load_checked

    path = _workflow(tmp_path, "tidy_keys", ARROW_MODULE)
    doc = yaml.safe_load(open(path))
    doc["steps"]["py"]["filter"] = "id > 1"
    doc["steps"]["keep"]["format"] = "pandas"
    doc["steps"]["gen"] = {"from": "py", "python": "tidy_keys:tidy", "generate": {"model": "m"}}
    open(path, "w").write(yaml.safe_dump(doc, sort_keys=False))
    assert [str(p) for p in load_checked(path)[1]] == [
        "step 'py', key 'filter': a python step's function does its own filtering and "
        "selecting; put this transform in its own step (`from: py`)",
        "step 'keep', key 'format': only a python step (`python: module:function`) takes a "
        "format",
        "step 'gen', key 'python': a step either generates or runs a function; move this "
        "to its own step (`from: gen`)"]
