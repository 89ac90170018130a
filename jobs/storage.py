"""Inputs over fsspec (Parquet, and JSONL / CSV through `jobs/formats.py`): listing them,
reading one partition lazily, checking the output.

Every function takes the job's storage options; none keeps data beyond one partition.
"""
from __future__ import annotations

import glob as _glob

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from fusegen.jobs.errors import JobError
from fusegen.jobs.batch_checks import BatchScan
from fusegen.jobs.formats import OPENAI_BATCH, SUFFIXES, LineErrors, inspect_text, load_json, \
    read_text, text_format, with_batch_checks
from fusegen.jobs.identity import content_version
from fusegen.jobs.plan import InputFile, Partition

# Streaming reads: without these pyarrow loads a whole row group (pre_buffer) or a whole
# column chunk (buffer_size=0) even when only one batch of it is wanted.
_READ_OPTIONS = dict(buffer_size=1 << 20, pre_buffer=False)
_BATCH_ROWS = 1024


def filesystem(url: str, storage_options: dict):
    """(fs, path) for a URL; fails with a message naming what to install or fix."""
    try:
        return fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as exc:
        raise JobError(f"cannot open {url.split('://')[0]}:// URLs: {exc} "
                       "(for s3:// run `pip install fusegen[s3]`)") from None
    except (ValueError, TypeError) as exc:
        raise JobError(f"cannot open {url}: {exc}") from None


def list_input_files(url: str, storage_options: dict) -> list[InputFile]:
    """The input files of a file, directory or glob URL, sorted, with row-group sizes.
    A path that exists is that path, whatever characters it holds (`weird[1].parquet`);
    only a path that does not exist is a glob."""
    fs, path = filesystem(url, storage_options)
    try:
        paths = _input_paths(fs, path, url)
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend error: the input is unreadable
        raise JobError(f"cannot read input {url}: {type(exc).__name__}: {exc}") from None
    scan = BatchScan(load_json)  # one for all files: a custom_id two files share is found
    files = with_batch_checks([_inspect(fs, p, "" if p == path else f" (in {url})", scan)
                               for p in sorted(paths)], scan)
    batch = [f.path for f in files if f.text is not None and f.text.format == OPENAI_BATCH]
    if batch and len(batch) != len(files):
        other = next(f.path for f in files if f.path not in batch)
        raise JobError(f"input {url} mixes OpenAI batch request files ({batch[0]}) with "
                       f"other files ({other}); run them as separate jobs")
    return files


def _input_paths(fs, path: str, url: str) -> list[str]:
    if fs.isfile(path):
        return [path]
    if fs.isdir(path):
        paths = [p for p in fs.find(path) if p.endswith(_DATA_SUFFIXES)
                 and all(_visible(s) for s in p[len(path):].split("/"))]
    elif _glob.has_magic(path):
        paths = [p for p in fs.glob(path) if fs.isfile(p) and _visible(p.rsplit("/", 1)[-1])]
    else:
        raise JobError(f"input {url} does not exist; pass a Parquet, JSONL or CSV file, a "
                       "directory of them, or a glob")
    if not paths:
        raise JobError(f"input {url} holds no Parquet, JSONL or CSV files "
                       f"({', '.join('*' + s for s in _DATA_SUFFIXES)})")
    return paths


_DATA_SUFFIXES = (".parquet", ".parq", *SUFFIXES)


def _visible(name: str) -> bool:
    """Names starting with _ or . are metadata (_SUCCESS, _tmp/, .crc), never data."""
    return not name.startswith(("_", "."))


