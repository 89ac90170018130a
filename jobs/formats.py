"""JSONL and CSV inputs beside Parquet: one scan per file at planning, bounded reads after.

The scan (`inspect_text`, on the driver) reads a file once: it counts rows, records the
byte offset of every GROUP_ROWS-th row (the planner's "row groups", `jobs/plan.py`),
hashes the bytes (the file's content identity) and infers one Arrow schema for the whole
file, so that every partition reads its rows with the same column types.

A partition (`read_text`, on a worker) seeks to its row group, reads its rows with
pyarrow's JSON or CSV reader, and only when that fails parses them one by one: a line
that cannot be read becomes a row of nulls plus a message naming the file and line, and
the job writes it as an error row (`LineErrors`). Rows are counted the same way by both:
a JSONL row is a non-blank line; a CSV row is a record (quoted fields may span lines),
the first record being the header.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import logging

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson

from fusegen.jobs.errors import JobError
from fusegen.jobs.plan import InputFile, TextLayout, TextSlice

JSONL, CSV, OPENAI_BATCH = "jsonl", "csv", "openai_batch"
SUFFIXES = {".jsonl": JSONL, ".ndjson": JSONL, ".csv": CSV}
GROUP_ROWS = 256  # rows between recorded offsets: a partition skips at most this many
BATCH_KEYS = ("custom_id", "method", "url", "body")  # OpenAI Batch API request lines
INVALID_LINE = "invalid_line"  # the error code of a row that could not be read
log = logging.getLogger("fusegen.jobs")

LineErrors = dict  # row index within the partition -> "file line N: what is wrong"


def text_format(path: str) -> str | None:
    """JSONL or CSV by the file's extension; None for anything else (Parquet)."""
    lower = path.lower()
    return next((fmt for suffix, fmt in SUFFIXES.items() if lower.endswith(suffix)), None)


def inspect_text(fs, path: str, fmt: str) -> InputFile:
    """Scan a JSONL or CSV file (see the module's docstring). An OpenAI batch request file
    (a JSONL file whose first row has custom_id, method, url and body) gets the format
    `openai_batch` and no schema: its lines are parsed per request (`jobs/openai_batch.py`)."""
    scan = _Scan(fmt)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for offset, line, record in _records(f, fmt, digest):
            scan.add(offset, line, record)
    scan.finish()
    if scan.format == OPENAI_BATCH and scan.models:
        log.warning("input %s: requests name model(s) %s; fusegen serves every request with "
                    "--model and ignores body.model", path, ", ".join(sorted(scan.models)))
    layout = TextLayout(scan.format, tuple(scan.offsets), tuple(scan.lines), scan.schema)
    columns = BATCH_KEYS if scan.format == OPENAI_BATCH else tuple(scan.schema.names)
    return InputFile(path, tuple(scan.groups), columns, size=fs.info(path).get("size"),
                     version="sha256=" + digest.hexdigest(), text=layout)


def _records(f, fmt: str, digest=None, offset: int = 0, line: int = 0):
    """(byte offset, 1-based line, record bytes) of every row: non-blank lines for JSONL,
    CSV records (a record goes on while its quotes are unbalanced; RFC 4180 escapes a
    quote by doubling it, so the parity of the quote count decides)."""
    pending, start, start_line = b"", 0, 0  # `line`: of the line before `offset`
    for raw in f:
        if digest is not None:
            digest.update(raw)
        line += 1
        if not pending:
            start, start_line = offset, line
        offset += len(raw)
        if fmt == CSV:
            pending += raw
            if pending.count(b'"') % 2:
                continue
            record, pending = pending, b""
        else:
            record = raw
        if record.strip():
            yield start, start_line, record
    if pending.strip():  # an unterminated quote: the rest of the file is one bad record
        yield start, start_line, pending


