"""Live progress: output tokens counted as the engines generate them (running requests'
included), an ETA from tokens and never before a row is generated, the report's timeline
from those live samples, and engine counters per job on a worker that ran earlier jobs."""
import io
import json
import time

import pytest

from fusegen.engine.llm_engine import stats_since
from fusegen.jobs import engines
from fusegen.jobs.driver import run_job
from fusegen.jobs.progress import Progress
from fusegen.jobs.spec import JobSpec
from jobs_fixtures import FakeLLM, fake_engine, tiny_model_dir, write_prompts  # noqa: F401


class CountingFakeLLM(FakeLLM):
    """The fake engine with the real one's load report: its queues and the tokens it has
    generated since it started, running requests' included."""

    def engine_load(self) -> dict:
        return {"running": len(self._running), "waiting": len(self._waiting),
                "kv_used": 0.0, "num_generated_tokens": self._generated}


def _load(step_seconds):
    return lambda model, kw: CountingFakeLLM(model, step_seconds=step_seconds, **kw)


def test_tokens_count_before_any_row_finishes_and_no_eta_before_a_row_is_generated():
    p = Progress(100, mode="log", stream=io.StringIO())
    p.start = 0.0
    # 10 s in: one worker's engine generated 500 tokens, 20 rows running, none finished
    p.partial(0, 0, 0, worker="w1", engine={"running": 20, "waiting": 30, "kv_used": 0.5,
                                              "num_generated_tokens": 500})
    assert p.line(10.0) == ("[" + " " * 30 + "] 0/100 rows (0%) | 0 errors | 50.0 tok/s | "
                            "20 running, 30 waiting | KV 50% | ETA --:--")
    # rows that failed before the engine finish at once: still nothing known of the rest
    p.partial(1, 3, 0, errors=3, worker="w2", engine={"running": 0, "waiting": 0,
                                                        "kv_used": 0.0,
                                                        "num_generated_tokens": 0})
    assert p.line(10.0).endswith("| 3 errors | 50.0 tok/s | 20 running, 30 waiting | "
                                 "KV 50% | ETA --:--")


def test_eta_from_tokens_counts_the_running_rows_tokens():
    p = Progress(100, mode="log", stream=io.StringIO())
    p.start = 0.0
    # 20 s in: 10 rows finished with 1000 tokens; 10 more running hold 1000 tokens so far
    p.partial(0, 10, 1000, worker="w1", engine={"running": 10, "waiting": 80,
                                                 "kv_used": 0.1,
                                                 "num_generated_tokens": 2000})
    # 100 tok/s; a row takes at least 2000 / 20 = 100 tokens (the finished rows' mean is
    # 100 too): 90 rows left x 100, less the 1000 the running rows have, is 8000 tokens
    assert p.line(20.0).endswith("| 100.0 tok/s | 10 running, 80 waiting | KV 10% | "
                                 "ETA 0:01:20")
    # short rows finish first: the running rows' tokens so far raise the mean
    p.partial(0, 10, 500, worker="w1", engine={"running": 10, "waiting": 80,
                                                "kv_used": 0.1, "num_generated_tokens": 2000})
    # per row max(50, 100) = 100: 9000 - 1500 = 7500 tokens at 100 tok/s
    assert p.line(20.0).endswith("ETA 0:01:15")


def test_rates_count_from_when_the_engines_were_ready_and_long_running_rows_keep_an_eta():
    p = Progress(8, mode="log", stream=io.StringIO())
    p.start, p.begun = 0.0, 100.0  # 100 s loading the model
    # 10 s of generation: the shortest row finished with 8 tokens, 7 running hold 57
    p.partial(0, 1, 8, worker="w1", engine={"running": 7, "waiting": 0, "kv_used": 0.1,
                                             "num_generated_tokens": 65})
    # 6.5 tok/s; the 7 rows left at 8.125 tokens a row (65 / 8) are fewer tokens than
    # the running rows have already: they need at least their 57 again, 8.8 s
    assert p.line(110.0) == ("[###" + " " * 27 + "] 1/8 rows (12%) | 0 errors | 6.5 tok/s | "
                             "7 running, 0 waiting | KV 10% | ETA 0:00:08")


def test_eta_from_rows_where_rows_generate_no_tokens():
    p = Progress(30, mode="log", stream=io.StringIO())
    p.start = 0.0
    p.advance(0, 10, 0)  # e.g. max_tokens 0: prompt logprobs only
    assert p.line(5.0).endswith("| 0.0 tok/s | ETA 0:00:10")


