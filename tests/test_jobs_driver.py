"""The driver over an in-process Dask cluster with the fake engine: outputs, manifest,
resume, refusal, early failures, memory:// storage."""
import json
import os

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusegen.jobs import engines
from fusegen.jobs.errors import JobError
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import FakeLLM, fake_engine, read_output, write_prompts  # noqa: F401


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _spec(model, inp, out, **kw):
    kw = {"max_tokens": 3, "partition_rows": 4, "progress": "none", **kw}
    return JobSpec(model=model, input=str(inp), output=str(out), **kw)


def _refusal(spec) -> str:
    """The message of the JobError that run_job(spec) raises."""
    with pytest.raises(JobError) as info:
        run_job(spec)
    return str(info.value)


def test_every_row_once_with_input_columns_and_error_rows(fake_engine, tmp_path):
    write_prompts(tmp_path / "a.parquet", 6, extra=[f"x{i}" for i in range(6)],
                  row_group_size=2)
    t = pa.table({"id": [100, 101, 102, 103], "prompt": ["p", None, "", "y" * 80],
                  "extra": ["e"] * 4, "max_tokens": [2, None, None, -5]})
    pq.write_table(t, tmp_path / "b.parquet")
    res = run_job(_spec(fake_engine, tmp_path / "*.parquet", tmp_path / "out",
                        id_column="id", output_token_ids=True))
    out = read_output(tmp_path / "out")
    assert out.column("id").to_pylist() == list(range(6)) + [100, 101, 102, 103]
    rows = {r["id"]: r for r in out.to_pylist()}
    assert rows[0]["num_generated_tokens"] == 3 and len(rows[0]["generated_text"]) == 3
    assert rows[0]["generated_token_ids"] == [ord(c) for c in rows[0]["generated_text"]]
    assert rows[0]["num_prompt_tokens"] == 1 + len("prompt 0")
    assert rows[100]["num_generated_tokens"] == 2  # per-row max_tokens
    assert rows[101]["error"] == "null_prompt: row 7 (id=101): column 'prompt' is null"
    assert rows[102]["error"].startswith("empty_prompt: row 8 (id=102)")
    assert rows[103]["error"].startswith("invalid_params: row 9 (id=103): max_tokens")
    assert [rows[i]["finish_reason"] for i in (101, 102, 103)] == ["error"] * 3
    assert rows[101]["generated_text"] is None
    assert res.num_rows == 10 and res.num_errors == 3
    assert res.errors_by_code == {"null_prompt": 1, "empty_prompt": 1, "invalid_params": 1}
    assert sorted(os.listdir(tmp_path / "out")) == ["_manifest.json"] + [
        f"part-0000{i}.parquet" for i in range(3)]  # a: 4+2 rows, b: 4 rows


def test_input_column_sets_are_kept_per_file(fake_engine, tmp_path):
    write_prompts(tmp_path / "a.parquet", 3, lang=["fr"] * 3)
    out = run_job(_spec(fake_engine, tmp_path / "a.parquet", tmp_path / "out"))
    table = read_output(tmp_path / "out")
    assert table.column_names[:3] == ["id", "prompt", "lang"]
    assert table.column_names[3:] == ["generated_text", "finish_reason", "num_prompt_tokens",
                                      "num_generated_tokens", "error", "completion_index",
                                      "error_code", "row_id"]
    assert table.column("row_id").to_pylist() == [0, 1, 2]
    assert out.num_generated_tokens == 9


def test_prompt_too_long_from_engine_is_an_error_row(fake_engine, tmp_path):
    pq.write_table(pa.table({"prompt": ["ok", "z" * 100]}), tmp_path / "in.parquet")
    run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out"))
    err = read_output(tmp_path / "out").column("error").to_pylist()
    assert err[0] is None and err[1] == "prompt_too_long: row 1: 101 tokens > max_model_len 64"