class _Scan:
    """Rows, offsets and the schema of one file, built record by record."""

    def __init__(self, fmt: str):
        self.format = fmt
        self.groups, self.offsets, self.lines = [], [], []
        self.schema = pa.schema([])
        self.names: list[str] | None = None  # a CSV file's header
        self.models: set[str] = set()
        self._group: list[bytes] = []
        self._decided = False  # JSONL: whether a line parsed, telling batch files apart

    def add(self, offset: int, line: int, record: bytes) -> None:
        if self.format == CSV and self.names is None:
            self.names = _csv_header(record)
            return
        if self.format == JSONL and not self._decided:
            self._detect_batch(record)
        if len(self._group) == GROUP_ROWS:
            self._close_group()
        if not self._group:
            self.offsets.append(offset)
            self.lines.append(line)
        self._group.append(record)

    def finish(self) -> None:
        self._close_group()
        if self.format == CSV and self.names is not None:
            # Columns no row filled (or a file of a header alone) read as strings.
            self.schema = pa.schema([pa.field(n, pa.string()) if self.schema.get_field_index(n)
                                     < 0 or self.schema.field(n).type == pa.null() else
                                     self.schema.field(n) for n in self.names])

    def _close_group(self) -> None:
        if not self._group:
            return
        self.groups.append(len(self._group))
        if self.format == OPENAI_BATCH:
            self._batch_models(self._group)
        else:
            group = _csv_schema(self._group, self.names) if self.format == CSV else \
                _jsonl_schema(self._group)
            self.schema = merge_schemas(self.schema, group, self.format == CSV)
        self._group = []

    def _detect_batch(self, record: bytes) -> None:
        """The first line that parses decides (a malformed first line is an error row)."""
        try:
            first = json.loads(record)
        except ValueError:
            return
        self._decided = True
        if isinstance(first, dict) and all(k in first for k in ("custom_id", "body")):
            self.format = OPENAI_BATCH

    def _batch_models(self, records: list[bytes]) -> None:
        for record in records:
            try:
                model = json.loads(record).get("body", {}).get("model")
            except (ValueError, AttributeError):
                continue
            if isinstance(model, str) and len(self.models) < 10:
                self.models.add(model)


def _csv_header(record: bytes) -> list[str]:
    names = next(csv.reader(io.StringIO(record.decode("utf-8-sig", "replace"))), [])
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise JobError(f"the CSV header repeats the column {repeated!r}; rename the columns "
                       "so that every name is unique")
    return names


def _jsonl_schema(records: list[bytes]) -> pa.Schema:
    """The schema of the lines that parse, columns in order of first appearance; a column
    whose values mix types keeps its first value's type (the others become error rows)."""
    rows = [r for r in (_loads(record) for record in records) if isinstance(r, dict)]
    names = list(dict.fromkeys(k for r in rows for k in r))
    return pa.schema([pa.field(n, _value_type([r.get(n) for r in rows])) for n in names])


def _loads(record: bytes):
    try:
        return json.loads(record)
    except ValueError:
        return None


def _value_type(values: list) -> pa.DataType:
    try:
        return pa.array(values).type
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        first = next(v for v in values if v is not None)
        try:
            return pa.array([first]).type
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            return pa.null()


def _csv_schema(records: list[bytes], names: list[str]) -> pa.Schema:
    """pyarrow's inference over the records that have the header's number of fields."""
    good = [r for r in records if _csv_fields(r) == len(names)]
    try:
        return _read_csv(b"".join(good), names, None).schema
    except (pa.ArrowException, ValueError):
        return pa.schema([pa.field(n, pa.string()) for n in names])


def _csv_fields(record: bytes) -> int:
    try:
        return len(next(csv.reader(io.StringIO(record.decode("utf-8"))), []))
    except (UnicodeDecodeError, csv.Error):
        return -1


def _read_csv(data: bytes, names: list[str], schema: pa.Schema | None) -> pa.Table:
    types = {f.name: f.type for f in schema} if schema is not None else None
    return pcsv.read_csv(io.BytesIO(data),
                         read_options=pcsv.ReadOptions(column_names=names, use_threads=False),
                         parse_options=pcsv.ParseOptions(newlines_in_values=True),
                         convert_options=pcsv.ConvertOptions(column_types=types))


def merge_schemas(a: pa.Schema, b: pa.Schema, to_string: bool) -> pa.Schema:
    """Field by field: promotable types widen (int64 + double -> double, null + x -> x);
    others become strings (`to_string`: CSV, where any value is text) or keep a's type."""
    fields = {f.name: f for f in a}
    for f in b:
        old = fields.get(f.name)
        if old is None:
            fields[f.name] = f
            continue
        try:
            fields[f.name] = pa.unify_schemas([pa.schema([old]), pa.schema([f])],
                                              promote_options="permissive").field(0)
        except (pa.ArrowException, TypeError):
            fields[f.name] = pa.field(f.name, pa.string()) if to_string else old
    return pa.schema(list(fields.values()))


