"""The output-directory protocol, one for `fusegen run` and for workflow transform steps.

An output directory holds committed parts (`part-NNNNN.parquet`), a `_manifest.json` and,
while a run is going, a `_tmp/` folder. Its life:
1. `Output.prepare`: check it is writable, take its lease (`jobs/lease.py`: one run at a
   time; a second is refused naming the first), read the old manifest, decide fresh /
   resume / overwrite, clear it or drop the `_tmp/` leftovers, return the parts already
   committed.
2. `Output.start`: the manifest with status "running", before any part is written.
3. `Output.commit` (on any worker): a part under `_tmp/`, renamed onto its final name, so
   a part is either absent or complete; its footer carries its `PartStats`. It commits
   only while its run holds the lease.
4. `Output.finish`: the manifest with status "complete"; `_tmp/` removed; the lease
   released. Or `Output.interrupt`: the manifest with status "interrupted", or
   `Output.fail`: status "failed" with the error and the command that resumes; the lease
   released. `Output.release` alone when the run stops before `start`.

A part is kept on resume only when its footer names this output's fingerprint (a hash of
the output's config and its planned inputs: paths, row counts and content identity; for a
generation job also the dtype it resolved and its model's files, `jobs/identity.py`) and
its row counts match the plan. An output written before fusegen recorded the dtype and
the model's files keeps its parts under their fingerprint (`earlier_fingerprint` in the
manifest) when it holds the same job in the same dtype.

JSONL parts (`part-NNNNN.jsonl`) have no footer: their `PartStats` and the sizes of their
files go in `_parts/part-NNNNN.jsonl.json`, written after the files, so that record is the
commit (a file without one is redone). An OpenAI batch job's part files live under
`_parts/` too; `finish` concatenates them in plan order into `output.jsonl` and
`errors.jsonl` (`jobs/openai_batch.py`).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from fusegen.jobs.errors import JobError
from fusegen.jobs.identity import output_fingerprint  # noqa: F401 - where callers find it
from fusegen.jobs.lease import Lease, check_holder
from fusegen.jobs.plan import Partition
from fusegen.jobs.redact import redact_url
from fusegen.jobs.storage import check_writable, filesystem, list_names, move, remove_tree

TMP_DIR = "_tmp"
PARTS_DIR = "_parts"  # JSONL parts' records, and an OpenAI batch job's part files
MERGED = ("output.jsonl", "errors.jsonl")  # an OpenAI batch job's results, merged
MANIFEST = "_manifest.json"
FRESH, RESUME, OVERWRITE = "fresh", "resume", "overwrite"
_META_KEY = b"fusegen"  # a part's footer key for its PartStats (JSON)


@dataclass(slots=True)
class PartStats:
    """What one committed part holds; kept in its Parquet footer and in the manifest."""
    name: str
    fingerprint: str  # the output that wrote it
    num_rows: int = 0
    num_errors: int = 0
    errors_by_code: dict = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seconds: float = 0.0  # read + compute + write, on the worker
    # Rows read from the input partition; None: num_rows (a generation part keeps every
    # input row, a transform's filter may drop some).
    num_input_rows: int | None = None
    # A generation part's rows cut at their length limit (finish_reason "length":
    # max_tokens or the context) and rows whose structured output is invalid
    # (structured_valid False); None: not counted (a transform's part, or one committed
    # before fusegen counted them).
    num_truncated: int | None = None
    num_structured_invalid: int | None = None

    def as_dict(self) -> dict:
        """The footer and manifest record; None fields left out."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def rows_read(self) -> int:
        return self.num_rows if self.num_input_rows is None else self.num_input_rows


def input_records(files) -> list[dict]:
    """The planned inputs as the fingerprint and the manifest record them: a file
    rewritten in place changes its size or version, so the fingerprint changes too."""
    return [{"path": redact_url(f.path), "num_rows": f.num_rows, "size": f.size,
             "version": f.version} for f in files]


