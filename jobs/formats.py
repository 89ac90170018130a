"""JSONL and CSV inputs beside Parquet: one scan per file at planning, bounded reads after.

The scan (`inspect_text`, on the driver) reads a file once: it counts rows, records the
byte offset of every GROUP_ROWS-th row (the planner's "row groups", `jobs/plan.py`),
hashes the bytes (the file's content identity) and infers one Arrow schema for the whole
file, so that every partition reads its rows with the same column types.

A partition (`read_text`, on a worker) seeks to its row group and reads its rows. The
scan and the reads walk the file with one record reader (`jobs/text_records.py`), so they
agree on where every row starts. JSONL lines are parsed by `load_json` (depth-bounded) and
their values put in the file's columns exactly or not at all (`jobs/json_columns.py`);
CSV records are split into fields by Python's csv module and pyarrow converts the fields
to the column types. A row that cannot be read becomes a row of nulls plus a message
naming the file and line, and the job writes it as an error row (`LineErrors`).
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import logging
import re

import pyarrow as pa
import pyarrow.csv as pcsv

from fusegen.jobs.batch_checks import BatchScan
from fusegen.jobs.errors import JobError
from fusegen.jobs.json_columns import row_schema, to_table, widen
from fusegen.jobs.plan import InputFile, TextLayout, TextSlice
from fusegen.jobs.text_records import Record, records

JSONL, CSV, OPENAI_BATCH = "jsonl", "csv", "openai_batch"
SUFFIXES = {".jsonl": JSONL, ".ndjson": JSONL, ".csv": CSV}
GROUP_ROWS = 256  # rows between recorded offsets: a partition skips at most this many
BATCH_KEYS = ("custom_id", "method", "url", "body")  # OpenAI Batch API request lines
INVALID_LINE = "invalid_line"  # the error code of a row that could not be read
# How deep arrays and objects may nest in one JSON text. Python's parser, and the code
# walking a parsed value, recurse once a level and die near 1,000 (RecursionError), and a
# Parquet reader refuses a schema nested past 100 levels (a list takes two): a JSONL
# column nested 50 lists deep would make an output no one can read. Real rows (messages,
# schemas, parameters) nest a few levels.
MAX_JSON_DEPTH = 32
log = logging.getLogger("fusegen.jobs")

LineErrors = dict  # row index within the partition -> "file line N: what is wrong"


def text_format(path: str) -> str | None:
    """JSONL or CSV by the file's extension; None for anything else (Parquet)."""
    lower = path.lower()
    return next((fmt for suffix, fmt in SUFFIXES.items() if lower.endswith(suffix)), None)


class JsonTooDeep(ValueError):
    """A JSON text nested deeper than allowed; the message gives its depth and the limit."""


def load_json(text: str | bytes, limit: int = MAX_JSON_DEPTH):
    """`json.loads`, refusing a text nested more than `limit` levels deep (JsonTooDeep)
    before parsing it; other malformed text raises ValueError, as json.loads does."""
    opens = (b"[", b"{") if isinstance(text, bytes) else ("[", "{")
    if text.count(opens[0]) + text.count(opens[1]) > limit:  # else it cannot be too deep
        depth = json_depth(text)
        if depth > limit:
            raise JsonTooDeep(f"nests arrays and objects {depth} levels deep, past "
                              f"fusegen's limit of {limit} levels")
    return json.loads(text)


def json_depth(text: str | bytes) -> int:
    """How deep a JSON text's arrays and objects nest (`1`: 0, `{"a": [1]}`: 2), counted
    without recursion, so any text can be measured; brackets inside strings do not count."""
    if isinstance(text, bytes):
        brackets = _STRING_B.sub(b"", text).translate(None, _NOT_BRACKETS_B)
        opens = (ord("["), ord("{"))
    else:
        brackets = _NOT_BRACKETS.sub("", _STRING.sub("", text))
        opens = ("[", "{")
    depth = deepest = 0
    for c in brackets:
        depth += 1 if c in opens else -1
        deepest = max(deepest, depth)
    return deepest


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STRING_B = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_NOT_BRACKETS_B = bytes(sorted(set(range(256)) - set(b"[]{}")))


