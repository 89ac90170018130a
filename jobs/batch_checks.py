"""What planning's one read of a job's OpenAI batch files knows that a partition's own
lines cannot show: the lines that are not UTF-8 (a partition gets its lines decoded, bad
bytes replaced) and the custom_ids several lines share, in one file or across the job's
files (the results of all of them are merged into one `output.jsonl`, matched to requests
by custom_id).

`BatchScan` gathers both while the planner reads each line (`jobs/formats.py`, through
the record reader of `jobs/text_records.py`: one line numbering, one BOM rule); each file
keeps the `LineChecks` of its problem lines, and each partition gets those of its own
stretch (`jobs/plan.py`), so no worker reads a file twice.

Memory (measured over a million lines): during the scan a line naming a custom_id costs 24
bytes (its custom_id's 16-byte digest and where it is), 26 MB; the sort that finds the
shared ones peaks at 52 MB (87 MB where every custom_id is on two lines), all freed once
planned. The plan keeps line numbers of problem lines only: nothing for a file without
one; where every line shares its custom_id, 35 MB in the file's checks and 43 MB in the
partitions' (1,000-row partitions; each gets the lines of its own stretch, ~40 KB).
"""
from __future__ import annotations

import hashlib
import json
import re
from array import array
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np

SHOWN = 5  # other lines a duplicate's error names; "and N more" counts the rest
_LINE_BITS = 40  # a place is file index << 40 | line: files under 2^23, lines under 2^40
_LINE_MASK = (1 << _LINE_BITS) - 1


@dataclass(frozen=True, slots=True)
class SharedIds:
    """custom_ids that several lines hold: for each, how many lines hold it and where the
    first SHOWN + 1 of them are (enough to name SHOWN others from any of its lines)."""
    paths: tuple[str, ...]  # the files the places name
    counts: array  # lines holding each custom_id
    starts: array  # custom_id i's places are places[starts[i]:starts[i + 1]]
    places: array  # index in paths << _LINE_BITS | line, in input order

    def subset(self, used: list[int]) -> SharedIds:
        """The custom_ids `used` (ascending), renumbered 0.. and naming only their files."""
        spans = [self.places[self.starts[i]:self.starts[i + 1]] for i in used]
        files = sorted({p >> _LINE_BITS for span in spans for p in span})
        index = {f: n for n, f in enumerate(files)}
        places = array("q", ((index[p >> _LINE_BITS] << _LINE_BITS) | (p & _LINE_MASK)
                             for span in spans for p in span))
        starts = array("q", [0])
        for span in spans:
            starts.append(starts[-1] + len(span))
        return SharedIds(tuple(self.paths[f] for f in files),
                         array("q", (self.counts[i] for i in used)), starts, places)


@dataclass(frozen=True, slots=True)
class LineChecks:
    """The problem lines of one batch file, or of one partition's stretch of it."""
    bad_lines: array  # lines that are not valid UTF-8, ascending
    bad_at: array  # for each: its first bad byte's offset in the line x 256 + the byte
    shared_lines: array  # lines whose custom_id other lines of the job hold, ascending
    shared_ids: array  # for each: its custom_id's index in `ids`
    ids: SharedIds

    def not_utf8(self, line: int) -> str | None:
        """What is wrong with the line's bytes, or None."""
        i = _find(self.bad_lines, line)
        if i is None:
            return None
        offset, byte = divmod(self.bad_at[i], 256)
        return (f"is not valid UTF-8 (byte 0x{byte:02x} at byte {offset} of the line); "
                "save the file as UTF-8")

    def shared_with(self, path: str, line: int) -> str | None:
        """The other lines holding the custom_id of `path`'s `line` ("lines 3, 6", "line 2
        of b.jsonl", "... and 4 more"), or None when no other line holds it."""
        i = _find(self.shared_lines, line)
        if i is None:
            return None
        ids, n = self.ids, self.shared_ids[i]
        places = [(ids.paths[p >> _LINE_BITS], p & _LINE_MASK)
                  for p in ids.places[ids.starts[n]:ids.starts[n + 1]]]
        others = [p for p in places if p != (path, line)][:SHOWN]
        more = ids.counts[n] - 1 - len(others)
        return _describe(others, path) + (f" and {more} more" if more else "")

    def between(self, first: int, stop: int) -> LineChecks | None:
        """The checks of lines [first, stop), or None when none of them has a problem."""
        b = slice(bisect_left(self.bad_lines, first), bisect_left(self.bad_lines, stop))
        s = slice(bisect_left(self.shared_lines, first), bisect_left(self.shared_lines, stop))
        if b.start == b.stop and s.start == s.stop:
            return None
        used = sorted(set(self.shared_ids[s]))
        index = {old: new for new, old in enumerate(used)}
        return LineChecks(self.bad_lines[b], self.bad_at[b], self.shared_lines[s],
                          array("q", (index[i] for i in self.shared_ids[s])),
                          self.ids.subset(used))


def _find(lines: array, line: int) -> int | None:
    i = bisect_left(lines, line)
    return i if i < len(lines) and lines[i] == line else None


def _describe(others: list[tuple[str, int]], path: str) -> str:
    """Places grouped by file, this file's first: "lines 3, 6 of this file and line 2 of
    b.jsonl" ("of this file" only beside other files)."""
    def lines(in_file):
        numbers = [n for p, n in others if p == in_file]
        return f"line{'s' * (len(numbers) > 1)} {', '.join(map(str, numbers))}"
    files = list(dict.fromkeys(p for p, _ in others if p != path))
    pieces = [f"{lines(f)} of {f}" for f in files]
    if any(p == path for p, _ in others):
        pieces.insert(0, lines(path) + (" of this file" if files else ""))
    return " and ".join(pieces)