def test_manifest_records_config_parts_counts_and_no_secrets(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 9)
    run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out",
                  storage_options={"auto_mkdir": True, "password": "pa55word"}))
    text = (tmp_path / "out" / "_manifest.json").read_text()
    m = json.loads(text)
    assert "pa55word" not in text and m["config"]["storage_options"]["password"] == "***"
    assert m["status"] == "complete" and m["num_partitions"] == 3
    assert [p["num_rows"] for p in m["parts"]] == [4, 4, 1]
    assert [p["input_rows"] for p in m["parts"]] == [[0, 4], [4, 8], [8, 9]]
    assert m["totals"]["num_generated_tokens"] == 27
    data = (tmp_path / "in.parquet").read_bytes()
    assert m["inputs"] == [{"path": str(tmp_path / "in.parquet"), "num_rows": 9,
                            "size": len(data), "version": f"sha256={_sha256(data)}"}]
    assert len(m["runs"]) == 1 and m["runs"][0]["parts_computed"] == 3


def test_resume_recomputes_only_missing_parts(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 20)
    spec = _spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out")
    run_job(spec)
    before = read_output(tmp_path / "out")
    os.remove(tmp_path / "out" / "part-00001.parquet")
    os.remove(tmp_path / "out" / "part-00004.parquet")
    (tmp_path / "out" / "part-00002.parquet").write_bytes(b"damaged")
    os.makedirs(tmp_path / "out" / "_tmp")
    (tmp_path / "out" / "_tmp" / "part-00001.parquet.dead").write_bytes(b"torn")
    res = run_job(spec)
    assert (res.num_parts, res.num_parts_skipped, res.rows_computed) == (5, 2, 12)
    assert read_output(tmp_path / "out").equals(before)
    assert not (tmp_path / "out" / "_tmp").exists()
    assert len(json.loads((tmp_path / "out" / "_manifest.json").read_text())["runs"]) == 2
    assert run_job(spec).num_parts_skipped == 5  # complete: nothing to run


def test_different_config_refuses_unless_overwrite(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 5)
    run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out"))
    changed = _spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out", temperature=0.5)
    with pytest.raises(JobError, match=r"holds a different job \(changed: temperature: 1.0 -> "
                                       r"0.5\); rerun with --overwrite"):
        run_job(changed)
    changed.overwrite = True
    assert run_job(changed).num_parts_skipped == 0


def test_foreign_parts_without_manifest_refuse(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 5)
    os.makedirs(tmp_path / "out")
    write_prompts(tmp_path / "out" / "part-00000.parquet", 1)
    with pytest.raises(JobError, match="holds part files but no _manifest.json"):
        run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out"))


def test_failures_before_any_generation(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 5)
    with pytest.raises(JobError, match="input .*nothere.parquet does not exist"):
        run_job(_spec(fake_engine, tmp_path / "nothere.parquet", tmp_path / "o1"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(JobError, match="cannot read input"):
        run_job(_spec(fake_engine, tmp_path / "bad.parquet", tmp_path / "o2"))
    with pytest.raises(JobError, match=r"'text' \(from --prompt-column\) not in the input"):
        run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "o3",
                      prompt_column="text"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(JobError, match="is not writable"):
        run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "file" / "out"))
    assert FakeLLM.instances == []  # nothing loaded so far
    with pytest.raises(JobError, match="loading the model: .*missing/config.json: not found"):
        run_job(_spec(str(tmp_path / "missing"), tmp_path / "in.parquet", tmp_path / "o4"))
    assert not [p for p in os.listdir(tmp_path / "o4") if p.startswith("part-")]


def test_memory_filesystem_in_and_out(fake_engine):
    fs = fsspec.filesystem("memory")
    with fs.open("/jobs-in/data/a.parquet", "wb") as f:
        pq.write_table(pa.table({"prompt": [f"m{i}" for i in range(7)]}), f)
    with fs.open("/jobs-in/data/_ignored.parquet", "wb") as f:
        f.write(b"metadata files are skipped")
    try:
        res = run_job(_spec(fake_engine, "memory://jobs-in/data", "memory://jobs-out/run"))
        out = read_output(fs, "/jobs-out/run")
        assert out.column("prompt").to_pylist() == [f"m{i}" for i in range(7)]
        assert res.num_parts == 2 and fs.exists("/jobs-out/run/_manifest.json")
    finally:
        fs.rm("/jobs-in", recursive=True)
        fs.rm("/jobs-out", recursive=True)