def read_text(fs, path: str, text: TextSlice, num_rows: int) -> tuple[pa.Table, LineErrors]:
    """The partition's rows as a table of the file's schema, and its unreadable rows."""
    records = []  # (line, bytes)
    with fs.open(path, "rb") as f:
        f.seek(text.offset)
        skip = text.skip
        for _, line, record in _records(f, _fmt(text), None, text.offset, text.line - 1):
            if skip:
                skip -= 1
                continue
            records.append((line, record))
            if len(records) == num_rows:
                break
    if len(records) != num_rows:
        raise JobError(f"input file {path} changed while the job ran (rows "
                       f"{text.skip}.. after line {text.line} are missing); rerun the job")
    if text.format == OPENAI_BATCH:
        return pa.table({"line": pa.array([ln for ln, _ in records], pa.int64()),
                         "request": [r.decode("utf-8", "replace") for _, r in records]}), {}
    return _parse(records, text.schema, text.format == CSV, path)


def _fmt(text: TextSlice) -> str:
    return CSV if text.format == CSV else JSONL


def _parse(records: list[tuple[int, bytes]], schema: pa.Schema, is_csv: bool,
           path: str) -> tuple[pa.Table, LineErrors]:
    """All records at once through pyarrow; when that fails, record by record, so that
    one bad line costs its row only."""
    try:
        table = _parse_block([r for _, r in records], schema, is_csv)
        if table.num_rows == len(records):
            return table, {}
    except (pa.ArrowException, ValueError, TypeError):
        pass
    tables, errors = [], {}
    null_row = pa.Table.from_pylist([{}], schema=schema)
    for i, (line, record) in enumerate(records):
        table, problem = _parse_one(record, schema, is_csv)
        if problem is not None:
            errors[i] = f"{path} line {line} {problem}; fix or drop the line"
        tables.append(null_row if problem is not None else table)
    return pa.concat_tables(tables).combine_chunks(), errors


def _parse_block(records: list[bytes], schema: pa.Schema, is_csv: bool) -> pa.Table:
    data = b"".join(r if r.endswith(b"\n") else r + b"\n" for r in records)
    if is_csv:
        return _read_csv(data, schema.names, schema)
    return pjson.read_json(io.BytesIO(data),
                           read_options=pjson.ReadOptions(use_threads=False,
                                                          block_size=len(data) + 1),
                           parse_options=pjson.ParseOptions(
                               explicit_schema=schema, unexpected_field_behavior="ignore"))


def _parse_one(record: bytes, schema: pa.Schema, is_csv: bool):
    """(one-row table, None) or (None, what is wrong with the record)."""
    if is_csv:
        fields = _csv_fields(record)
        if fields == -1:
            return None, "is not valid UTF-8 CSV"
        if fields != len(schema):
            return None, f"has {fields} fields where the header has {len(schema)}"
        try:
            return _read_csv(record, schema.names, schema), None
        except (pa.ArrowException, ValueError) as exc:
            return None, f"does not match the column types of the file's other rows ({exc})"
    try:
        row = json.loads(record)
    except ValueError as exc:
        return None, f"is not JSON ({exc})"
    if not isinstance(row, dict):
        return None, f"is a JSON {type(row).__name__}, not an object of column: value"
    try:
        return pa.Table.from_pylist([row], schema=schema), None
    except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
        return None, f"does not match the column types of the file's other rows ({exc})"


def mark_line_errors(requests: list, line_errors: LineErrors) -> list:
    """The requests of a partition's rows, those of unreadable lines made error rows."""
    for i, message in line_errors.items():
        req = requests[i]
        req.error = f"{INVALID_LINE}: {req.where}: {message}" if req.where else \
            f"{INVALID_LINE}: {message}"
    return requests


def is_batch_input(files: list[InputFile]) -> bool:
    """Whether the input is OpenAI batch request files (never mixed with others)."""
    return bool(files) and files[0].text is not None and files[0].text.format == OPENAI_BATCH


def part_suffix(files: list[InputFile], output_format: str) -> str:
    """The parts' file type: JSONL for --output-format jsonl and for OpenAI batch inputs
    (whose results are OpenAI's batch output format, whatever --output-format says)."""
    return ".jsonl" if output_format == "jsonl" or is_batch_input(files) else ".parquet"
