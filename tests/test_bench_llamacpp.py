"""`fusegen bench --llamacpp`: llama.cpp's tools as a peer, here fake `llama-server` and
`llama-batched-bench` scripts that speak their protocol (the real ones are measured by
hand: ../shared/peers/llamacpp-setup.sh). The fakes record their command lines and the
requests they were sent, and answer exactly n_predict tokens."""
from __future__ import annotations

import json
import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from fusegen.jobs.bench import llamacpp_runner
from fusegen.jobs.bench.harness import BenchConfig, workload_for
from fusegen.jobs.bench.llamacpp_runner import (SETUP_SCRIPT, choose_tool, completion_body,
                                                run_llamacpp)
from fusegen.jobs.bench.presets import PRESETS, LengthDist
from fusegen.jobs.bench.workload import BenchRequest
from fusegen.jobs.bench_cmd import bench

# Both fakes: answer --version, else record their command line
_FAKE_START = '''
import json, os, sys

if sys.argv[1:] == ["--version"]:
    print("version: 9999 (fake)", file=sys.stderr)
    sys.exit(0)
record = os.environ.get("FAKE_LLAMA_RECORD")
if record:
    with open(record, "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:]}) + "\\n")
'''

_FAKE_SERVER = _FAKE_START + '''
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if os.environ.get("FAKE_LLAMA_FAIL"):
    print("llama_model_load: error loading model: tensor 'blk.0' is corrupted", file=sys.stderr)
    print("main: exiting due to model loading error", file=sys.stderr)
    sys.exit(1)
ballast = bytearray(64 * 2**20)  # touched: 64 MiB of its own resident memory
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
port = int(sys.argv[sys.argv.index("--port") + 1])


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer(200, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"body": body}) + "\\n")
        if os.environ.get("FAKE_LLAMA_HTTP_ERROR"):
            return self._answer(500, {"error": {"message": os.environ["FAKE_LLAMA_HTTP_ERROR"]}})
        short = int(os.environ.get("FAKE_LLAMA_SHORT", "0"))
        n = body["n_predict"] - short
        self._answer(200, {"tokens_predicted": n, "tokens_evaluated": len(body["prompt"]),
                           "stop_type": "eos" if short else "limit",
                           "timings": {"cache_n": 0}})


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''

_FAKE_BATCHED = _FAKE_START + '''
arg = lambda name: sys.argv[sys.argv.index(name) + 1]
print("llama_context: n_ctx = " + arg("-c"), file=sys.stderr)
for pl in arg("-npl").split(","):
    print(json.dumps({"pp": int(arg("-npp")), "tg": int(arg("-ntg")), "pl": int(pl),
                      "t": 0.25 * int(pl), "speed": 1.0}))