def test_running_partitions_report_progress_before_they_commit(fake_engine, tmp_path,
                                                               monkeypatch):
    from fusegen.jobs import driver
    from fusegen.jobs.progress import Progress

    seen = []
    monkeypatch.setattr(Progress, "partial", lambda self, index, rows, tokens, errors, worker,
                        engine: seen.append((index, rows, tokens, errors, engine)))
    monkeypatch.setattr(engines, "_load",
                        lambda m, kw: FakeLLM(m, step_seconds=0.05, **kw))
    write_prompts(tmp_path / "in.parquet", 8)
    spec = _spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out", max_tokens=12,
                 partition_rows=8, max_num_seqs=4)  # two waves of 12 steps: ~1.2 s
    driver.run_job(spec)
    assert seen[:-1] and all(index == 0 and 0 <= rows < 8 for index, rows, *_ in seen[:-1])
    # the first wave of four rows, 12 tokens each; no errors; the fake has no scheduler
    assert (0, 4, 48, 0, None) in seen
    assert seen[-1] == (0, 8, 96, 0, None)  # once more as the part's last row finished


def test_resume_decision_policy():
    from fusegen.jobs.output import FRESH, OVERWRITE, RESUME, resume_mode

    old = {"fingerprint": "a", "config": {"max_tokens": 8, "seed": 0}}
    assert resume_mode(None, "a", {}, False, False, "o") == FRESH
    assert resume_mode(old, "a", {}, True, False, "o") == RESUME
    assert resume_mode(old, "b", {"max_tokens": 9, "seed": 0}, False, False, "o") == FRESH
    assert resume_mode(old, "b", {}, True, True, "o") == OVERWRITE
    with pytest.raises(JobError, match=r"changed: max_tokens: 8 -> 9\)"):
        resume_mode(old, "b", {"max_tokens": 9, "seed": 0}, True, False, "o")
    with pytest.raises(JobError, match="changed: the input files or their row counts"):
        resume_mode(old, "b", {"max_tokens": 8, "seed": 0}, True, False, "o")


def test_each_worker_engine_loads_on_its_assigned_gpu(fake_engine, tmp_path, monkeypatch):
    from fusegen.jobs import cluster

    loads = []
    monkeypatch.setattr(cluster, "_num_visible_gpus", lambda: 2)
    monkeypatch.setattr(engines, "_load",
                        lambda m, kw: loads.append(kw["device"]) or FakeLLM(m, **kw))
    write_prompts(tmp_path / "in.parquet", 9)
    spec = _spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out")
    run_job(spec)
    assert loads == ["cuda:0"]  # loaded once: all 3 partitions found the worker's engine
    m = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert len(m["runs"][0]["engine_stats"]) == 1  # and so did engine_stats
    assert m["fingerprint"] == spec.fingerprint(m["inputs"])
    os.remove(tmp_path / "out" / "part-00001.parquet")
    monkeypatch.setattr(cluster, "_num_visible_gpus", lambda: 0)
    # same job, other assignment: same fingerprint, so it resumes
    assert run_job(spec).num_parts_skipped == 2
    assert loads == ["cuda:0", "auto"]


def _old_part(path, num_rows: int, record: dict):
    table = pa.table({"prompt": [f"p{i}" for i in range(num_rows)]})
    pq.write_table(table.replace_schema_metadata({b"fusegen": json.dumps(record).encode()}), path)


def test_parts_written_by_earlier_versions_resume(tmp_path):
    from fusegen.jobs.output import Output, input_records, output_fingerprint
    from fusegen.jobs.plan import plan_partitions
    from fusegen.jobs.storage import list_input_files

    write_prompts(tmp_path / "in.parquet", 10)
    files = list_input_files(str(tmp_path / "in.parquet"), {})
    plan = plan_partitions(files, 4)  # 4 + 4 + 2 rows
    fp = output_fingerprint({"k": 1}, input_records(files))
    out = tmp_path / "out"
    out.mkdir()
    (out / "_manifest.json").write_text(json.dumps({"fingerprint": fp, "config": {"k": 1}}))
    # a generation part's record, and a transform part's (a filter kept 1 of 2 rows)
    _old_part(out / "part-00000.parquet", 4, {
        "name": "part-00000.parquet", "fingerprint": fp, "num_rows": 4, "num_errors": 0,
        "errors_by_code": {}, "num_prompt_tokens": 8, "num_generated_tokens": 12,
        "seconds": 0.5})
    _old_part(out / "part-00002.parquet", 1, {
        "name": "part-00002.parquet", "fingerprint": fp, "num_input_rows": 2, "num_rows": 1,
        "num_errors": 0, "seconds": 0.1})
    _old_part(out / "part-00001.parquet", 3, {  # short: its record says 4 rows
        "name": "part-00001.parquet", "fingerprint": fp, "num_rows": 4})
    old, done = Output(str(out), {}).prepare(fp, {"k": 1}, plan, overwrite=False)
    assert old == {"fingerprint": fp, "config": {"k": 1}}
    assert sorted(done) == [0, 2]
    assert (done[0].num_generated_tokens, done[0].num_input_rows) == (12, None)
    assert (done[2].num_rows, done[2].num_input_rows) == (1, 2)


