"""`fusegen workflow run` end to end on the tiny real model: generate -> filter -> generate
with exact row counts per step, one engine load shared by both generate steps, the run
store's record of it, and a failed run that a rerun completes to the same result."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from fusegen.jobs import engines
from fusegen.workflows import steps as wf_steps
from fusegen.jobs.cli import main
from jobs_fixtures import read_output, tiny_model_dir
from fusegen.workflows.errors import WorkflowError
from fusegen.workflows.run import run_workflow
from fusegen.workflows.spec import load_workflow
from fusegen.workflows.store import open_store

RUN_DATE = "2024-05-01"
NULL_TOPICS = (3, 6)
KEPT_IDS = [0, 2, 4, 8, 10]  # even ids with a generated row (3 and 6 are error rows)


def _workflow_file(root, **keep_overrides) -> str:
    """12 topics (2 null) -> draft -> keep even ids, no errors -> expand."""
    ids = list(range(12))
    if not (root / "topics.parquet").exists():  # rewritten, it would be another input
        pq.write_table(pa.table({"id": ids, "topic": [None if i in NULL_TOPICS else
                                                     f"topic {i}" for i in ids]}),
                       root / "topics.parquet")
    keep = {"from": "draft", "drop_errors": True, "filter": "id % {{ modulus }} == 0",
            "select": ["id", "generated_text"], "rename": {"generated_text": "headline"},
            "partition_rows": 3, **keep_overrides}
    doc = {
        "name": "headlines",
        "params": {"modulus": 2},
        "workdir": "work/{{ run_date }}",
        "defaults": {"model": tiny_model_dir(), "max_tokens": 4, "temperature": 0.7,
                     "seed": 7, "partition_rows": 4, "progress": "none"},
        "steps": {
            "draft": {"input": "topics.parquet", "generate": {"prompt_column": "topic"}},
            "keep": keep,
            "expand": {"from": "keep", "output": "out/{{ run_date }}/articles",
                       "generate": {"prompt_template": "Expand ({{ run_date }}): {{ headline }}"}},
        },
    }
    path = root / "headlines.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


@pytest.fixture
def loads(monkeypatch):
    """Counts engine loads (the real tiny engine still loads)."""
    calls = []
    real = engines._load

    def counting(model, kwargs):
        calls.append(model)
        return real(model, kwargs)

    monkeypatch.setattr(engines, "_load", counting)
    return calls


def test_generate_filter_generate_exact_rows_and_one_engine_load(tmp_path, loads):
    store = open_store(f"sqlite:///{tmp_path}/runs.db")
    outcome = run_workflow(load_workflow(_workflow_file(tmp_path)), store, run_date=RUN_DATE)

    draft = read_output(tmp_path / "work" / RUN_DATE / "draft")
    assert draft.num_rows == 12
    assert draft.column("id").to_pylist() == list(range(12))
    errors = draft.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e is not None] == list(NULL_TOPICS)
    keep = read_output(tmp_path / "work" / RUN_DATE / "keep")
    assert keep.column_names == ["id", "headline"]
    assert keep.column("id").to_pylist() == KEPT_IDS
    assert keep.column("headline").to_pylist() == [
        draft.column("generated_text")[i].as_py() for i in KEPT_IDS]
    final = read_output(tmp_path / "out" / RUN_DATE / "articles")
    assert final.column("id").to_pylist() == KEPT_IDS
    assert final.column("error").null_count == 5
    assert all(n == 4 for n in final.column("num_generated_tokens").to_pylist())

    assert len(loads) == 1, "both generate steps use one model: loaded once, shared"
    steps = {s.step: s for s in store.steps(outcome.run_id)}
    assert [(n, s.status, s.num_input_rows, s.num_rows, s.num_errors) for n, s in steps.items()] \
        == [("draft", "succeeded", 12, 12, 2), ("keep", "succeeded", 12, 5, 0),
            ("expand", "succeeded", 5, 5, 0)]
    assert steps["draft"].errors_by_code == {"null_prompt": 2}
    assert steps["expand"].num_generated_tokens == 20
    assert steps["keep"].num_parts == 6  # 3 draft parts of 4 rows, 3 rows per partition
    run = store.run(outcome.run_id)
    assert (run.status, run.run_date, run.params, run.trigger) == \
        ("succeeded", RUN_DATE, {"modulus": 2}, "manual")


def test_param_override_changes_the_filter(tmp_path):
    store = open_store(f"sqlite:///{tmp_path}/runs.db")
    wf = load_workflow(_workflow_file(tmp_path))
    run_workflow(wf, store, run_date=RUN_DATE, params={"modulus": 4})
    assert read_output(tmp_path / "out" / RUN_DATE / "articles").column("id").to_pylist() \
        == [0, 4, 8]


def test_failed_run_reruns_to_the_uninterrupted_result(tmp_path, monkeypatch):
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), dir_.mkdir()
    run_workflow(load_workflow(_workflow_file(ref_dir)), open_store(ref_dir / "runs.db"),
                 run_date=RUN_DATE)
    reference = read_output(ref_dir / "out" / RUN_DATE / "articles")

    store = open_store(dir_ / "runs.db")
    wf = load_workflow(_workflow_file(dir_))
    real, calls = wf_steps._transform_part, []

    def fail_second_part(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return real(*args)

    monkeypatch.setattr(wf_steps, "_transform_part", fail_second_part)
    with pytest.raises(WorkflowError, match="step 'keep' failed: .*disk full"):
        run_workflow(wf, store, run_date=RUN_DATE)
    failed = store.runs()[0]
    assert failed.status == "failed" and "disk full" in failed.error
    assert [(s.step, s.status) for s in store.steps(failed.run_id)] == \
        [("draft", "succeeded"), ("keep", "failed"), ("expand", "pending")]
    assert sorted(p.name for p in (dir_ / "work" / RUN_DATE / "keep").glob("part-*")) \
        == ["part-00000.parquet"]

    monkeypatch.setattr(wf_steps, "_transform_part", real)
    outcome = run_workflow(wf, store, run_date=RUN_DATE)
    steps = {s.step: s for s in store.steps(outcome.run_id)}
    assert (steps["draft"].num_parts, steps["draft"].num_parts_kept) == (3, 3)
    assert (steps["keep"].num_parts, steps["keep"].num_parts_kept) == (6, 1)
    assert steps["expand"].num_parts_kept == 0
    assert store.run(outcome.run_id).resumes == failed.run_id
    assert read_output(dir_ / "out" / RUN_DATE / "articles").equals(reference)


def test_cli_run_history_show(tmp_path):
    wf = _workflow_file(tmp_path)
    store = f"sqlite:///{tmp_path}/runs.db"
    runner = CliRunner()
    result = runner.invoke(main, ["workflow", "run", wf, "--run-date", RUN_DATE,
                                  "--param", "modulus=4", "--store", store])
    assert result.exit_code == 0, result.output
    assert "step keep: 12 rows in, 3 out" in result.output
    assert "run 1 of headlines (2024-05-01) succeeded" in result.output

    history = runner.invoke(main, ["workflow", "history", wf, "--store", store])
    assert history.exit_code == 0, history.output
    steps = open_store(store).steps(1)
    tokens = sum(s.num_generated_tokens for s in steps)
    row = history.output.splitlines()[1].split()
    assert row[:5] == ["1", "headlines", "succeeded", "manual", RUN_DATE]
    assert row[-3:] == ["3", str(tokens), "2"]  # last step's rows out, generated tokens, errors

    show = runner.invoke(main, ["workflow", "show", "1", "--store", store])
    assert show.exit_code == 0, show.output
    lines = show.output.splitlines()
    assert "params: {'modulus': 4}" in show.output
    table = {ln.split()[0]: ln.split() for ln in lines
             if ln.startswith(("draft ", "keep ", "expand "))}
    # STEP KIND STATUS STARTED(2) FINISHED(2) IN OUT ERRORS PROMPT GEN PARTS (KEPT)
    assert table["draft"][:3] == ["draft", "generate", "succeeded"]
    assert table["draft"][7:10] == ["12", "12", "2"]
    assert table["draft"][11:] == [str(steps[0].num_generated_tokens), "3", "(0)"]
    assert table["keep"][7:10] == ["12", "3", "0"]
    assert table["expand"][7:10] == ["3", "3", "0"]
    assert "draft: error rows: null_prompt 2" in show.output

    missing = runner.invoke(main, ["workflow", "show", "9", "--store", store])
    assert missing.exit_code == 1 and "no run 9" in missing.output


def test_an_edited_file_recomputes_intermediates_but_guards_explicit_outputs(tmp_path):
    store = open_store(tmp_path / "runs.db")
    run_workflow(load_workflow(_workflow_file(tmp_path)), store, run_date=RUN_DATE)
    edited = load_workflow(_workflow_file(tmp_path, filter="id % 2 == 0 and id > 0"))
    with pytest.raises(WorkflowError, match="step 'expand' failed: output .* holds parts made "
                       "from an earlier version of its input .* --overwrite"):
        run_workflow(edited, store, run_date=RUN_DATE)
    steps = {s.step: s for s in store.steps(store.runs()[0].run_id)}
    assert (steps["draft"].num_parts_kept, steps["keep"].num_parts_kept) == (3, 0)
    assert steps["keep"].num_rows == 4  # recomputed from the edited filter, no --overwrite
    run_workflow(edited, store, run_date=RUN_DATE, overwrite=True)
    assert read_output(tmp_path / "out" / RUN_DATE / "articles").column("id").to_pylist() \
        == KEPT_IDS[1:]


def test_cli_failed_run_then_resume(tmp_path, monkeypatch):
    wf = _workflow_file(tmp_path)
    store = f"sqlite:///{tmp_path}/runs.db"
    real = wf_steps._transform_part

    def broken(*args):
        raise OSError("bucket unreachable (injected)")

    monkeypatch.setattr(wf_steps, "_transform_part", broken)
    runner = CliRunner()
    failed = runner.invoke(main, ["workflow", "run", wf, "--run-date", RUN_DATE, "--store", store])
    assert failed.exit_code == 1
    assert "step 'keep' failed: OSError: bucket unreachable" in failed.output
    assert f"fusegen workflow run {wf} --run-date {RUN_DATE} --store {store}" in failed.output
    monkeypatch.setattr(wf_steps, "_transform_part", real)
    resumed = runner.invoke(main, ["workflow", "resume", "1", "--store", store])
    assert resumed.exit_code == 0, resumed.output
    assert "step draft: 12 rows in, 12 out (3 parts, 3 kept from an earlier attempt)" \
        in resumed.output
    show = runner.invoke(main, ["workflow", "show", "2", "--store", store])
    assert "continues run 1" in show.output and "status: succeeded" in show.output
    show = runner.invoke(main, ["workflow", "show", "1", "--store", store])
    assert "keep: failed: OSError: bucket unreachable (injected)" in show.output