class Output:
    """One output directory at an fsspec URL (the driver's and each worker's own).
    `owner`: on a worker, the id of the run whose lease its commits must find."""

    def __init__(self, url: str, storage_options: dict, owner: str | None = None):
        self.url = url
        self.fs, path = filesystem(url, storage_options)
        self.path = path.rstrip("/")
        self.owner = owner
        self._lease: Lease | None = None
        self.earlier_fingerprint: str | None = None  # set by prepare

    def read_manifest(self) -> dict | None:
        """None without a manifest; {} for one that is not JSON (treated as another job's)."""
        path = f"{self.path}/{MANIFEST}"
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "rb") as f:
            try:
                return json.loads(f.read())
            except ValueError:
                return {}

    def prepare(self, fingerprint: str, config: dict, plan: list[Partition],
                overwrite: bool, inputs: list | None = None, identity=None
                ) -> tuple[dict | None, dict[int, PartStats]]:
        """Take the lease, decide fresh / resume / overwrite (JobError when the output
        holds another job or another run holds the output); returns the old manifest to
        carry on (None once overwritten) and index -> PartStats of the parts to keep.
        `inputs`: this run's `input_records`, to name a changed input; `identity`: a
        generation job's `JobIdentity` (dtype, model files), to name a changed one and
        to keep the parts of an output written before fusegen recorded it (their
        fingerprint is then `earlier_fingerprint`)."""
        check_writable(self.fs, self.path, redact_url(self.url))
        self._lease = Lease(self.fs, self.path, redact_url(self.url))
        self._lease.acquire()  # before the old manifest is read or anything removed
        self.owner = self._lease.owner
        try:
            return self._prepare(fingerprint, config, plan, overwrite, inputs, identity)
        except BaseException:
            self.release()
            raise

    def _prepare(self, fingerprint, config, plan, overwrite, inputs, identity):
        old = self.read_manifest()
        names = list_names(self.fs, self.path)
        has_parts = PARTS_DIR in names or any(is_part_name(n) for n in names)
        mode = resume_mode(old, fingerprint, config, has_parts,
                           overwrite, redact_url(self.url), inputs, identity)
        if mode == OVERWRITE:
            self._clear()
            return None, {}
        if TMP_DIR in names:  # leftovers of a killed run: never committed, never read
            remove_tree(self.fs, f"{self.path}/{TMP_DIR}")
        if mode != RESUME:
            return old, {}
        if old.get("fingerprint") == fingerprint:
            self.earlier_fingerprint = old.get("earlier_fingerprint")
        elif identity is not None:
            self.earlier_fingerprint = identity.earlier_fingerprint(old, config, inputs)
        kept = (fingerprint, self.earlier_fingerprint) if self.earlier_fingerprint else \
            (fingerprint,)
        return old, self.committed(plan, kept)

    def start(self, manifest: dict) -> None:
        manifest["status"] = "running"
        self._write_manifest(manifest)

    def commit(self, table: pa.Table, stats: PartStats) -> None:
        """Write under _tmp/ with a unique name, then rename onto the final name. A retried
        partition (killed worker) writes its own temporary file and commits the same content."""
        if stats.name.endswith(".jsonl"):
            self.commit_files(stats, {stats.name: jsonl_bytes(table.to_pylist())})
            return
        meta = dict(table.schema.metadata or {})
        meta[_META_KEY] = json.dumps(stats.as_dict()).encode()
        table = table.replace_schema_metadata(meta)
        tmp = self._tmp_name(stats.name)
        with self.fs.open(tmp, "wb") as f:
            pq.write_table(table, f)
        self._check_lease()
        move(self.fs, tmp, f"{self.path}/{stats.name}")

    def commit_files(self, stats: PartStats, files: dict[str, bytes]) -> None:
        """Commit a JSONL part: its files (paths relative to the output), then its record
        `_parts/<name>.json` with their sizes; only that record makes the part count."""
        sizes, tmps = {}, {}
        for rel, data in files.items():
            tmps[rel] = self._tmp_name(rel.replace("/", "_"))
            with self.fs.open(tmps[rel], "wb") as f:
                f.write(data)
            sizes[rel] = len(data)
        self._check_lease()
        self.fs.makedirs(f"{self.path}/{PARTS_DIR}", exist_ok=True)
        for rel, tmp in tmps.items():
            move(self.fs, tmp, f"{self.path}/{rel}")
        record = json.dumps({"stats": stats.as_dict(), "files": sizes}).encode()
        tmp = self._tmp_name(stats.name + ".json")
        with self.fs.open(tmp, "wb") as f:
            f.write(record)
        move(self.fs, tmp, f"{self.path}/{PARTS_DIR}/{stats.name}.json")

    def finish(self, manifest: dict) -> None:
        self._check_lease()
        self._merge([p["name"] for p in manifest.get("parts", [])])
        manifest["status"] = "complete"
        self._write_manifest(manifest)
        remove_tree(self.fs, f"{self.path}/{TMP_DIR}")
        self.release()

    def interrupt(self, manifest: dict) -> None:
        """The run stopped early (a signal): say so in the manifest; the lease goes."""
        self._check_lease()
        manifest["status"] = "interrupted"
        self._write_manifest(manifest)
        self.release()

    def fail(self, manifest: dict, error: str, resume: str) -> None:
        """The run failed: the manifest says so, with the error (credentials already
        masked) and how to resume; the lease goes. Written only while this run holds the
        lease (a run that lost it must not touch the manifest of the one that took it)."""
        self._check_lease()
        manifest.update(status="failed", error=error, resume=resume)
        self._write_manifest(manifest)
        self.release()

    def release(self) -> None:
        """Give the output up (idempotent): the next run may take it."""
        if self._lease is not None:
            self._lease.release()

    def _check_lease(self) -> None:
        if self.owner is not None:
            check_holder(self.fs, self.path, self.owner, redact_url(self.url))

    def _write_manifest(self, manifest: dict) -> None:
        tmp = self._tmp_name(MANIFEST)
        with self.fs.open(tmp, "wb") as f:
            f.write(json.dumps(manifest, indent=2, sort_keys=True, default=str).encode())
        move(self.fs, tmp, f"{self.path}/{MANIFEST}")

    def _tmp_name(self, name: str) -> str:
        self.fs.makedirs(f"{self.path}/{TMP_DIR}", exist_ok=True)
        return f"{self.path}/{TMP_DIR}/{name}.{uuid.uuid4().hex}"

    def _merge(self, names: list[str]) -> None:
        """Concatenate the part files under _parts/ (an OpenAI batch job's), in plan
        order, into output.jsonl and errors.jsonl, each written whole then renamed."""
        records = [self._record(n) for n in names if n.endswith(".jsonl")]
        inner = [rel for r in records if r for rel in r["files"] if rel.startswith(PARTS_DIR)]
        if not inner:
            return
        for target in MERGED:
            tmp = self._tmp_name(target)
            with self.fs.open(tmp, "wb") as out:
                for rel in inner:
                    if merged_name(rel) == target:
                        with self.fs.open(f"{self.path}/{rel}", "rb") as f:
                            out.write(f.read())
            move(self.fs, tmp, f"{self.path}/{target}")

    def _clear(self) -> None:
        """Remove what a run writes (parts, manifest, temporaries) and nothing else."""
        for name in list_names(self.fs, self.path):
            if name in (TMP_DIR, PARTS_DIR):
                remove_tree(self.fs, f"{self.path}/{name}")
            elif name == MANIFEST or is_part_name(name) or name in MERGED:
                self.fs.rm_file(f"{self.path}/{name}")

    def committed(self, plan: list[Partition], fingerprint: str | tuple[str, ...]
                  ) -> dict[int, PartStats]:
        """index -> PartStats of the parts this output committed with the planned row
        counts (under `fingerprint`, or any of several); anything else (another output's
        part, a short or damaged one) is redone."""
        kept = (fingerprint,) if isinstance(fingerprint, str) else tuple(fingerprint)
        existing = list_names(self.fs, self.path)
        done = {}
        records = PARTS_DIR in existing and list_names(self.fs, f"{self.path}/{PARTS_DIR}")
        for part in plan:
            if part.name.endswith(".jsonl"):
                stats = self._jsonl_stats(part.name) if records and \
                    f"{part.name}.json" in records else None
                if stats is not None and stats.fingerprint in kept \
                        and stats.rows_read == part.num_rows:
                    done[part.index] = stats
            elif part.name in existing:
                stats = self._footer_stats(part.name)
                if stats is not None and stats.fingerprint in kept \
                        and stats.rows_read == part.num_rows:
                    done[part.index] = stats
        return done

    def _record(self, name: str) -> dict | None:
        """A JSONL part's record, when every file it names has the size it records."""
        try:
            with self.fs.open(f"{self.path}/{PARTS_DIR}/{name}.json", "rb") as f:
                record = json.loads(f.read())
            for rel, size in record["files"].items():
                if self.fs.size(f"{self.path}/{rel}") != size:
                    return None
        except (OSError, ValueError, KeyError, TypeError):  # missing, damaged or foreign
            return None
        return record

    def _jsonl_stats(self, name: str) -> PartStats | None:
        record = self._record(name)
        try:
            return PartStats(**record["stats"]) if record else None
        except TypeError:
            return None

    def _footer_stats(self, name: str) -> PartStats | None:
        """The part's PartStats when its footer holds one that matches its row count."""
        try:
            with self.fs.open(f"{self.path}/{name}", "rb") as f:
                md = pq.ParquetFile(f).metadata
            raw = (md.metadata or {}).get(_META_KEY)
            stats = PartStats(**json.loads(raw)) if raw else None
        except (OSError, pa.ArrowException, TypeError, ValueError):  # damaged or foreign
            return None
        return stats if stats is not None and stats.num_rows == md.num_rows else None