def _inspect(fs, path: str, where: str, scan: BatchScan) -> InputFile:
    """Row-group sizes, column names and content identity (`jobs/identity.py`). A file
    that is not Parquet, or whose columns repeat a name, fails here, named, before any
    model loads. JSONL and CSV files are scanned whole (`jobs/formats.py`), a batch
    file's problem lines noted in the job's `scan`."""
    fmt = text_format(path)
    try:
        if fmt is not None:
            return inspect_text(fs, path, fmt, scan)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            md = pf.metadata
            groups = tuple(md.row_group(i).num_rows for i in range(md.num_row_groups))
            names = tuple(pf.schema_arrow.names)
        info = fs.info(path)
        version = content_version(fs, path, info, md.serialized_size)
    except JobError as exc:
        raise JobError(f"input file {path}{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any reader or backend error names the file
        raise JobError(f"cannot read input file {path}{where}: {type(exc).__name__}: {exc}; "
                       "remove it or fix it, or point --input at the good files") from None
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise JobError(f"input file {path} has {names.count(repeated)} columns named "
                       f"{repeated!r}; rename them so that every column name is unique")
    return InputFile(path, groups, names, size=info.get("size"), version=version)


def read_partition(fs, part: Partition, line_errors: LineErrors | None = None) -> pa.Table:
    """Rows [start, stop) of the partition's file, streaming only the row groups they span.
    A JSONL / CSV line that cannot be read is a row of nulls, its message put in
    `line_errors` by row index; without `line_errors` it fails the read, named."""
    if part.text is not None:
        table, errors = read_text(fs, part.path, part.text, part.num_rows)
        if errors and line_errors is None:
            raise JobError(f"input file {next(iter(errors.values()))}")
        if errors:
            line_errors.update(errors)
        return table
    with fs.open(part.path, "rb") as f:
        pf = pq.ParquetFile(f, **_READ_OPTIONS)
        md = pf.metadata
        groups, skip, first = [], 0, 0
        for i in range(md.num_row_groups):
            rows = md.row_group(i).num_rows
            if first + rows > part.start and first < part.stop:
                if not groups:
                    skip = part.start - first
                groups.append(i)
            first += rows
        batches, need = [], part.num_rows
        for batch in pf.iter_batches(_BATCH_ROWS, row_groups=groups):
            if skip >= batch.num_rows:  # before the range: decoded, then dropped
                skip -= batch.num_rows
                continue
            batch = batch.slice(skip, need)
            skip, need = 0, need - batch.num_rows
            batches.append(batch)
            if need == 0:
                break
        return pa.Table.from_batches(batches, schema=pf.schema_arrow)


def list_names(fs, path: str) -> set[str]:
    """Base names directly under a directory; empty when it does not exist (object stores
    have no empty directories). Fresh: other processes (workers) write here."""
    fs.invalidate_cache(path)
    try:
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    except FileNotFoundError:
        return set()


# fsspec's mv and rm expand glob characters even in a path that exists: on object stores
# and memory://, rm("out[1]/_tmp") removes out1/_tmp. Paths with such characters go
# through the single-file calls, which are literal everywhere.

def move(fs, src: str, dst: str) -> None:
    """Rename one file (an atomic rename on local disks)."""
    if _glob.has_magic(src + dst) and not is_local(fs):
        fs.cp_file(src, dst)
        fs.rm_file(src)
    else:
        fs.mv(src, dst)


def remove_tree(fs, path: str) -> None:
    try:
        if not _glob.has_magic(path) or is_local(fs):
            fs.rm(path, recursive=True)
            return
        entries = fs.find(path, withdirs=True, detail=True)
        for name in sorted(entries, key=len, reverse=True):  # files before their folders
            if entries[name]["type"] == "directory":
                _remove_dir(fs, name)
            else:
                fs.rm_file(name)
        _remove_dir(fs, path)
    except FileNotFoundError:
        pass


def _remove_dir(fs, path: str) -> None:
    try:
        fs.rmdir(path)
    except (OSError, NotImplementedError):  # object stores: no folder to remove
        pass


def is_process_local(fs) -> bool:
    """Files that only this process sees (memory://): no use to worker processes."""
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, MemoryFileSystem)


def is_local(fs) -> bool:
    """A path of this machine's own filesystem tree (its disk, or a share mounted here)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def check_writable(fs, path: str, url: str):
    """Create the output directory and prove a file can be written there."""
    probe = f"{path.rstrip('/')}/_write_probe"
    try:
        fs.makedirs(path, exist_ok=True)
        with fs.open(probe, "wb") as f:
            f.write(b"ok")
        fs.rm_file(probe)
    except Exception as exc:  # noqa: BLE001 - any backend error means "not writable"
        raise JobError(f"output {url} is not writable ({type(exc).__name__}: {exc}); "
                       "pass an --output you can write to") from None