def test_a_one_partition_job_reports_live_tokens_and_its_timeline_rises_before_the_end(
        fake_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(engines, "_load", _load(0.05))
    lines, show = [], Progress._show

    def show_every_line(self):  # as a bar would, not a log line each 10 s
        show(self)
        lines.append(self.line(time.monotonic()))

    monkeypatch.setattr(Progress, "_show", show_every_line)
    write_prompts(tmp_path / "in.parquet", 8)
    # one partition, 8 rows running together for 60 steps of 50 ms: no row finishes
    # until the end
    result = run_job(JobSpec(model=fake_engine, input=str(tmp_path / "in.parquet"),
                             output=str(tmp_path / "out"), max_tokens=60, partition_rows=8,
                             max_num_seqs=8, progress="log"))
    assert result.num_generated_tokens == 480
    # points a second apart while the rows run: the tokens rise before any row finished
    assert [tokens for _, rows, tokens in result.timeline if rows == 0 and tokens > 0
            and tokens < 480], result.timeline
    assert result.timeline[-1][1:] == (8, 480)
    live = [line for line in lines if line.startswith("[" + " " * 30 + "] 0/8 rows")]
    assert live and all(" 0.0 tok/s" not in line for line in live), lines
    assert all("8 running, 0 waiting" in line and line.endswith("ETA --:--")
               for line in live), live
    # the part's last report, as its rows finished: nothing left running
    assert lines[-1].startswith("[" + "#" * 30 + "] 8/8 rows (100%) | 0 errors | ")
    assert lines[-1].endswith("| 0 running, 0 waiting | KV 0% | ETA 0:00:00"), lines


def _manifest(out) -> dict:
    return json.loads((out / "_manifest.json").read_text())


def test_two_jobs_on_one_client_each_count_their_own_engine_tokens(tmp_path):
    from fusegen.jobs.cluster import open_client

    write_prompts(tmp_path / "in.parquet", 6)
    spec = dict(model=tiny_model_dir(), input=str(tmp_path / "in.parquet"), progress="none",
                max_tokens=5, ignore_eos=True, enable_prefix_caching=True)
    first = JobSpec(output=str(tmp_path / "a"), **spec)
    with open_client(first) as client:
        a = run_job(first, client=client)
        # the same prompts again: every full prompt block now comes from the prefix cache
        b = run_job(JobSpec(output=str(tmp_path / "b"), seed=1, **spec), client=client)
    for result, out in ((a, tmp_path / "a"), (b, tmp_path / "b")):
        (engine,) = _manifest(out)["runs"][-1]["engine_stats"]
        assert engine["num_generated_tokens"] == result.num_generated_tokens == 30
        assert engine["prompt_tokens_cached"] + engine["prompt_tokens_computed"] >= \
            result.num_prompt_tokens
        assert result.prompt_tokens_cached == engine["prompt_tokens_cached"]
        assert result.prompt_tokens_cached <= result.num_prompt_tokens
    assert a.num_prompt_tokens == b.num_prompt_tokens


def test_stats_since_counts_the_steps_between_two_snapshots():
    before = {"num_steps": 4, "mean_running": 2.0, "max_num_seqs": 256,
              "num_decode_steps": 2, "mean_decode_batch": 3.0, "num_generated_tokens": 10}
    after = {"num_steps": 10, "mean_running": 5.0, "max_num_seqs": 256,
             "num_decode_steps": 6, "mean_decode_batch": 5.0, "num_generated_tokens": 50}
    assert stats_since(before, after) == {
        "num_steps": 6, "mean_running": 7.0, "max_num_seqs": 256, "num_decode_steps": 4,
        "mean_decode_batch": 6.0, "num_generated_tokens": 40}


def test_a_job_start_is_kept_per_engine():
    class Engine:
        def __init__(self):
            self.generated = 0

        def stats(self):
            return {"num_generated_tokens": self.generated}

    old = Engine()
    old.generated = 7
    assert engines.job_start("job-a", old) == {"num_generated_tokens": 7}
    old.generated = 9
    assert engines.job_start("job-a", old) == {"num_generated_tokens": 7}
    assert engines.job_started("job-b", old) is None  # a job that never used it
    fresh = Engine()  # loaded anew mid-job (its device group failed): its own zero
    assert engines.job_started("job-a", fresh) is None
    assert engines.job_start("job-a", fresh) == {"num_generated_tokens": 0}
    for i in range(engines._MAX_JOBS):
        engines.job_start(f"later-{i}", fresh)
    assert "job-a" not in engines._job_starts and len(engines._job_starts) == engines._MAX_JOBS


@pytest.fixture(autouse=True)
def _forget_job_starts():
    yield
    engines._job_starts.clear()