class BatchScan:
    """Fed line by line as planning reads a job's batch files, one file after another
    (`start`, then `add` for each of its lines); `finish` gives each file's LineChecks.
    `parse`: JSON text -> its value, raising ValueError (`formats.load_json`, whose depth
    bound every JSONL line is read with)."""

    def __init__(self, parse):
        self._parse = parse
        self.paths: list[str] = []
        self._digests = bytearray()  # 16 bytes per line naming a custom_id
        self._places = array("q")  # where each digest's line is
        self._bad: list[tuple[array, array]] = []  # per file: LineChecks.bad_lines, bad_at
        self._mark = 0  # where the last file's places start

    def start(self, path: str) -> int:
        self.paths.append(path)
        self._bad.append((array("q"), array("q")))
        self._mark = len(self._places)
        return len(self.paths) - 1

    def drop(self, file: int) -> None:
        """Forget the file just read: it is no batch file after all."""
        assert file == len(self.paths) - 1, "only the file being read can be dropped"
        del self.paths[-1], self._bad[-1], self._places[self._mark:]
        del self._digests[16 * self._mark:]

    def add(self, file: int, line: int, raw: bytes):
        """Judge one line's bytes (a Record's: a BOM at the file's start is none of them)
        and note its custom_id; returns the line's value, or None where it is no JSON."""
        try:
            text = raw.decode("utf-8")
            intact = True
        except UnicodeDecodeError as exc:
            bad_lines, bad_at = self._bad[file]
            bad_lines.append(line)
            bad_at.append(exc.start * 256 + raw[exc.start])
            text, intact = raw.decode("utf-8", "replace"), False
        try:
            obj = self._parse(text)
        except ValueError:  # not JSON, or nested too deep to read: the worker says which
            obj, custom_id = None, leading_custom_id(text)
        else:
            custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
        # A custom_id in replaced bytes is none the file holds: its line fails as not UTF-8.
        if isinstance(custom_id, str) and (intact or "\ufffd" not in custom_id):
            self._digests += digest(custom_id)
            self._places.append((file << _LINE_BITS) | line)
        return obj

    def finish(self) -> dict[str, LineChecks]:
        """path -> the file's LineChecks, for the files with a problem line."""
        ids, shared = self._shared()
        checks = {}
        for file, path in enumerate(self.paths):
            lines, at = self._bad[file]
            found = shared.get(file, (array("q"), array("q")))
            if lines or found[0]:
                checks[path] = LineChecks(lines, at, *found, ids)
        return checks

    def _shared(self) -> tuple[SharedIds, dict[int, tuple[array, array]]]:
        """The custom_ids several lines hold, and for each file its lines holding one
        (ascending) with their custom_id's index."""
        n = len(self._places)
        keys = np.frombuffer(self._digests, dtype=np.uint64).reshape(n, 2)  # no copy
        self._digests = bytearray()  # freed with `keys`
        order = np.lexsort((keys[:, 1], keys[:, 0]))  # stable: input order within a digest
        same = keys[order[1:], 0] == keys[order[:-1], 0]
        same &= keys[order[1:], 1] == keys[order[:-1], 1]  # sorted row i + 1 repeats row i
        del keys
        in_group = np.zeros(n, bool)
        in_group[1:] |= same
        in_group[:-1] |= same
        at = np.flatnonzero(in_group)  # sorted rows of the shared custom_ids, by custom_id
        first = np.ones(len(at), bool)
        first[1:] = ~same[at[1:] - 1]
        group = np.cumsum(first) - 1  # each row's custom_id, numbered 0..
        places = np.frombuffer(self._places, dtype=np.int64)[order[at]]
        self._places = array("q")
        del order, same, in_group
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, len(at)))
        rank = np.arange(len(at)) - starts[group]  # 0 for a custom_id's first line
        ids = SharedIds(tuple(self.paths), _array(counts),
                        _array(np.concatenate([[0], np.cumsum(np.minimum(counts, SHOWN + 1))])),
                        _array(places[rank <= SHOWN]))
        del first, rank, counts
        by_place = np.argsort(places, kind="stable")
        places, group = places[by_place], group[by_place]
        files = places >> _LINE_BITS
        shared = {}
        for file in np.unique(files):
            lo, hi = np.searchsorted(files, [file, file + 1])
            shared[int(file)] = (_array(places[lo:hi] & _LINE_MASK), _array(group[lo:hi]))
        return ids, shared


def _array(values: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(values, dtype=np.int64).data.cast("B"))  # one copy
    return out


def digest(custom_id: str) -> bytes:
    return hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


_LEADING_ID = re.compile(r'\s*\{\s*"custom_id"\s*:\s*("(?:[^"\\]|\\.)*")')


def leading_custom_id(text: str) -> str | None:
    """The custom_id of a line that cannot be read whole, when it is the line's first key
    (as OpenAI's examples and clients write it), so that its error line names it and the
    duplicate check counts it."""
    found = _LEADING_ID.match(text) if isinstance(text, str) else None
    try:
        return json.loads(found.group(1)) if found else None
    except ValueError:
        return None