'''


def _script(folder: Path, name: str, text: str) -> None:
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{text}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture(scope="module")
def server_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llamacpp-bin")
    _script(folder, "llama-server", _FAKE_SERVER)
    _script(folder, "llama-batched-bench", _FAKE_BATCHED)
    return folder


@pytest.fixture(scope="module")
def batched_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llamacpp-batched")
    _script(folder, "llama-batched-bench", _FAKE_BATCHED)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(llama_dir, tmp_path_factory) -> Path:
    from gguf_checkpoints import write_gguf

    return write_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _requests(count: int = 5) -> tuple[list[BenchRequest], list[BenchRequest]]:
    requests = [BenchRequest(list(range(3 + i, 10 + 2 * i)), 4 + i) for i in range(count)]
    return requests, [BenchRequest([1, 2, 3], 2)]


def _run(folder, tmp_path, monkeypatch, requests=None, warmup=None, slots=8, **env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if requests is None:
        requests, warmup = _requests()
    return run_llamacpp(folder, tmp_path / "model.gguf", requests, warmup, threads=3,
                        slots=slots, prefix_caching=True, log_path=tmp_path / "llamacpp.log",
                        timeout_s=60)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --- llama-server --------------------------------------------------------------------------

def test_server_gets_the_workload_as_token_ids_greedy_and_to_the_budget(
        server_dir, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    requests, warmup = _requests()
    result = _run(server_dir, tmp_path, monkeypatch, requests, warmup,
                  FAKE_LLAMA_RECORD=str(record))
    assert result.skipped is None
    assert result.name == "llamacpp" and result.label == "llama.cpp llama-server"
    assert result.counts == [(r.num_prompt_tokens, r.max_tokens) for r in requests]
    assert result.budgets_met is True and result.elapsed_s > 0
    # one slot per request at most (5 < 8), each slot's context the longest request rounded
    # up to 256, fusegen's threads for prompts and decode
    argv = _records(record)[0]["argv"]
    assert argv[:2] == ["-m", str(tmp_path / "model.gguf")]
    for flag, value in (("-np", "5"), ("-c", str(5 * 256)), ("-t", "3"), ("-tb", "3")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--no-kv-unified" in argv and "--cont-batching" in argv
    # the warm-up first, then every timed request (posted at once: any order)
    bodies = [r["body"] for r in _records(record)[1:]]
    assert bodies[0] == completion_body(warmup[0], True)
    assert sorted(map(json.dumps, bodies[1:])) == sorted(
        json.dumps({"prompt": r.prompt_ids, "n_predict": r.max_tokens, "ignore_eos": True,
                    "temperature": 0.0, "top_k": 1, "cache_prompt": True}) for r in requests)
    assert result.extra["tool"] == "llama-server" and result.extra["slots"] == 5
    assert result.extra["stop_types"] == {"limit": 5}
    assert result.extra["version"] == "9999 (fake)"
    # the fake's own 64 MiB, not this process's memory
    assert 64 * 2**20 <= result.peak_rss_bytes < 64 * 2**20 + 100e6


def test_outputs_short_of_their_budgets_are_flagged(server_dir, tmp_path, monkeypatch):
    requests, warmup = _requests()
    result = _run(server_dir, tmp_path, monkeypatch, FAKE_LLAMA_SHORT="1")
    assert result.skipped is None and result.budgets_met is False
    assert result.counts == [(r.num_prompt_tokens, r.max_tokens - 1) for r in requests]
    assert result.extra["stop_types"] == {"eos": 5}


def test_a_server_that_fails_to_load_is_a_skipped_row_with_its_last_lines(
        server_dir, tmp_path, monkeypatch):
    result = _run(server_dir, tmp_path, monkeypatch, FAKE_LLAMA_FAIL="1")
    assert result.skipped.startswith("skipped: llama.cpp could not run: llama-server exited "
                                     "with status 1 before it was ready")
    assert f"last lines of {tmp_path / 'llamacpp.log'}" in result.skipped
    assert "error loading model: tensor 'blk.0' is corrupted" in result.skipped
    assert "exiting due to model loading error" in result.skipped


def test_an_http_error_is_a_skipped_row_naming_it(server_dir, tmp_path, monkeypatch):
    result = _run(server_dir, tmp_path, monkeypatch, FAKE_LLAMA_HTTP_ERROR="context full")
    assert "/completion answered HTTP 500" in result.skipped
    assert "context full" in result.skipped


# --- llama-batched-bench, without a server -----------------------------------------------

def test_batched_bench_runs_a_fixed_length_workload_in_batches_of_the_slots(
        batched_dir, tmp_path, monkeypatch):
    record = tmp_path / "record.jsonl"
    requests = [BenchRequest([5] * 12, 7) for _ in range(10)]
    result = _run(batched_dir, tmp_path, monkeypatch, requests, requests[:1], slots=4,
                  FAKE_LLAMA_RECORD=str(record))
    assert result.skipped is None and result.label == "llama.cpp llama-batched-bench"
    argv = _records(record)[0]["argv"]
    for flag, value in (("-npp", "12"), ("-ntg", "7"), ("-npl", "4,4,2"), ("-c", "1024"),
                        ("-t", "3"), ("-tb", "3"), ("--output-format", "jsonl")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert result.elapsed_s == pytest.approx(0.25 * 10)  # its own clock, summed
    assert result.counts == [(12, 7)] * 10 and result.budgets_met is True
    assert result.extra["batches"] == [4, 4, 2]


def test_without_a_server_a_varied_workload_names_the_setup_script(batched_dir, tmp_path):
    with pytest.raises(ValueError) as err:
        choose_tool(batched_dir, fixed_length=False)
    message = str(err.value)
    assert f"--llamacpp {batched_dir}: no llama-server there" in message
    assert "fixed-length workloads only" in message and SETUP_SCRIPT in message
    with pytest.raises(ValueError, match=f"{tmp_path}: no llama-server there; build"):
        choose_tool(tmp_path, fixed_length=True)


# --- the bench command -------------------------------------------------------------------

def test_a_model_that_is_not_gguf_is_a_usage_error(server_dir, tmp_path):
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--skip-hf", "--cache-dir",
                                        str(tmp_path), "--llamacpp", str(server_dir)])
    assert result.exit_code == 2
    assert "--llamacpp runs llama.cpp on the model's GGUF file, but preset tiny runs a " \
           "random safetensors checkpoint; pass --model FILE.gguf" in result.output


def test_a_missing_folder_is_a_usage_error_naming_it(tiny_gguf, tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("FUSEGEN_LLAMACPP", str(missing))
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--model", str(tiny_gguf),
                                        "--llamacpp", "--skip-hf", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert f"--llamacpp {missing}: no llama-server there" in result.output
    assert SETUP_SCRIPT in result.output


def test_bench_reports_llamacpp_beside_fusegen(tiny_gguf, server_dir, tmp_path, monkeypatch):
    # bare --llamacpp: the folder $FUSEGEN_LLAMACPP names
    monkeypatch.setenv("FUSEGEN_LLAMACPP", str(server_dir))
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--model", str(tiny_gguf),
                                        "--requests", "6", "--llamacpp", "--skip-hf",
                                        "--cache-dir", str(tmp_path), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    fusegen, peer = report["results"]["fusegen"], report["results"]["llamacpp"]
    config = BenchConfig(replace(PRESETS["tiny"], num_requests=6), cache_dir=tmp_path,
                         model=_tiny_model(tiny_gguf))
    requests, _ = workload_for(config)
    assert peer["num_output_tokens"] == fusegen["num_output_tokens"] == \
        sum(r.max_tokens for r in requests)
    assert peer["budgets_met"] is True and peer["bin_dir"] == str(server_dir)
    assert peer["slots"] == 6  # fusegen's max_num_seqs, at most the requests
    ratio = report["ratios"]["llamacpp"]
    assert ratio["output_tokens_per_s"] == pytest.approx(
        fusegen["output_tokens_per_s"] / peer["output_tokens_per_s"])
    assert ratio["peak_rss_bytes"] == pytest.approx(
        fusegen["peak_rss_bytes"] / peer["peak_rss_bytes"])
    assert fusegen["peak_rss_bytes"] > 0
    assert "llama.cpp 9999 (fake): llama-server, 6 slots, continuous batching, the same " \
           "prompt ids" in result.stdout
    assert "peak RSS" in result.stdout


def _tiny_model(path: Path):
    from fusegen.jobs.bench.model import resolve_bench_model

    return resolve_bench_model(str(path))


def test_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEGEN_LLAMACPP", str(tmp_path))
    assert llamacpp_runner.default_bin_dir() == tmp_path
    monkeypatch.delenv("FUSEGEN_LLAMACPP")
    assert llamacpp_runner.default_bin_dir() == \
        Path.home() / ".cache/fusegen-peers/llamacpp/build/bin"


def test_lengths_of_the_preset_decide_batched_bench(tiny_gguf, batched_dir, tmp_path):
    fixed = replace(PRESETS["tiny"], prompt_len=LengthDist("uniform", 8, 8),
                    output_len=LengthDist("uniform", 4, 4))
    BenchConfig(fixed, model=_tiny_model(tiny_gguf), cache_dir=tmp_path, llamacpp=batched_dir)
    with pytest.raises(ValueError, match="fixed-length workloads only"):
        BenchConfig(PRESETS["tiny"], model=_tiny_model(tiny_gguf), cache_dir=tmp_path,
                    llamacpp=batched_dir)
