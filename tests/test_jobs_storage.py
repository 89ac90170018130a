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
    with pytest.raises(JobError, match="holds no Parquet, JSONL or CSV files"):
        list_input_files(str(tmp_path / "sub" / "*.txt"), {})


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


def test_an_existing_path_with_glob_characters_is_read_as_that_path(tmp_path):
    pq.write_table(pa.table({"prompt": ["literal"] * 2}), tmp_path / "weird[1].parquet")
    pq.write_table(pa.table({"prompt": ["globbed"] * 3}), tmp_path / "weird1.parquet")
    os.makedirs(tmp_path / "dir[a]")
    pq.write_table(pa.table({"prompt": ["in dir"]}), tmp_path / "dir[a]" / "x.parquet")
    os.makedirs(tmp_path / "dira")
    pq.write_table(pa.table({"prompt": ["other dir"]}), tmp_path / "dira" / "y.parquet")
    files = list_input_files(str(tmp_path / "weird[1].parquet"), {})
    assert [(f.path, f.num_rows) for f in files] == [(str(tmp_path / "weird[1].parquet"), 2)]
    files = list_input_files(str(tmp_path / "dir[a]"), {})
    assert [f.path for f in files] == [str(tmp_path / "dir[a]" / "x.parquet")]
    # a path that does not exist is a glob
    files = list_input_files(str(tmp_path / "weird[0-9].parquet"), {})
    assert [f.path for f in files] == [str(tmp_path / "weird1.parquet")]


def test_duplicate_column_names_are_refused_naming_file_and_column(tmp_path):
    table = pa.Table.from_arrays([pa.array(["a"]), pa.array([1]), pa.array(["b"])],
                                 names=["prompt", "n", "prompt"])
    pq.write_table(table, tmp_path / "dup.parquet")
    with pytest.raises(JobError) as info:
        list_input_files(str(tmp_path), {})
    assert str(info.value) == (
        f"input file {tmp_path / 'dup.parquet'} has 2 columns named 'prompt'; "
        "rename them so that every column name is unique")


def test_a_junk_parquet_file_in_a_directory_is_named(tmp_path):
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(JobError) as info:
        list_input_files(str(tmp_path), {})
    assert str(info.value).startswith(
        f"cannot read input file {tmp_path / 'b.parquet'} (in {tmp_path}): ArrowInvalid: ")
    assert str(info.value).endswith("remove it or fix it, or point --input at the good files")


def test_input_files_carry_their_content_identity(tmp_path):
    import hashlib

    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"]}), path)
    first = list_input_files(str(path), {})[0]
    assert first.size == os.path.getsize(path)
    assert first.version == "sha256=" + hashlib.sha256(path.read_bytes()).hexdigest()
    pq.write_table(pa.table({"prompt": ["a", "b"]}), path)  # the same bytes again
    assert list_input_files(str(path), {})[0] == first
    pq.write_table(pa.table({"prompt": ["b", "a"]}), path)  # same size, same statistics
    second = list_input_files(str(path), {})[0]
    assert second.size == first.size and second.version != first.version


@pytest.mark.parametrize("protocol", ["memory", "file"])
def test_output_paths_with_glob_characters_are_literal(tmp_path, protocol):
    from fusegen.jobs.storage import move, remove_tree

    root = f"/fusegen-glob-{os.getpid()}" if protocol == "memory" else str(tmp_path)
    fs, _ = filesystem(f"{protocol}://{root}", {})
    for name in ("out1/_tmp/a", "out[1]/_tmp/b", "out1/x", "out[1]/x"):
        fs.makedirs(f"{root}/{name}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{name}", name.encode())
    try:
        move(fs, f"{root}/out[1]/x", f"{root}/out[1]/y")
        remove_tree(fs, f"{root}/out[1]/_tmp")
        fs.invalidate_cache()
        assert sorted(p[len(root) + 1:] for p in fs.find(root)) == [
            "out1/_tmp/a", "out1/x", "out[1]/y"]
        assert fs.cat_file(f"{root}/out[1]/y") == b"out[1]/x"
    finally:
        fs.rm(root, recursive=True)
