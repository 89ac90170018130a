"""Peer: llama.cpp on the same GGUF file, in processes of its own (never imported).

`llama-server` when the folder has it: one slot per sequence fusegen runs at once (its
max_num_seqs, at most the number of requests), continuous batching, each slot's context
the workload's longest request; the warm-up requests, then every timed request posted at
once to /completion as token ids (greedy, ignore_eos, n_predict its budget), as vLLM
takes them. Without it, `llama-batched-bench`, for a fixed-length workload only: it
draws prompt ids of its own, so the shape is the same, not the ids. Both run with
fusegen's thread count (-t and -tb). Output goes to a log in the bench cache; a peer
that fails is a skipped row with its last lines, never the bench's end. Peak RSS: the
peer's own high-water mark (VmHWM), its load included, as fusegen's is.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fusegen.jobs.bench.results import EngineResult
from fusegen.jobs.bench.workload import BenchRequest

SERVER, BATCHED_BENCH = "llama-server", "llama-batched-bench"
SETUP_SCRIPT = "../shared/peers/llamacpp-setup.sh"
_CONTEXT_ROUND = 256  # llama.cpp pads a sequence's context to this
_TAIL_LINES = 6
_TAIL_CHARS = 600
_STOP_GRACE_S = 10.0

Progress = Callable[[str], None]


class PeerError(RuntimeError):
    """llama.cpp did not run the workload; the message says why."""


def default_bin_dir() -> Path:
    env = os.environ.get("FUSEGEN_LLAMACPP")
    return Path(env) if env else Path.home() / ".cache/fusegen-peers/llamacpp/build/bin"


def choose_tool(bin_dir: Path, fixed_length: bool) -> str:
    """The tool that will run: llama-server, else llama-batched-bench for a fixed-length
    workload; ValueError naming the folder and the setup script when neither fits."""
    if (bin_dir / SERVER).is_file():
        return SERVER
    if (bin_dir / BATCHED_BENCH).is_file() and fixed_length:
        return BATCHED_BENCH
    have = f"; it has {BATCHED_BENCH}, which runs fixed-length workloads only (every " \
           "prompt and output one length)" if (bin_dir / BATCHED_BENCH).is_file() else ""
    raise ValueError(f"--llamacpp {bin_dir}: no {SERVER} there{have}; build llama.cpp's "
                     f"tools with {SETUP_SCRIPT} [DIR] (it prints the folder to pass), or "
                     "set $FUSEGEN_LLAMACPP")


def is_fixed_length(requests: list[BenchRequest]) -> bool:
    return len({(r.num_prompt_tokens, r.max_tokens) for r in requests}) == 1


def run_llamacpp(bin_dir: Path, model: Path, requests: list[BenchRequest],
                 warmup: list[BenchRequest], *, threads: int, slots: int,
                 prefix_caching: bool, log_path: Path, timeout_s: float,
                 progress: Progress = lambda _: None) -> EngineResult:
    tool = choose_tool(bin_dir, is_fixed_length(requests))
    result = EngineResult("llamacpp", f"llama.cpp {tool}")
    slots = max(1, min(slots, len(requests)))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    progress(f"llama.cpp: {tool}, {slots} slots, {threads} threads (output in {log_path})")
    run = _serve if tool == SERVER else _batched_bench
    try:
        run(result, bin_dir, model, requests, warmup, threads=threads, slots=slots,
            prefix_caching=prefix_caching, log_path=log_path,
            deadline=time.monotonic() + timeout_s)
    except PeerError as exc:
        result.skipped = f"skipped: llama.cpp could not run: {exc}{_tail(log_path)}"
        return result
    result.extra.update({"tool": tool, "bin_dir": str(bin_dir), "threads": threads,
                         "slots": slots, "log": str(log_path),
                         "version": _version(bin_dir / tool)})
    return result


def context_per_slot(requests: list[BenchRequest]) -> int:
    """The longest request's prompt + output, rounded up as llama.cpp pads it."""
    longest = max(r.num_prompt_tokens + r.max_tokens for r in requests)
    return -(-longest // _CONTEXT_ROUND) * _CONTEXT_ROUND


def server_command(bin_dir: Path, model: Path, *, threads: int, slots: int,
                   ctx_per_slot: int, port: int) -> list[str]:
    # A KV stream per slot (not one unified pool): each sequence attends over its own
    # cells, as fusegen's and vLLM's paged caches do.
    return [str(bin_dir / SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * ctx_per_slot), "--no-kv-unified",
            "--cont-batching", "-t", str(threads), "-tb", str(threads), "--no-webui"]


def completion_body(request: BenchRequest, prefix_caching: bool) -> dict:
    """Token ids (no BOS added: the prompt is a list of numbers), greedy, exactly the
    budget. ignore_eos in llama.cpp also bars end-of-generation tokens from being drawn,
    where fusegen and vLLM draw them and go on: the tokens may differ, not their count."""
    return {"prompt": request.prompt_ids, "n_predict": request.max_tokens,
            "ignore_eos": True, "temperature": 0.0, "top_k": 1,
            "cache_prompt": prefix_caching}


# --- llama-server -----------------------------------------------------------------------

def _serve(result: EngineResult, bin_dir: Path, model: Path, requests, warmup, *, threads: int,
           slots: int, prefix_caching: bool, log_path: Path, deadline: float) -> None:
    port = _free_port()
    command = server_command(bin_dir, model, threads=threads, slots=slots,
                             ctx_per_slot=context_per_slot(requests + warmup), port=port)
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    peer = _Peer(command, bin_dir, log_path)
    try:
        _wait_ready(peer, url, deadline)
        result.load_s = time.perf_counter() - start
        _post_all(url, warmup, prefix_caching, deadline)  # untimed, as fusegen's warm-up
        start = time.perf_counter()
        answers = _post_all(url, requests, prefix_caching, deadline)
        result.elapsed_s = time.perf_counter() - start
    finally:
        peer.stop()
    result.peak_rss_bytes = peer.peak_rss_bytes
    result.counts = [(r.num_prompt_tokens, min(a["tokens_predicted"], r.max_tokens))
                     for r, a in zip(requests, answers)]
    result.budgets_met = all(a["tokens_predicted"] == r.max_tokens and a["stop_type"] == "limit"
                             for r, a in zip(requests, answers))
    stops = [str(a["stop_type"]) for a in answers]
    result.extra = {"command": command, "ctx_per_slot": context_per_slot(requests + warmup),
                    "stop_types": {s: stops.count(s) for s in sorted(set(stops))},
                    "prompt_tokens_cached": sum(a.get("timings", {}).get("cache_n", 0)
                                                for a in answers)}


class _Peer:
    """The peer's process, in a session of its own (a timeout or Ctrl-C ends all of it),
    its shared libraries from its own folder. Its peak RSS is its own VmHWM, read while
    it lives: a child's ru_maxrss would count this (large) process's RSS at the fork."""

    def __init__(self, command: list[str], bin_dir: Path, log_path: Path):
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(bin_dir), env.get("LD_LIBRARY_PATH")) if p)
        self.peak_rss_bytes: int | None = None
        with open(log_path, "w") as log:
            try:
                self.process = subprocess.Popen(
                    command, env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)
            except OSError as exc:
                raise PeerError(f"{command[0]} did not start: {exc}") from None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def poll(self) -> int | None:
        if self.process.returncode is None:
            self._sample_rss()
        return self.process.poll()

    def wait(self, deadline: float) -> int:
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise PeerError("it did not finish within --llamacpp-timeout")
            time.sleep(0.05)
        return self.returncode

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace; reaped either way, and anything it left
        in its session ended."""
        if self.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        self._signal(signal.SIGKILL)

    def _sample_rss(self) -> None:
        """VmHWM only grows: the last reading before the peer ends is its peak."""
        try:
            with open(f"/proc/{self.process.pid}/status") as f:
                found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
        except OSError:
            return  # gone, or no /proc
        if found:
            self.peak_rss_bytes = max(self.peak_rss_bytes or 0, int(found[1]) * 1024)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the session has ended


def _wait_ready(peer: _Peer, url: str, deadline: float) -> None:
    """Until /health answers 200 (503 while the model loads)."""
    while True:
        if peer.poll() is not None:
            raise PeerError(f"{SERVER} exited with status {peer.returncode} before it "
                            "was ready")
        if time.monotonic() > deadline:
            raise PeerError("it was not ready within --llamacpp-timeout")
        try:
            with _OPENER.open(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or still loading (503)
        time.sleep(0.1)


# A client that never goes through an http_proxy the environment names.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _post_all(url: str, requests: list[BenchRequest], prefix_caching: bool,
              deadline: float) -> list[dict]:
    """Every request posted at once, each on a thread of its own; the answers in order.
    The server queues what its slots cannot take yet."""
    if not requests:
        return []
    pool = ThreadPoolExecutor(max_workers=min(len(requests), 512))
    try:
        futures = [pool.submit(_post, url, completion_body(r, prefix_caching), deadline)
                   for r in requests]
        return [f.result() for f in futures]
    finally:  # on a failure, no wait for the others: stopping the server ends them
        pool.shutdown(wait=False, cancel_futures=True)


def _post(url: str, body: dict, deadline: float) -> dict:
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    timeout = deadline - time.monotonic()
    if timeout <= 0:
        raise PeerError("it did not finish within --llamacpp-timeout")
    try:
        with _OPENER.open(request, timeout=timeout) as answer:
            body = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        raise PeerError(f"/completion answered HTTP {exc.code}: "
                        f"{exc.read()[:_TAIL_CHARS].decode(errors='replace')}") from None
    except TimeoutError:
        raise PeerError("it did not finish within --llamacpp-timeout") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PeerError(f"/completion failed: {exc}") from None
    if not isinstance(body, dict) or not {"tokens_predicted", "stop_type"} <= body.keys():
        raise PeerError(f"/completion answered without tokens_predicted and stop_type: "
                        f"{json.dumps(body)[:_TAIL_CHARS]}")
    return body


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- llama-batched-bench ----------------------------------------------------------------

def batched_bench_command(bin_dir: Path, model: Path, *, threads: int, slots: int,
                          num_requests: int, prompt_len: int, output_len: int) -> list[str]:
    """The workload as batches of `slots` sequences, one -npl entry each (the last one
    the remainder): each batch prefills its prompts, then decodes together."""
    batches = [slots] * (num_requests // slots) + ([num_requests % slots]
                                                   if num_requests % slots else [])
    return [str(bin_dir / BATCHED_BENCH), "-m", str(model),
            "-c", str(slots * -(-(prompt_len + output_len) // _CONTEXT_ROUND) * _CONTEXT_ROUND),
            "-npp", str(prompt_len), "-ntg", str(output_len),
            "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
            "--output-format", "jsonl"]


def _batched_bench(result: EngineResult, bin_dir: Path, model: Path, requests, warmup, *,
                   threads: int, slots: int, prefix_caching: bool, log_path: Path,
                   deadline: float) -> None:
    prompt_len, output_len = requests[0].num_prompt_tokens, requests[0].max_tokens
    command = batched_bench_command(bin_dir, model, threads=threads, slots=slots,
                                    num_requests=len(requests), prompt_len=prompt_len,
                                    output_len=output_len)
    peer = _Peer(command, bin_dir, log_path)
    try:
        status = peer.wait(deadline)
    finally:
        peer.stop()
    if status != 0:
        raise PeerError(f"{BATCHED_BENCH} exited with status {status}")
    rows = _jsonl_rows(log_path)
    if sum(row["pl"] for row in rows) != len(requests):
        raise PeerError(f"{BATCHED_BENCH} reported {len(rows)} batches of "
                        f"{sum(row['pl'] for row in rows)} sequences for {len(requests)} requests")
    result.elapsed_s = sum(row["t"] for row in rows)  # its own clock: prefill + decode
    result.counts = [(prompt_len, output_len)] * len(requests)
    result.budgets_met = all(row["tg"] == output_len and row["pp"] == prompt_len for row in rows)
    result.peak_rss_bytes = peer.peak_rss_bytes
    result.extra = {"command": command, "batches": [row["pl"] for row in rows],
                    "prompts": "llama-batched-bench's own prompt ids (same lengths)"}


def _jsonl_rows(log_path: Path) -> list[dict]:
    rows = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"pl"' in line:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    if not rows:
        raise PeerError(f"{BATCHED_BENCH} printed no result line")
    return rows


# --- what the report says of the peer ----------------------------------------------------

def _version(binary: Path) -> str | None:
    """`TOOL --version`'s "version: N (commit)" line, or None."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                              timeout=30, env=env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("version:"):
            return line.removeprefix("version:").strip()
    return None


def _tail(log_path: Path) -> str:
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()
                 if ln.strip()]
    except OSError:
        return ""
    if not lines:
        return f" ({log_path} is empty)"
    tail = " | ".join(lines[-_TAIL_LINES:])
    return f"; last lines of {log_path}: {tail[-_TAIL_CHARS:]}"