def is_part_name(name: str) -> bool:
    return name.startswith("part-") and name.endswith((".parquet", ".jsonl"))


def merged_name(rel: str) -> str:
    """Which merged file an OpenAI batch part file goes into."""
    return MERGED[1] if rel.endswith(".errors.jsonl") else MERGED[0]


def jsonl_bytes(rows: list[dict]) -> bytes:
    """One JSON object per line; values JSON lacks (bytes, dates) as their text."""
    return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n"
                   for r in rows).encode("utf-8")


def resume_mode(old: dict | None, fingerprint: str, config: dict, has_parts: bool,
                overwrite: bool, output: str, inputs: list | None = None,
                identity=None) -> str:
    """FRESH, RESUME or OVERWRITE; raises JobError when the output holds another job
    (one written in another dtype: naming both)."""
    if overwrite:
        return OVERWRITE
    if old is None:
        if has_parts:
            raise JobError(f"output {output} holds part files but no {MANIFEST}, so they are "
                           "not from this job; pass --overwrite to replace them or choose "
                           "another --output")
        return FRESH
    if old.get("fingerprint") == fingerprint:
        return RESUME
    if not has_parts:  # e.g. the model failed to load: nothing to keep, nothing to lose
        return FRESH
    if "fingerprint" not in old:
        raise JobError(f"output {output} holds part files and a {MANIFEST} that is damaged "
                       "or not fusegen's, so they cannot be matched to this job; pass "
                       "--overwrite to replace them or choose another --output")
    changes = _changes(old, config, inputs, identity)
    if identity is not None:
        earlier = identity.earlier_fingerprint(old, config, inputs) is not None
        identity.check_dtype(old, output, earlier, changes)
        if earlier:
            return RESUME
    what = "; ".join(changes) or "the input files or their row counts"
    raise JobError(f"output {output} holds a different job (changed: {what}); rerun with "
                   "--overwrite to start afresh, or choose another --output")


def _changes(old: dict, config: dict, inputs: list | None, identity=None) -> list[str]:
    """What differs between the old manifest and this run: config keys, the model's
    files, then inputs."""
    before = old.get("config", {})
    changed = [f"{k}: {before.get(k)!r} -> {v!r}" for k, v in config.items()
               if before.get(k) != v]
    if identity is not None:
        changed += identity.changes(old)
    if inputs is None:
        return changed
    was = {r.get("path"): r for r in old.get("inputs", [])}
    now = {r["path"]: r for r in inputs}
    changed += [f"input {p} is gone" for p in was if p not in now]
    changed += [f"input {p} is new" for p in now if p not in was]
    for path in (p for p in now if p in was):
        diffs = [f"{k} {was[path].get(k)!r} -> {v!r}" for k, v in now[path].items()
                 if k != "path" and was[path].get(k) != v]
        if diffs:
            changed.append(f"input {path} was rewritten ({', '.join(diffs)})")
    return changed
