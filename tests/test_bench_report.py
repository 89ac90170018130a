"""`fusegen bench`'s HTML report: written beside the JSON, it carries the JSON's exact
figures, a bar per engine that ran, a point per recorded decode step, fusegen's memory
plan, and escapes every string a run brings (a model named `<script>...`)."""
from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from fusegen.jobs.bench.html_report import render_bench_html, step_points
from fusegen.jobs.bench_cmd import bench
from fusegen.jobs.svg import H, PAD, W

_FIGURES = ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
            "flops_per_s", "mfu", "peak_rss_bytes")
HOSTILE = "<script>alert('x')</script>"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")


@pytest.fixture(scope="module")
def tiny(cache_dir, tmp_path_factory):
    """The tiny preset on 6 requests, every baseline on; --json only: the report's
    default place is beside it."""
    out = tmp_path_factory.mktemp("bench-out") / "tiny.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "6",
                                        "--cache-dir", str(cache_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    page = out.with_suffix(".html").read_text()
    assert f"wrote {out.with_suffix('.html')}" in result.stdout
    return json.loads(out.read_text()), page


def _rows(page: str) -> dict[str, list[str]]:
    """Each table row's first cell, and the data-value of each of its other cells."""
    return {first: re.findall(r'data-value="([^"]*)"', rest)
            for first, rest in re.findall(r"<tr><td>([^<]*)</td>(.*?)</tr>", page)}


def test_results_table_carries_the_exact_json_figures(tiny):
    report, page = tiny
    rows = _rows(page)
    ran = {name: r for name, r in report["results"].items() if "skipped" not in r}
    assert set(ran) == {"fusegen", "hf_static", "hf_continuous"}
    for name, r in ran.items():
        ratio = report["ratios"].get(name, {}).get("output_tokens_per_s")
        assert rows[r["label"]] == [json.dumps(r[key]) for key in _FIGURES] + [json.dumps(ratio)]
    assert json.dumps(report["ratios"]["hf_static"]["output_tokens_per_s"]) != "null"


def test_one_bar_per_engine_that_ran(tiny):
    report, page = tiny
    bars = re.findall(r'<text x="\d+" y="\d+" text-anchor="end">([^<]*)</text>\n'
                      r'<rect class="throughput-bar" x="(\d+)" y="\d+" width="([\d.]+)"', page)
    ran = [r for r in report["results"].values() if "skipped" not in r]
    assert len(bars) == page.count('class="throughput-bar"') == len(ran) == 3
    fastest = max(r["output_tokens_per_s"] for r in ran)
    span = W - int(bars[0][1]) - 2 * PAD  # the longest bar's length: room left for its value
    assert bars == [(r["label"], bars[0][1], f"{span * r['output_tokens_per_s'] / fastest:.1f}")
                    for r in ran]


def test_step_time_line_has_a_point_per_recorded_decode_step(tiny):
    report, page = tiny
    fusegen = report["results"]["fusegen"]
    times = fusegen["decode_step_times_s"]
    assert len(times) == fusegen["num_decode_steps"] > 0
    assert sum(times) == pytest.approx(fusegen["decode_seconds"])
    (points,) = re.findall(r'<polyline class="step-time fusegen"[^>]* points="([^"]*)"', page)
    slowest = max(times) * 1e3
    expected = [f"{PAD + (W - 2 * PAD) * (i + 1) / len(times):.1f},"
                f"{H - PAD + (2 * PAD - H) * t * 1e3 / slowest:.1f}" for i, t in enumerate(times)]
    assert points.split() == expected
    assert f"fusegen: {len(times):,} decode steps" in page


def test_memory_plan_shows_the_bytes_per_tier(tiny):
    report, page = tiny
    memory = report["results"]["fusegen"]["memory"]
    device = memory["device"]
    # tier: budget, layers, KV blocks, then kv_cache, weights (sorted), then the sum
    assert _rows(page)["device"] == [json.dumps(v) for v in (
        device["budget"], memory["layers"]["device"], memory["kv_blocks"]["device"],
        device["kv_cache"], device["weights"], device["kv_cache"] + device["weights"])]
    assert memory["layers"]["device"] == 2 and device["weights"] > 0 and device["kv_cache"] > 0
    assert page.count('class="memory-bar"') == 3


def test_report_is_self_contained(tiny):
    _, page = tiny
    assert "<script" not in page and "<link" not in page and "src=" not in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_hostile_strings_are_escaped(tiny):
    report, _ = tiny
    report = json.loads(json.dumps(report))
    report["model"]["source"] = HOSTILE
    report["results"]["fusegen"]["label"] = "<b>fusegen</b>"
    report["results"]["hf_static"] = {"name": "hf_static", "label": "hf",
                                      "skipped": 'skipped: <img src="x">'}
    page = render_bench_html(report)
    assert "<script" not in page and "<img" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "&lt;b&gt;fusegen&lt;/b&gt;" in page and "&lt;img src=&quot;x&quot;&gt;" in page


def test_a_real_model_named_like_markup_is_escaped(tiny, cache_dir, tmp_path):
    # The tiny preset's own checkpoint, under a directory name a browser would run.
    report, _ = tiny
    model = tmp_path / HOSTILE.replace("/", "|")
    shutil.copytree(report["model"]["checkpoint"], model)
    html_path = tmp_path / "out.html"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--requests", "2", "--skip-hf",
                                        "--model", str(model), "--cache-dir", str(cache_dir),
                                        "--report", str(html_path)])
    assert result.exit_code == 0, result.output
    page = html_path.read_text()
    assert "<script" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;|script&gt;" in page
    assert page.count('class="throughput-bar"') == 1  # fusegen alone ran


def test_long_runs_are_drawn_as_means_of_consecutive_steps():
    times = [i / 1000 for i in range(2500)]  # 0, 1, 2, ... ms
    points = step_points(times)
    assert len(points) == 834  # runs of 3 steps, the last of 1
    assert points[0] == (3, pytest.approx(1.0)) and points[1] == (6, pytest.approx(4.0))
    assert points[-1] == (2500, pytest.approx(2499.0))
    assert step_points([0.002, 0.004]) == [(1, 2.0), (2, 4.0)]


def test_report_and_json_must_be_two_files(tmp_path):
    path = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--preset", "tiny", "--json", str(path),
                                        "--report", str(path)])
    assert result.exit_code == 2 and "--report and --json name the same file" in result.output
    assert not path.exists()


def test_a_device_groups_plan_says_whose_share_it_shows():
    from fusegen.jobs.bench.html_report import memory_plan

    share = {"device": {"weights": 3 * 2**20, "kv_cache": 2**20, "total": 4 * 2**20,
                        "budget": 8 * 2**20, "peak": 0},
             "host": {"kv_cache": 0, "budget": 0}, "disk": {"weights": 2**20},
             "layers": {"device": 2, "host": 0, "disk": 1}, "kv_blocks": {"device": 64, "host": 0}}
    page = memory_plan({**share, "ranks": [share, share],
                        "group": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1}})
    assert "a device group of 2 ranks (tensor parallel 2 x pipeline parallel 1)" in page
    rows = _rows(page)
    assert rows["device"] == ["8388608", "2", "64", "1048576", "3145728", "4194304"]
    assert rows["disk"] == ["null", "1", "null", "null", "1048576", "1048576"]
    assert ">4.0 MiB</td>" in page and ">1.0 MiB</td>" in page
