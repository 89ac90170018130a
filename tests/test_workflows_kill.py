"""A `fusegen workflow run` process SIGKILLed mid-step, then rerun: the killed run's lock
is taken over (its process is gone), committed parts are kept, and the result equals an
uninterrupted run's."""
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from jobs_fixtures import read_output, sigkill_when, tiny_model_dir
from fusegen.workflows.run import run_workflow
from fusegen.workflows.spec import load_workflow
from fusegen.workflows.store import open_store

RUN_DATE = "2024-06-02"
NUM_ROWS, PARTITION_ROWS = 96, 8


def _setup(root: Path) -> str:
    root.mkdir()
    pq.write_table(pa.table({"id": list(range(NUM_ROWS)),
                             "prompt": [f"prompt {i}" for i in range(NUM_ROWS)]}),
                   root / "in.parquet", row_group_size=PARTITION_ROWS)
    doc = {"name": "killme", "workdir": "work/{{ run_date }}",
           "defaults": {"model": tiny_model_dir(), "max_tokens": 16, "temperature": 0.8,
                        "partition_rows": PARTITION_ROWS, "max_num_seqs": 8, "progress": "none",
                        "partitions_per_worker": 1},
           "steps": {"draft": {"input": "in.parquet", "generate": {}},
                     "short": {"from": "draft", "filter": "id % 3 != 0",
                               "select": ["id", "generated_text"],
                               "rename": {"generated_text": "first"}},
                     "again": {"from": "short", "output": "out/{{ run_date }}",
                               "generate": {"prompt_template": "More: {{ first }}",
                                            "max_tokens": 4}}}}
    (root / "wf.yaml").write_text(yaml.safe_dump(doc))
    return str(root / "wf.yaml")


def _parts(path: Path) -> int:
    return len(list(path.glob("part-*.parquet"))) if path.exists() else 0


def test_sigkilled_run_reruns_to_the_uninterrupted_result(tmp_path):
    ref = _setup(tmp_path / "ref")
    run_workflow(load_workflow(ref), open_store(tmp_path / "ref" / "runs.db"), run_date=RUN_DATE)
    expected = read_output(tmp_path / "ref" / "out" / RUN_DATE)
    assert expected.num_rows == NUM_ROWS - NUM_ROWS // 3

    root = tmp_path / "run"
    wf = _setup(root)
    store_url = f"sqlite:///{root}/runs.db"
    draft = root / "work" / RUN_DATE / "draft"
    sigkill_when([sys.executable, "-m", "fusegen.jobs.cli", "workflow", "run", wf,
                  "--run-date", RUN_DATE, "--store", store_url], tmp_path / "log",
                 lambda: _parts(draft) >= 2, "the run's first committed parts", timeout=120)
    kept = _parts(draft)
    assert 2 <= kept < NUM_ROWS // PARTITION_ROWS, (tmp_path / "log").read_text()
    store = open_store(store_url)
    [killed] = store.runs()
    assert killed.status == "running"  # nobody recorded its end: its lock is dead

    outcome = run_workflow(load_workflow(wf), store, run_date=RUN_DATE)
    killed, rerun = store.run(killed.run_id), store.run(outcome.run_id)
    assert killed.status == "interrupted" and "stopped" in killed.error
    assert (rerun.status, rerun.resumes) == ("succeeded", killed.run_id)
    draft_step = store.steps(outcome.run_id)[0]
    assert draft_step.num_parts == NUM_ROWS // PARTITION_ROWS
    assert draft_step.num_parts_kept >= kept
    assert read_output(root / "out" / RUN_DATE).equals(expected)
    assert read_output(draft).equals(read_output(tmp_path / "ref" / "work" / RUN_DATE / "draft"))