def inspect_text(fs, path: str, fmt: str, batch: BatchScan | None = None) -> InputFile:
    """Scan a JSONL or CSV file (see the module's docstring). An OpenAI batch request file
    (a JSONL file whose first row has custom_id, method, url and body) gets the format
    `openai_batch` and no schema: its lines are parsed per request (`jobs/openai_batch.py`),
    and `batch`, the job's BatchScan, notes its problem lines (the caller attaches them,
    `with_batch_checks`, once every file is read; without one, the file's own are)."""
    alone = batch is None
    batch = BatchScan(load_json) if alone else batch
    scan = _Scan(fmt, batch, path)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for record in records(f, fmt == CSV, digest):
            scan.add(record)
    scan.finish()
    if scan.format == OPENAI_BATCH and scan.models:
        log.warning("input %s: requests name model(s) %s; fusegen serves every request with "
                    "--model and ignores body.model", path, ", ".join(sorted(scan.models)))
    layout = TextLayout(scan.format, tuple(scan.offsets), tuple(scan.lines), scan.schema)
    columns = BATCH_KEYS if scan.format == OPENAI_BATCH else tuple(scan.schema.names)
    file = InputFile(path, tuple(scan.groups), columns, size=fs.info(path).get("size"),
                     version="sha256=" + digest.hexdigest(), text=layout)
    return with_batch_checks([file], batch)[0] if alone else file


def with_batch_checks(files: list[InputFile], batch: BatchScan) -> list[InputFile]:
    """The files, each batch file with the LineChecks `batch` found in it, across all of
    them (a custom_id two files share fails in both). A JSONL file of no line among batch
    files is one of them: it holds nothing that could be another format."""
    checks = batch.finish()
    any_batch = any(f.text is not None and f.text.format == OPENAI_BATCH for f in files)
    out = []
    for f in files:
        if any_batch and f.num_rows == 0 and f.text is not None and f.text.format == JSONL:
            f = dataclasses.replace(f, columns=BATCH_KEYS, text=dataclasses.replace(
                f.text, format=OPENAI_BATCH, schema=None))
        if f.path in checks:
            f = dataclasses.replace(f, text=dataclasses.replace(f.text, checks=checks[f.path]))
        out.append(f)
    return out