def test_an_input_rewritten_in_place_is_refused_like_a_changed_config(fake_engine, tmp_path):
    inp = tmp_path / "in.parquet"
    write_prompts(inp, 10)
    spec = _spec(fake_engine, inp, tmp_path / "out")
    run_job(spec)
    os.remove(tmp_path / "out" / "part-00001.parquet")  # as if killed before it committed
    before = inp.read_bytes()
    pq.write_table(pa.table({"id": list(range(10)),
                             "prompt": [f"prompt {9 - i}" for i in range(10)]}), inp)
    after = inp.read_bytes()
    assert len(after) == len(before)  # same rows, same size: only the content moved
    assert _refusal(spec) == (
        f"output {tmp_path / 'out'} holds a different job (changed: input {inp} was "
        f"rewritten (version 'sha256={_sha256(before)}' -> 'sha256={_sha256(after)}')); "
        "rerun with --overwrite to start afresh, or choose another --output")
    assert sorted(os.listdir(tmp_path / "out")) == ["_manifest.json", "part-00000.parquet",
                                                    "part-00002.parquet"]
    spec.overwrite = True
    run_job(spec)
    assert read_output(tmp_path / "out").column("prompt").to_pylist() == [
        f"prompt {9 - i}" for i in range(10)]


@pytest.mark.parametrize("option", [{"workers": 2}, {"scheduler": "tcp://127.0.0.1:1"}])
@pytest.mark.parametrize("where", ["input", "output"])
def test_memory_urls_with_worker_processes_are_refused(fake_engine, tmp_path, option, where):
    write_prompts(tmp_path / "in.parquet", 3)
    urls = {"input": str(tmp_path / "in.parquet"), "output": str(tmp_path / "out"),
            where: f"memory://fusegen-{where}/x"}
    spec = _spec(fake_engine, urls["input"], urls["output"], **option)
    flag = "--workers 2" if "workers" in option else "--scheduler tcp://127.0.0.1:1"
    assert _refusal(spec) == (
        f"{where} memory://fusegen-{where}/x is in this process's memory, which the worker "
        f"processes of {flag} cannot reach; use a shared filesystem or object store, or "
        "one in-process worker (--workers 1, no --scheduler)")
    assert not os.path.exists(tmp_path / "out") and FakeLLM.instances == []


def test_the_memory_plan_is_printed_only_when_an_engine_loads(fake_engine, tmp_path,
                                                              monkeypatch):
    from fusegen.jobs.cluster import open_client
    from fusegen.jobs.progress import Progress

    notes = []
    monkeypatch.setattr(Progress, "message", lambda self, text: notes.append(text))
    write_prompts(tmp_path / "in.parquet", 3)
    first = _spec(fake_engine, tmp_path / "in.parquet", tmp_path / "a")
    with open_client(first) as client:  # two workflow steps on one client
        run_job(first, client=client)
        run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "b", max_tokens=2),
                client=client)
    assert notes == ["memory plan (per worker):\n" + FakeLLM.placement.table()]
    assert len(FakeLLM.instances) == 1


def test_a_torn_manifest_is_named_as_such(fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 5)
    spec = _spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out")
    run_job(spec)
    manifest = tmp_path / "out" / "_manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    assert _refusal(spec) == (
        f"output {tmp_path / 'out'} holds part files and a _manifest.json that is damaged or "
        "not fusegen's, so they cannot be matched to this job; pass --overwrite to replace "
        "them or choose another --output")
