"""`fusegen run --deterministic`: a SIGKILLed and resumed job equals an uninterrupted one
byte for byte in generated_text and generated_token_ids, and so does a run that batches
its rows differently."""
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs_fixtures import read_output, sigkill_when

REPO = Path(__file__).resolve().parent.parent
NUM_ROWS, PARTITION_ROWS = 240, 12
JOB = dict(max_tokens=20, partition_rows=PARTITION_ROWS, temperature=0.7,
           dtype="float32", progress="log")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from fusegen.engine.models.synthetic import build_checkpoint

    return str(build_checkpoint(tmp_path_factory.mktemp("det-job") / "model", seed=3))


def _args(model, inp, out, **extra):
    args = [sys.executable, "-m", "fusegen.jobs.cli", "run", "--model", model,
            "--input", str(inp), "--output", str(out), "--deterministic",
            "--output-token-ids"]
    return args + [f"--{k.replace('_', '-')}={v}" for k, v in {**JOB, **extra}.items()]


def _num_parts(out: Path) -> int:
    return len(list(out.glob("part-*.parquet"))) if out.exists() else 0


def _generated(out: Path) -> pa.Table:
    return read_output(out).select(["id", "generated_text", "generated_token_ids"])


def test_killed_and_resumed_job_equals_uninterrupted_bytes(model_dir, tmp_path):
    inp = tmp_path / "in.parquet"
    # Prompts of many lengths, so rows batch with different neighbours in each run.
    prompts = [f"row {i}: " + "the quick brown fox " * (i % 13) for i in range(NUM_ROWS)]
    pq.write_table(pa.table({"id": list(range(NUM_ROWS)), "prompt": prompts}), inp,
                   row_group_size=PARTITION_ROWS)
    whole = subprocess.run(_args(model_dir, inp, tmp_path / "whole"), cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert whole.returncode == 0, whole.stderr
    # Another batching: one partition in flight, at most 3 running requests, prompts
    # prefilled in chunks of 8 tokens.
    narrow = subprocess.run(_args(model_dir, inp, tmp_path / "narrow", partitions_per_worker=1,
                                  max_num_seqs=3, max_num_batched_tokens=8),
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert narrow.returncode == 0, narrow.stderr
    out = tmp_path / "out"
    sigkill_when(_args(model_dir, inp, out), tmp_path / "log", lambda: _num_parts(out) >= 3,
                 "three committed parts")
    kept = _num_parts(out)
    assert 3 <= kept < NUM_ROWS // PARTITION_ROWS, (tmp_path / "log").read_text()
    rerun = subprocess.run(_args(model_dir, inp, out), cwd=REPO, capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{kept} kept from an earlier run" in rerun.stdout
    reference = _generated(tmp_path / "whole")
    assert reference.column("id").to_pylist() == list(range(NUM_ROWS))
    assert _generated(out).equals(reference)
    assert _generated(tmp_path / "narrow").equals(reference)