class _Scan:
    """Rows, offsets and the schema of one file, built record by record."""

    def __init__(self, fmt: str, batch: BatchScan, path: str):
        self.format = fmt
        self.groups, self.offsets, self.lines = [], [], []
        self.schema = pa.schema([])
        self.names: list[str] | None = None  # a CSV file's header
        self.models: set[str] = set()
        self._group: list[Record] = []
        self._decided = False  # JSONL: whether a line parsed, telling batch files apart
        self._kinds: dict[str, str] = {}  # JSONL: each column's kind (`row_schema`)
        self._batch = batch
        # While the file may be a batch file, every line goes to the batch checks (lines
        # before the first that parses too: they may be bad UTF-8 or name a custom_id).
        self._file = batch.start(path) if fmt == JSONL else None

    def add(self, record: Record) -> None:
        if self.format == CSV and self.names is None:
            self.names = _csv_header(record)
            return
        if self.format == JSONL and not self._decided:
            self._detect_batch(record.raw)
        if self._file is not None:
            self._batch_line(record)
        if len(self._group) == GROUP_ROWS:
            self._close_group()
        if not self._group:
            self.offsets.append(record.offset)
            self.lines.append(record.line)
        self._group.append(record)

    def finish(self) -> None:
        self._close_group()
        if self._file is not None and self.format != OPENAI_BATCH:  # no line parsed
            self._drop_batch()
        if self.format == CSV and self.names is not None:
            # Columns no row filled (or a file of a header alone) read as strings.
            self.schema = pa.schema([pa.field(n, pa.string()) if self.schema.get_field_index(n)
                                     < 0 or self.schema.field(n).type == pa.null() else
                                     self.schema.field(n) for n in self.names])

    def _close_group(self) -> None:
        if not self._group:
            return
        self.groups.append(len(self._group))
        if self.format != OPENAI_BATCH:
            group = _csv_schema(self._group, self.names) if self.format == CSV else \
                row_schema([r for r, _ in map(_json_row, self._group) if r is not None],
                           self._kinds)
            self.schema = merge_schemas(self.schema, group, self.format == CSV)
        self._group = []

    def _detect_batch(self, raw: bytes) -> None:
        """The first line that parses decides (a malformed first line is an error row).
        Bad bytes are replaced here: a batch file saved as Latin-1 is still one, and its
        lines the error lines of a batch file (not UTF-8), not rows of another format."""
        try:
            first = load_json(raw.decode("utf-8", "replace"))
        except ValueError:
            return
        self._decided = True
        if isinstance(first, dict) and all(k in first for k in ("custom_id", "body")):
            self.format = OPENAI_BATCH
        else:
            self._drop_batch()

    def _drop_batch(self) -> None:
        self._batch.drop(self._file)
        self._file = None

    def _batch_line(self, record: Record) -> None:
        line = self._batch.add(self._file, record.line, record.raw)
        body = line.get("body") if isinstance(line, dict) else None
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and len(self.models) < 10:
            self.models.add(model)


def _csv_header(record: Record) -> list[str]:
    if record.problem is not None:
        raise JobError(f"the CSV header (line {record.line}) {record.problem}")
    names = [n.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
             for n in record.fields]
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise JobError(f"the CSV header repeats the column {repeated!r}; rename the columns "
                       "so that every name is unique")
    return names


def _csv_schema(group: list[Record], names: list[str]) -> pa.Schema:
    """pyarrow's inference over the group's readable records."""
    good = [r.fields for r in group if _csv_problem(r, len(names)) is None]
    if not good:
        return pa.schema([])
    try:
        return _read_csv(_csv_bytes(good), names, None).schema
    except (pa.ArrowException, ValueError):
        return pa.schema([pa.field(n, pa.string()) for n in names])


def _csv_problem(record: Record, num_columns: int) -> str | None:
    if record.problem is not None:
        return record.problem
    try:
        record.raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"is not valid UTF-8 (byte {exc.start} of the record)"
    if len(record.fields) != num_columns:
        return f"has {len(record.fields)} fields where the header has {num_columns}"
    return None


