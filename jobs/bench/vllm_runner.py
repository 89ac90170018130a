"""Baseline: vLLM's offline API, in the Python interpreter `--vllm-python` names.

vLLM and fusegen need not share an environment: `vllm_child.py` runs in vLLM's own
interpreter on a job file (the checkpoint, the same prompt ids and budgets) and writes a
result file. Its output goes to a log in the bench cache. Anything that keeps vLLM from
running (no such interpreter, no vllm there, an engine that does not start on this CPU,
a crash, the timeout) makes the row skipped with vLLM's own error, never the bench fail.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from fusegen.jobs.bench.results import EngineResult
from fusegen.jobs.bench.workload import BenchRequest

CHILD = Path(__file__).with_name("vllm_child.py")
# vLLM's CPU docs ask for tcmalloc and Intel OpenMP preloaded.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
DEFAULT_KV_GIB = 4  # vLLM's own default asks for most of RAM and fails on a shared machine
_REASON_CHARS = 400
RSS_INTERVAL_S = 0.1  # how often the peak RSS of vLLM's processes is sampled
_EXCEPTION_LINE = re.compile(r"(?P<name>\w+(?:Error|Exception)): (?P<text>\S.*)$")
_CPU_VARIABLES = ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")


def vllm_env(python: str, device: str,
             base: Mapping[str, str] | None = None) -> tuple[dict, dict]:
    """(the child's whole environment, the variables below as it has them). On a CPU:
    LD_PRELOAD of tcmalloc and of the venv's libiomp5 where present, a KV cache of
    DEFAULT_KV_GIB and compute bound to every core (vLLM's default binding keeps one
    core for its scheduler). A variable already set in `base` wins over the computed one."""
    env = dict(os.environ if base is None else base)
    if not device.startswith("cpu"):
        return env, {}
    venv = Path(python).absolute().parent.parent  # not resolved: bin/python is a symlink
    preload = [str(p) for p in (TCMALLOC, venv / "lib" / "libiomp5.so") if p.exists()]
    computed = {"VLLM_CPU_KVCACHE_SPACE": str(DEFAULT_KV_GIB),
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{_num_cores() - 1}"}
    if preload:
        computed["LD_PRELOAD"] = ":".join(preload)
    for key, value in computed.items():
        env.setdefault(key, value)
    return env, {key: env[key] for key in _CPU_VARIABLES if key in env}


def _num_cores() -> int:
    """The cores this process may run on, as `nproc` counts them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _job(model_dir: Path, requests, warmup, *, dtype: str, max_model_len: int, seed: int,
         max_num_seqs: int | None) -> dict:
    def encode(rs: list[BenchRequest]) -> list[dict]:
        return [{"prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens} for r in rs]

    return {"model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
            "seed": seed, "max_num_seqs": max_num_seqs, "requests": encode(requests),
            "warmup": encode(warmup)}


def run_vllm(python: str, model_dir: Path, requests: list[BenchRequest],
             warmup: list[BenchRequest], *, dtype: str, device: str, max_model_len: int,
             seed: int, log_path: Path, timeout_s: float, max_num_seqs: int | None = None,
             env: Mapping[str, str] | None = None,
             progress: Callable[[str], None] = lambda _: None) -> EngineResult:
    result = EngineResult("vllm", "vLLM")
    executable = shutil.which(python)
    if executable is None:
        result.skipped = (f"skipped: --vllm-python {python} is not an executable file; "
                          "give the python of an environment with vLLM installed")
        return result
    child_env, used = vllm_env(executable, device, env)
    job = _job(model_dir, requests, warmup, dtype=dtype, max_model_len=max_model_len,
               seed=seed, max_num_seqs=max_num_seqs)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"vllm: running {python} (output in {log_path})")
    with tempfile.TemporaryDirectory(prefix="fusegen-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        start = time.perf_counter()
        timed_out, peak_rss = _run_child([executable, str(CHILD), str(job_path),
                                          str(out_path)], child_env, log_path, timeout_s)
        wall_s = time.perf_counter() - start
        answer = _read_result(out_path)
    if answer is None or "error" in answer:
        result.skipped = _failure(answer, timed_out, timeout_s, log_path)
        return result
    _fill(result, answer, requests, device)
    result.peak_rss_bytes = peak_rss
    result.extra.update({"python": python, "env": used, "log": str(log_path),
                         "max_num_seqs": max_num_seqs, "process_wall_s": wall_s})
    return result


def _run_child(command: list[str], env: dict, log_path: Path,
               timeout_s: float) -> tuple[bool, int | None]:
    """Runs the child with its output in the log: (whether it ran past the timeout, its
    peak RSS). It leads a session of its own, so that a timeout or Ctrl-C ends vLLM's
    engine processes too, and none of them outlives the run. The peak is the largest sum
    of RSS over the child and every process it started (vLLM runs its engine core in a
    process of its own), sampled every RSS_INTERVAL_S, its load included as fusegen's is;
    None where no sample could be read."""
    peak = None
    deadline = time.monotonic() + timeout_s
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                rss = _tree_rss(process.pid)
                peak = peak if rss is None else max(peak or 0, rss)
                try:
                    process.wait(timeout=min(RSS_INTERVAL_S,
                                             max(deadline - time.monotonic(), 0.0)))
                    return False, peak
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        return True, peak
        finally:
            _end_session(process)


def _tree_rss(pid: int) -> int | None:
    """The summed RSS of process `pid` and its descendants now (pages two of them share
    count twice); None when the process is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass  # ended between the listing and the reading
    return total


def _end_session(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the child and everything it started have exited
    process.wait()


def _read_result(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # the child died before writing it


def _failure(answer: dict | None, timed_out: bool, timeout_s: float, log_path: Path) -> str:
    if timed_out:
        why = f"did not finish within --vllm-timeout {timeout_s:g} s"
    elif answer is None:
        why = f"its process ended without a result: {_last_line(log_path)}"
    else:
        error = answer["error"]
        why = f"{error['type']}: {_first_line(error['message'])}"
        cause = _root_cause(log_path, error["message"])
        if cause:
            why += f" (root cause in the log: {cause})"
    return f"skipped: vLLM could not run: {why[:_REASON_CHARS]}; see {log_path}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def _log_lines(log_path: Path) -> list[str]:
    try:
        return log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _last_line(log_path: Path) -> str:
    lines = [line for line in _log_lines(log_path) if line.strip()]
    return lines[-1].strip() if lines else "(nothing in the log)"


def _root_cause(log_path: Path, message: str) -> str | None:
    """vLLM's engine fails in a worker process and raises a generic error in this one
    ("EngineCore encountered an issue. See stack trace (above) for the root cause"): the
    first `SomeError: message` in the log (worker lines carry a logging prefix) other
    than the raised one."""
    for line in _log_lines(log_path):
        found = _EXCEPTION_LINE.search(line)
        if found and found["text"].strip() not in message:
            return f"{found['name']}: {found['text'].strip()}"
    return None


def _fill(result: EngineResult, answer: dict, requests: list[BenchRequest], device: str) -> None:
    outputs = answer["outputs"]
    result.label = f"vLLM {answer['vllm_version']} ({device})"
    result.elapsed_s, result.load_s = answer["elapsed_s"], answer["load_s"]
    result.counts = [(o["num_prompt_tokens"], min(o["num_output_tokens"], r.max_tokens))
                     for r, o in zip(requests, outputs)]
    result.budgets_met = len(outputs) == len(requests) and all(
        o["num_output_tokens"] == r.max_tokens and o["finish_reason"] == "length"
        and o["num_prompt_tokens"] == r.num_prompt_tokens for r, o in zip(requests, outputs))
    reasons = [str(o["finish_reason"]) for o in outputs]
    result.extra = {"vllm_version": answer["vllm_version"],
                    "finish_reasons": {r: reasons.count(r) for r in sorted(set(reasons))}}
