"""Parquet over fsspec: listing inputs, reading exact row ranges lazily."""
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fusegen.jobs.errors import JobError
from fusegen.jobs.plan import plan_partitions
from fusegen.jobs.storage import check_writable, filesystem, list_input_files, read_partition

REPO = Path(__file__).resolve().parent.parent


def test_listing_a_directory_skips_metadata_and_hidden_files(tmp_path):
    for name in ("b.parquet", "a.parquet", "sub/c.parquet", "_tmp/x.parquet",
                 ".hidden.parquet", "notes.txt"):
        os.makedirs((tmp_path / name).parent, exist_ok=True)
        pq.write_table(pa.table({"prompt": ["x"] * 3}), tmp_path / name, row_group_size=2)
    files = list_input_files(str(tmp_path), {})
    assert [os.path.relpath(f.path, tmp_path) for f in files] == [
        "a.parquet", "b.parquet", "sub/c.parquet"]
    assert files[0].row_groups == (2, 1) and files[0].columns == ("prompt",)
    assert [f.path for f in list_input_files(str(tmp_path / "*.parquet"), {})] == [
        str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    assert len(list_input_files(str(tmp_path / "a.parquet"), {})) == 1
    with pytest.raises(JobError, match="holds no Parquet files"):
        list_input_files(str(tmp_path / "sub" / "*.csv"), {})


def test_partitions_read_back_every_row_once(tmp_path):
    table = pa.table({"id": list(range(1000)), "s": [str(i) for i in range(1000)]})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=300)  # 300,300,300,100
    fs, _ = filesystem(str(tmp_path), {})
    plan = plan_partitions(list_input_files(str(tmp_path), {}), 128)
    parts = [read_partition(fs, p) for p in plan]
    assert pa.concat_tables(parts).equals(table)
    assert {p.num_rows for p in parts} <= {128, 44, 100}


def test_reading_a_slice_of_a_huge_row_group_streams(tmp_path):
    n = 100_000
    pad = pa.array([os.urandom(400) for _ in range(n)], pa.binary())
    pq.write_table(pa.table({"id": list(range(n)), "pad": pad}), tmp_path / "big.parquet",
                   compression="none")  # one 40 MB row group
    # In a fresh process, so that pyarrow's peak allocation counts this read only.
    code = f"""
import pyarrow as pa
from fusegen.jobs.plan import Partition
from fusegen.jobs.storage import filesystem, read_partition
pool = pa.default_memory_pool()
fs, _ = filesystem({str(tmp_path)!r}, {{}})
part = read_partition(fs, Partition(0, {str(tmp_path / "big.parquet")!r}, 90_000, 90_500, 0))
assert part.column("id").to_pylist() == list(range(90_000, 90_500))
print(pool.max_memory())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert int(out) < 12_000_000, out  # vs 40 MB for the whole group


def test_unwritable_output_is_reported(tmp_path):
    (tmp_path / "file").write_text("x")
    fs, path = filesystem(str(tmp_path / "file" / "out"), {})
    with pytest.raises(JobError, match="is not writable .*pass an --output you can write to"):
        check_writable(fs, path, "URL")
