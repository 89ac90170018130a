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
from fusegen.jobs.runner import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import FakeLLM, fake_engine, read_output, write_prompts  # noqa: F401


def _spec(model, inp, out, **kw):
    kw = {"max_tokens": 3, "partition_rows": 4, "progress": "none", **kw}
    return JobSpec(model=model, input=str(inp), output=str(out), **kw)


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
                                      "num_generated_tokens", "error"]
    assert out.num_generated_tokens == 9


def test_prompt_too_long_from_engine_is_an_error_row(fake_engine, tmp_path):
    pq.write_table(pa.table({"prompt": ["ok", "z" * 100]}), tmp_path / "in.parquet")
    run_job(_spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out"))
    err = read_output(tmp_path / "out").column("error").to_pylist()
    assert err[0] is None and err[1].startswith("prompt_too_long: 101 tokens")


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
    assert m["inputs"] == [{"path": str(tmp_path / "in.parquet"), "num_rows": 9}]
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
    from fusegen.jobs import runner
    from fusegen.jobs.progress import Progress

    seen = []
    monkeypatch.setattr(Progress, "partial", lambda self, *a: seen.append(a))
    monkeypatch.setattr(engines, "_load",
                        lambda m, kw: FakeLLM(m, step_seconds=0.05, **kw))
    write_prompts(tmp_path / "in.parquet", 8)
    spec = _spec(fake_engine, tmp_path / "in.parquet", tmp_path / "out", max_tokens=12,
                 partition_rows=8, max_num_seqs=4)  # two waves of 12 steps: ~1.2 s
    runner.run_job(spec)
    assert seen and all(index == 0 and 0 <= rows < 8 for index, rows, _ in seen), seen
    assert (0, 4, 48) in seen  # the first wave of four rows, 12 tokens each


def test_resume_decision_policy():
    from fusegen.jobs.manifest import FRESH, OVERWRITE, RESUME, resume_mode

    old = {"fingerprint": "a", "config": {"max_tokens": 8, "seed": 0}}
    assert resume_mode(None, "a", {}, False, False, "o") == FRESH
    assert resume_mode(old, "a", {}, True, False, "o") == RESUME
    assert resume_mode(old, "b", {"max_tokens": 9, "seed": 0}, False, False, "o") == FRESH
    assert resume_mode(old, "b", {}, True, True, "o") == OVERWRITE
    with pytest.raises(JobError, match=r"changed: max_tokens: 8 -> 9\)"):
        resume_mode(old, "b", {"max_tokens": 9, "seed": 0}, True, False, "o")
    with pytest.raises(JobError, match="changed: the input files or their row counts"):
        resume_mode(old, "b", {"max_tokens": 8, "seed": 0}, True, False, "o")