def _csv_bytes(rows: list[list[str]]) -> bytes:
    """Parsed rows written out again as plain CSV (every field holding a comma, quote or
    line end quoted, quotes doubled), which pyarrow reads exactly one row per record."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerows(rows)
    return out.getvalue().encode("utf-8")


def _read_csv(data: bytes, names: list[str], schema: pa.Schema | None) -> pa.Table:
    types = {f.name: f.type for f in schema} if schema is not None else None
    # One block: a record never straddles two (a long field would fail to parse).
    read = pcsv.ReadOptions(column_names=names, use_threads=False, block_size=len(data) + 1)
    return pcsv.read_csv(io.BytesIO(data), read_options=read,
                         parse_options=pcsv.ParseOptions(newlines_in_values=True),
                         convert_options=pcsv.ConvertOptions(column_types=types))


def _json_row(record: Record) -> tuple[dict | None, str | None]:
    """(the line's row, None) or (None, what is wrong with the line)."""
    try:
        row = load_json(record.raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"is not valid UTF-8 (byte {exc.start} of the line)"
    except JsonTooDeep as exc:
        return None, str(exc)
    except ValueError as exc:
        return None, f"is not JSON ({exc})"
    if not isinstance(row, dict):
        return None, f"is a JSON {type(row).__name__}, not an object of column: value"
    return row, None


def merge_schemas(a: pa.Schema, b: pa.Schema, to_string: bool) -> pa.Schema:
    """Field by field: promotable types widen (int64 + double -> double, null + x -> x);
    others become strings (`to_string`: CSV, where any value is text) or keep a's type
    (JSONL: the file's earlier rows decide, and a value not fitting is its row's error)."""
    fields = {f.name: f for f in a}
    for f in b:
        old = fields.get(f.name)
        if old is None:
            fields[f.name] = f
            continue
        merged = widen(old.type, f.type) or (pa.string() if to_string else old.type)
        fields[f.name] = pa.field(f.name, merged)
    return pa.schema(list(fields.values()))


def read_text(fs, path: str, text: TextSlice, num_rows: int) -> tuple[pa.Table, LineErrors]:
    """The partition's rows as a table of the file's schema, and its unreadable rows."""
    rows = []
    with fs.open(path, "rb") as f:
        f.seek(text.offset)
        skip = text.skip
        for record in records(f, text.format == CSV, None, text.offset, text.line - 1):
            if skip:
                skip -= 1
                continue
            rows.append(record)
            if len(rows) == num_rows:
                break
    if len(rows) != num_rows:
        raise JobError(f"input file {path} changed while the job ran (rows "
                       f"{text.skip}.. after line {text.line} are missing); rerun the job")
    if text.format == OPENAI_BATCH:
        return pa.table({"line": pa.array([r.line for r in rows], pa.int64()),
                         "request": [r.raw.decode("utf-8", "replace") for r in rows]}), {}
    table, problems = _csv_table(rows, text.schema) if text.format == CSV else \
        _jsonl_table(rows, text.schema)
    if table.num_rows != num_rows:  # never: one reader decides the plan's rows and these
        raise JobError(f"input file {path}: read {table.num_rows} rows from line "
                       f"{rows[0].line} where the plan has {num_rows}; please report this")
    return table, {i: f"{path} line {rows[i].line} {problem}; fix or drop the line"
                   for i, problem in sorted(problems.items())}


def _csv_table(rows: list[Record], schema: pa.Schema) -> tuple[pa.Table, dict]:
    """The records' fields in the file's column types: all at once, or one by one when
    that fails, so that one bad record costs its row only."""
    problems = {i: p for i, r in enumerate(rows)
                if (p := _csv_problem(r, len(schema))) is not None}
    good = [i for i in range(len(rows)) if i not in problems]
    try:
        table = _read_csv(_csv_bytes([rows[i].fields for i in good]), schema.names,
                          schema) if good else schema.empty_table()
    except (pa.ArrowException, ValueError):
        table = None
    if table is None or table.num_rows != len(good):
        tables = []
        for i in good:
            try:
                tables.append(_read_csv(_csv_bytes([rows[i].fields]), schema.names, schema))
            except (pa.ArrowException, ValueError) as exc:
                problems[i] = ("does not match the column types of the file's other rows "
                               f"({exc})")
        good = [i for i in good if i not in problems]
        table = pa.concat_tables([schema.empty_table(), *tables]).combine_chunks()
    return _with_null_rows(table, good, len(rows)), problems


def _with_null_rows(table: pa.Table, good: list[int], num_rows: int) -> pa.Table:
    """`table` holds rows `good` of `num_rows`; the others become rows of nulls."""
    if len(good) == num_rows:
        return table
    at = dict(zip(good, range(len(good))))
    padded = pa.concat_tables([table, pa.Table.from_pylist([{}], schema=table.schema)])
    return padded.take([at.get(i, len(good)) for i in range(num_rows)]).combine_chunks()


def _jsonl_table(rows: list[Record], schema: pa.Schema) -> tuple[pa.Table, dict]:
    values, problems = [], {}
    for i, record in enumerate(rows):
        row, problem = _json_row(record)
        values.append(row)
        if problem is not None:
            problems[i] = problem
    table, misfits = to_table(values, schema)
    return table, {**problems, **misfits}


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
