"""A job's identity beyond its options: the dtype "auto" resolves to (once, on the driver,
from the device and the CPU's flags), its model's files, and a failed run's manifest."""
import json
import os
import shutil
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner

from fusegen.jobs import engines
from fusegen.jobs.errors import JobError
from fusegen.jobs.identity import JobIdentity, model_identity
from fusegen.jobs.output import output_fingerprint
from fusegen.jobs.driver import run_job
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import FakeLLM, fake_engine, tiny_model_dir, write_prompts  # noqa: F401

AUTO_RULE = "(auto: bfloat16 on GPUs and on CPUs with bf16 units, float32 on other CPUs)"


def _flags(monkeypatch, bf16_units: bool):
    """The CPU's flags as torch reads them: AVX512_BF16 present or not, no AMX."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_units,
                        raising=False)


@pytest.fixture
def loads(monkeypatch, fake_engine):
    """The dtype each worker engine was loaded with."""
    seen = []
    monkeypatch.setattr(engines, "_load",
                        lambda m, kw: seen.append(kw["dtype"]) or FakeLLM(m, **kw))
    return seen


@pytest.fixture
def checkpoint(tmp_path):
    """A copy of the tiny random checkpoint that a test may rewrite in place."""
    return str(shutil.copytree(tiny_model_dir(), tmp_path / "model"))


def _spec(model, tmp_path, **kw):
    kw = {"max_tokens": 3, "partition_rows": 4, "progress": "none", "device": "cpu", **kw}
    return JobSpec(model=model, input=str(tmp_path / "in.parquet"),
                   output=str(tmp_path / "out"), **kw)


def _manifest(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "_manifest.json").read_text())


def _drop_last_part(tmp_path) -> None:
    """What a killed run leaves: the first parts committed, the last one not."""
    os.remove(tmp_path / "out" / "part-00002.parquet")


# -- dtype "auto" ------------------------------------------------------------------------

def test_auto_is_resolved_once_recorded_and_sent_resolved_to_the_workers(
        loads, fake_engine, tmp_path, monkeypatch):
    _flags(monkeypatch, bf16_units=False)
    write_prompts(tmp_path / "in.parquet", 10)
    run_job(_spec(fake_engine, tmp_path))
    m = _manifest(tmp_path)
    assert (m["dtype"], m["config"]["dtype"], loads) == ("float32", "auto", ["float32"])
    # auto and the dtype it resolves to are one job: --dtype float32 resumes it
    _drop_last_part(tmp_path)
    assert run_job(_spec(fake_engine, tmp_path, dtype="float32")).num_parts_skipped == 2
    assert _manifest(tmp_path)["status"] == "complete"


def test_a_resume_that_resolves_another_dtype_is_refused_naming_both(
        loads, fake_engine, tmp_path, monkeypatch):
    _flags(monkeypatch, bf16_units=True)
    write_prompts(tmp_path / "in.parquet", 10)
    run_job(_spec(fake_engine, tmp_path))
    assert (_manifest(tmp_path)["dtype"], loads) == ("bfloat16", ["bfloat16"])
    _drop_last_part(tmp_path)
    _flags(monkeypatch, bf16_units=False)  # another machine, or the flags hidden
    with pytest.raises(JobError) as err:
        run_job(_spec(fake_engine, tmp_path))
    assert str(err.value) == (
        f"output {tmp_path / 'out'} was written in bfloat16; this run resolves dtype auto to "
        f"float32 {AUTO_RULE}; pass --dtype bfloat16 to resume it, or --overwrite to start "
        "afresh")
    with pytest.raises(JobError, match=r"was written in bfloat16; this run asks for dtype "
                       r"float16; it also differs in: max_tokens: 3 -> 4; pass --dtype "
                       "bfloat16 to resume it"):
        run_job(_spec(fake_engine, tmp_path, dtype="float16", max_tokens=4))
    assert run_job(_spec(fake_engine, tmp_path, dtype="bfloat16")).num_parts_skipped == 2
    assert loads == ["bfloat16", "bfloat16"]


def _legacy_run(spec, monkeypatch) -> str:
    """Run `spec` as fusegen wrote outputs before it recorded the dtype and the model's
    files: the fingerprint of the options and inputs only, no "dtype" / "model" keys."""
    with monkeypatch.context() as m:
        m.setattr(JobSpec, "fingerprint", lambda self, inputs, identity=None:
                  output_fingerprint(self.output_config(), inputs))
        m.setattr(JobIdentity, "manifest_fields", lambda self: {})
        run_job(spec)
    manifest = json.loads(open(os.path.join(spec.output, "_manifest.json")).read())
    assert "dtype" not in manifest and "model" not in manifest
    return manifest["fingerprint"]


def _footer_fingerprints(tmp_path) -> list[str]:
    return [json.loads(pq.read_metadata(tmp_path / "out" / f"part-{i:05d}.parquet")
                       .metadata[b"fusegen"])["fingerprint"] for i in range(3)]


def test_an_output_written_before_the_dtype_was_recorded_resumes_where_auto_was_certain(
        fake_engine, tmp_path, monkeypatch):
    """Without bf16 units "auto" was float32 before as now: the output resumes, keeps its
    parts, and from then on records the dtype (later resumes keep both generations)."""
    _flags(monkeypatch, bf16_units=False)
    write_prompts(tmp_path / "in.parquet", 10)
    legacy = _legacy_run(_spec(fake_engine, tmp_path), monkeypatch)
    _drop_last_part(tmp_path)
    assert run_job(_spec(fake_engine, tmp_path)).num_parts_skipped == 2
    m = _manifest(tmp_path)
    assert (m["dtype"], m["earlier_fingerprint"], m["status"]) == ("float32", legacy,
                                                                    "complete")
    assert _footer_fingerprints(tmp_path) == [legacy, legacy, m["fingerprint"]]
    os.remove(tmp_path / "out" / "part-00000.parquet")
    result = run_job(_spec(fake_engine, tmp_path))
    assert (result.num_parts_skipped, result.num_rows) == (2, 10)
    assert _footer_fingerprints(tmp_path) == [m["fingerprint"], legacy, m["fingerprint"]]


def test_an_output_written_before_the_dtype_was_recorded_on_a_timed_cpu_needs_its_dtype(
        fake_engine, tmp_path, monkeypatch):
    """With bf16 units the fusegen that wrote it chose by timing: the user names the dtype."""
    _flags(monkeypatch, bf16_units=True)
    write_prompts(tmp_path / "in.parquet", 10)
    _legacy_run(_spec(fake_engine, tmp_path), monkeypatch)
    _drop_last_part(tmp_path)
    with pytest.raises(JobError) as err:
        run_job(_spec(fake_engine, tmp_path))
    assert str(err.value) == (
        f"output {tmp_path / 'out'} was written before fusegen recorded the dtype 'auto' "
        "resolves to, and on a CPU with bf16 units that fusegen chose float32 or bfloat16 "
        "by timing a matmul at each start, so its parts may be in either; pass --dtype "
        "float32 or --dtype bfloat16 (the one it was written in) to resume it, or "
        "--overwrite to start afresh")
    assert run_job(_spec(fake_engine, tmp_path, dtype="float32")).num_parts_skipped == 2
    assert _manifest(tmp_path)["dtype"] == "float32"


def test_an_output_written_before_in_an_explicit_dtype_keeps_it(fake_engine, tmp_path,
                                                                  monkeypatch):
    _flags(monkeypatch, bf16_units=True)
    write_prompts(tmp_path / "in.parquet", 10)
    _legacy_run(_spec(fake_engine, tmp_path, dtype="float32"), monkeypatch)
    _drop_last_part(tmp_path)
    with pytest.raises(JobError, match=r"was written in float32; this run resolves dtype "
                       r"auto to bfloat16 \(auto: .*\); pass --dtype float32 to resume it"):
        run_job(_spec(fake_engine, tmp_path))
    assert run_job(_spec(fake_engine, tmp_path, dtype="float32")).num_parts_skipped == 2


# -- the model's files --------------------------------------------------------------------

def _rewrite_weights(model: str, tmp_path) -> None:
    """Other weights of the same shapes (another seed), written over the file in place."""
    from fusegen.engine.models.synthetic import build_checkpoint

    other = build_checkpoint(tmp_path / "other", seed=1)
    with open(os.path.join(model, "model.safetensors"), "r+b") as f:
        f.write((other / "model.safetensors").read_bytes())


def test_a_checkpoint_rewritten_in_place_refuses_the_resume_naming_it(
        checkpoint, tmp_path, monkeypatch):
    """The real engine: a resume after the weights changed under the same path would mix
    parts of two models; an unchanged checkpoint resumes."""
    write_prompts(tmp_path / "in.parquet", 10)
    spec = _spec(checkpoint, tmp_path, dtype="float32", max_num_seqs=4, temperature=0.0)
    run_job(spec)
    first = pq.read_table(tmp_path / "out" / "part-00002.parquet")
    _drop_last_part(tmp_path)
    weights = os.path.join(checkpoint, "model.safetensors")
    before = os.stat(weights)
    _rewrite_weights(checkpoint, tmp_path)
    after = os.stat(weights)
    assert after.st_size == before.st_size  # same shapes: only its stamp tells
    with pytest.raises(JobError) as err:
        run_job(spec)
    assert str(err.value) == (
        f"output {tmp_path / 'out'} holds a different job (changed: model {checkpoint} was "
        f"rewritten (model.safetensors mtime_ns {before.st_mtime_ns} -> "
        f"{after.st_mtime_ns})); rerun with --overwrite to start afresh, or choose another "
        "--output")
    # put the old weights back, stamp included: the same checkpoint resumes
    shutil.copy2(os.path.join(tiny_model_dir(), "model.safetensors"), weights)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert run_job(spec).num_parts_skipped == 2
    assert pq.read_table(tmp_path / "out" / "part-00002.parquet").equals(first)


def test_a_changed_config_is_named_by_its_hash(checkpoint, fake_engine, tmp_path):
    write_prompts(tmp_path / "in.parquet", 10)
    run_job(_spec(checkpoint, tmp_path))
    _drop_last_part(tmp_path)
    config = os.path.join(checkpoint, "config.json")
    was = model_identity(checkpoint)["files"]["config.json"]
    with open(config) as f:
        cfg = json.load(f)
    cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 2
    text = json.dumps(cfg)
    with open(config, "w") as f:
        f.write(text)
    now = model_identity(checkpoint)["files"]["config.json"]
    assert now["sha256"] != was["sha256"]
    with pytest.raises(JobError, match=rf"changed: model {checkpoint} was rewritten "
                       rf"\(config.json (size {was['size']} -> {now['size']}, )?mtime_ns "
                       rf"{was['mtime_ns']} -> {now['mtime_ns']}, sha256 "
                       rf"'{was['sha256']}' -> '{now['sha256']}'\)\)"):
        run_job(_spec(checkpoint, tmp_path))


def test_model_identity_reads_the_files_the_engine_reads_not_the_weights(checkpoint):
    record = model_identity(checkpoint)
    assert record["path"] == checkpoint
    assert sorted(record["files"]) == ["config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    st = os.stat(os.path.join(checkpoint, "model.safetensors"))
    assert record["files"]["model.safetensors"] == {"size": st.st_size,
                                                    "mtime_ns": st.st_mtime_ns}
    assert set(record["files"]["config.json"]) == {"size", "mtime_ns", "sha256"}
    open(os.path.join(checkpoint, "README.md"), "w").write("not read by fusegen")
    assert model_identity(checkpoint) == record


def test_model_identity_of_gguf_files_and_split_sets(tmp_path):
    single = tmp_path / "m.gguf"
    single.write_bytes(b"GGUF" + bytes(60))
    assert model_identity(str(single)) == {"path": str(single), "files": {"m.gguf": {
        "size": 64, "mtime_ns": single.stat().st_mtime_ns}}}
    for i in (1, 2):
        (tmp_path / f"s-0000{i}-of-00002.gguf").write_bytes(bytes(i))
    record = model_identity(str(tmp_path / "s-00001-of-00002.gguf"))
    assert {k: v["size"] for k, v in record["files"].items()} == {
        "s-00001-of-00002.gguf": 1, "s-00002-of-00002.gguf": 2}


def test_model_identity_of_a_hub_id_is_its_cached_snapshot(tmp_path, monkeypatch):
    repo = tmp_path / "cache" / "models--org--tiny"
    snap = shutil.copytree(tiny_model_dir(), repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    record = model_identity("org/tiny")
    assert (record["path"], record["snapshot"]) == ("org/tiny", "a" * 40)
    assert record["files"] == model_identity(str(snap))["files"]
    # workers elsewhere: a snapshot not cached here is named, not fetched
    assert model_identity("org/absent", "v2", external=True) == {
        "path": "org/absent", "revision": "v2", "snapshot": None}
    with pytest.raises(JobError, match="model org/absent is not in the hub cache"):
        JobSpec(model="org/absent", input="i", output="o").identity()


# -- a failed run's manifest ------------------------------------------------------------

class _FailingLLM(FakeLLM):
    """Fails the partition holding `prompt 5`, naming a credential."""

    def submit(self, prompt, params):
        if prompt == "prompt 5":
            raise RuntimeError("store refused token=abc123 for pa55word")
        return super().submit(prompt, params)


def test_a_failed_partition_leaves_the_manifest_failed_with_the_error_and_resume(
        fake_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(engines, "_load", lambda m, kw: _FailingLLM(m, **kw))
    write_prompts(tmp_path / "in.parquet", 10)
    args = ["run", "--model", fake_engine, "--input", str(tmp_path / "in.parquet"),
            "--output", str(tmp_path / "out"), "--max-tokens", "3", "--partition-rows", "4",
            "--partitions-per-worker", "1", "--progress", "none",
            "--storage-option", "auto_mkdir=true", "--storage-option", "password=pa55word"]
    from fusegen.jobs.cli import main

    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    error = (f"part-00001.parquet ({tmp_path / 'in.parquet'} rows 4-8): RuntimeError: store "
             "refused token=*** for ***")
    assert result.output.strip().endswith(error)
    m = _manifest(tmp_path)
    assert (m["status"], m["error"]) == ("failed", error)
    assert m["resume"] == (
        f"fusegen run --model {fake_engine} --input {tmp_path / 'in.parquet'} --output "
        f"{tmp_path / 'out'} --max-tokens 3 --partition-rows 4 --partitions-per-worker 1 "
        "--progress none --storage-option auto_mkdir=true --storage-option password=***")
    assert [p["name"] for p in m["parts"]] == ["part-00000.parquet"]
    assert m["parts"][0]["num_rows"] == 4
    assert {k: m["runs"][-1][k] for k in ("status", "error", "parts_computed")} == {
        "status": "failed", "error": error, "parts_computed": 1}
    assert "pa55word" not in json.dumps(m) and "abc123" not in json.dumps(m)
    # fixed, the same command resumes: the committed part is kept, the manifest complete
    monkeypatch.setattr(engines, "_load", lambda m, kw: FakeLLM(m, **kw))
    engines.close_engines()
    rerun = CliRunner().invoke(main, args)
    assert rerun.exit_code == 0, rerun.output
    m = _manifest(tmp_path)
    assert (m["status"], m["totals"]["num_rows"]) == ("complete", 10)
    assert "error" not in m and "resume" not in m
    assert [r["status"] for r in m["runs"]] == ["failed", "complete"]
    assert "(3 parts, 1 kept from an earlier run)" in rerun.output


def test_a_dead_worker_or_a_failed_load_leaves_the_manifest_failed(fake_engine, tmp_path,
                                                                     monkeypatch):
    from distributed import KilledWorker

    from fusegen.jobs import driver

    real = driver.run_partition

    def dies_on_second(spec, part, *args):
        if part.index == 1:
            raise KilledWorker("fusegen-part-00001", SimpleNamespace(address="inproc://w"), 3)
        return real(spec, part, *args)

    monkeypatch.setattr(driver, "run_partition", dies_on_second)
    write_prompts(tmp_path / "in.parquet", 10)
    spec = _spec(fake_engine, tmp_path, partitions_per_worker=1)
    with pytest.raises(JobError, match="killed its worker repeatedly"):
        run_job(spec)
    m = _manifest(tmp_path)
    assert m["status"] == "failed" and "killed its worker repeatedly" in m["error"]
    assert m["resume"] == "rerun the same job (same options, same output, without " \
        "--overwrite)"
    assert [p["name"] for p in m["parts"]] == ["part-00000.parquet"]

    monkeypatch.setattr(engines, "_load", lambda m, kw: (_ for _ in ()).throw(
        MemoryError("no room for the weights")))
    engines.close_engines()
    with pytest.raises(JobError, match="loading the model: MemoryError"):
        run_job(spec)
    m = _manifest(tmp_path)
    assert (m["status"], m["error"]) == ("failed", "loading the model: MemoryError: no room "
                                                   "for the weights")
    assert [p["name"] for p in m["parts"]] == ["part-00000.parquet"]
