"""`fusegen bench --report`: the run's figures as one self-contained HTML page (jobs/svg.py
draws it): output tokens/s of every engine as bars, fusegen's decode step times over the
timed run as a line, its memory plan (bytes per tier), and the text table. Every figure
in a table cell carries its exact JSON value."""
from __future__ import annotations

from fusegen.jobs import svg
from fusegen.jobs.bench.report import format_report

_MAX_POINTS = 1000  # a longer run's step times are drawn as means of consecutive steps
_TIERS = ("device", "host", "disk")
# An engine's figures in its table row: the JSON key, the column, how it is shown.
_FIGURES = (("elapsed_s", "time s", "{:.2f}".format),
            ("requests_per_s", "req/s", "{:,.2f}".format),
            ("output_tokens_per_s", "out tok/s", "{:,.1f}".format),
            ("total_tokens_per_s", "total tok/s", "{:,.1f}".format),
            ("flops_per_s", "model GFLOP/s", lambda v: f"{v / 1e9:,.2f}"),
            ("mfu", "MFU", "{:.1%}".format),
            ("peak_rss_bytes", "peak RSS MB", lambda v: f"{v / 1e6:,.0f}"))


def render_bench_html(report: dict) -> str:
    """The page of a report as build_report makes it (or as its JSON file reads back)."""
    results = report["results"]
    ran = {name: r for name, r in results.items() if "skipped" not in r}
    body = [
        svg.key_values(_about(report)),
        "<h2>Throughput</h2>",
        svg.bar_chart([(r["label"], r["output_tokens_per_s"]) for r in ran.values()],
                      title="output tokens/s", css_class="throughput-bar"),
        _results_table(results, report.get("ratios", {})),
        "<h2>Decode step time</h2>",
        step_time_svg(results),
        *(sparse_section(report["sparse"]) if "sparse" in report else ()),
        "<h2>Memory plan</h2>",
        memory_plan(results.get("fusegen", {}).get("memory")),
        "<h2>The table</h2>",
        f"<pre>{svg.e(format_report(report))}</pre>",
    ]
    return svg.page(f"fusegen bench: preset {report['preset']}", "\n".join(body))


def _about(report: dict) -> list[tuple[str, object]]:
    model, cfg, work = report["model"], report["config"], report["workload"]
    machine = report["machine"]
    return [("date", report["date"]),
            ("model", f"{model.get('source', 'random')} ({model.get('format', '')}), "
                      f"{model['num_layers']} layers, hidden {model['hidden_size']}, "
                      f"vocab {model['vocab_size']}"),
            ("checkpoint", model.get("checkpoint")),
            ("run", f"{cfg['dtype']} on {cfg['device']} "
                    f"({machine.get('gpu') or machine.get('cpu')})"),
            ("requests", work["num_requests"]),
            ("prompt tokens", work["num_prompt_tokens"]),
            ("output tokens", work["num_output_tokens"])]


def _results_table(results: dict, ratios: dict) -> str:
    rows = []
    for name, r in results.items():
        label = f"<td>{svg.e(r['label'])}</td>"
        if "skipped" in r:
            rows.append([label, f'<td colspan="{len(_FIGURES) + 1}">{svg.e(r["skipped"])}</td>'])
            continue
        ratio = ratios.get(name, {}).get("output_tokens_per_s")
        rows.append([label, *(_cell(r.get(key), show) for key, _, show in _FIGURES),
                     _cell(ratio, "{:.2f}x".format)])
    return svg.grid(["engine", *(h for _, h, _ in _FIGURES), "fusegen x (out tok/s)"], rows)


def _cell(value, show) -> str:
    return svg.number(value, "-" if value is None else show(value))


def step_points(times_s: list[float]) -> list[tuple[float, float]]:
    """(decode step number, milliseconds) for each step, numbered from 1; past
    _MAX_POINTS steps, the mean of each run of consecutive steps at its last one."""
    size = max(1, -(-len(times_s) // _MAX_POINTS))
    runs = (times_s[i:i + size] for i in range(0, len(times_s), size))
    return [(min((k + 1) * size, len(times_s)), 1e3 * sum(run) / len(run))
            for k, run in enumerate(runs)]


def step_time_svg(results: dict) -> str:
    """One line per fusegen run that recorded its decode steps' times."""
    recorded = {name: r["decode_step_times_s"] for name, r in results.items()
                if r.get("decode_step_times_s")}
    if not recorded:
        return "<p>no decode step times recorded (fusegen ran no decode step)</p>"
    series = [svg.Series(f"step-time {name}", step_points(times), results[name]["label"])
              for name, times in recorded.items()]
    notes = "; ".join(
        f"{svg.e(results[name]['label'])}: {len(times):,} decode steps, mean "
        f"{1e3 * sum(times) / len(times):.2f} ms" for name, times in recorded.items())
    longest = max(len(times) for times in recorded.values())
    if longest > _MAX_POINTS:
        notes += (f" (each point the mean of {-(-longest // _MAX_POINTS)} consecutive steps)")
    return svg.line_chart(series, title="decode step time, ms", x_max_format="step {:,.0f}",
                          y_format="{:.2f}") + f"\n<p>{notes}</p>"


# A sparse run's figures in its row: the JSON key, the column, how it is shown.
_SPARSE_FIGURES = (("linear_bytes_per_layer", "linear bytes / layer", "{:,.0f}".format),
                   ("bytes_ratio", "x dense", "{:.3f}x".format),
                   ("decode_step_median_s", "decode step ms (median)",
                    lambda v: f"{v * 1e3:.2f}"),
                   ("decode_speedup", "decode speedup", "{:.2f}x".format),
                   ("output_tokens_per_s", "out tok/s", "{:,.1f}".format),
                   ("throughput_ratio", "x dense", "{:.2f}x".format))
_OFFLOAD_FIGURES = (("streamed_bytes_per_step", "streamed MB / step",
                     lambda v: f"{v / 1e6:,.1f}"),
                    ("stall_per_step_s", "stall ms / step", lambda v: f"{v * 1e3:.2f}"))


def sparse_section(sparse: dict) -> list[str]:
    """`fusegen bench --sparsity`: dense and each pruned run, their bytes per decoder
    layer, median decode step and output rate against dense (under the memory pool,
    the layers resident and the bytes streamed and the stall a step), as a table and
    as bars of the decode speedup; the sparsity from which sparse wins."""
    rows = sparse["rows"]
    offloaded = any("offload" in row for row in rows)
    table = []
    for row in rows:
        cells = [f"<td>{svg.e(row['label'])}</td>",
                 *(_cell(row.get(key), show) for key, _, show in _SPARSE_FIGURES)]
        if offloaded:
            offload = row.get("offload", {})
            layers = offload.get("layers", {})
            cells += [_cell(layers.get("device"), str),
                      *(_cell(offload.get(key), show) for key, _, show in _OFFLOAD_FIGURES)]
        table.append(cells)
    header = ["run", *(h for _, h, _ in _SPARSE_FIGURES)]
    if offloaded:
        header += ["layers resident", *(h for _, h, _ in _OFFLOAD_FIGURES)]
    wins = "; ".join(
        f"{svg.e(values)} values: " + (f"sparse decodes faster from {share * 100:g}% on"
                                       if share is not None else "no measured sparsity wins")
        for values, share in sparse["wins_from"].items())
    bars = svg.bar_chart([(row["label"], row["decode_speedup"]) for row in rows
                          if row["decode_speedup"] is not None],
                         title="decode speedup against dense (median decode step)",
                         css_class="sparse-bar", value_format="{:.2f}x")
    return ["<h2>Sparse weights</h2>",
            f"<p>{svg.e(sparse['method'])} pruning, per output row; {wins}</p>",
            svg.grid(header, table), bars]


def memory_plan(memory: dict | None) -> str:
    """fusegen's bytes per memory tier and use, as allocated, beside its budgets, and
    the layers and KV blocks each tier holds."""
    if not memory:
        return "<p>no memory plan recorded (fusegen did not run)</p>"
    uses = sorted({use for tier in _TIERS for use in memory.get(tier, {})
                   if use not in ("total", "budget", "peak")})
    rows = []
    for tier in _TIERS:
        held = memory.get(tier, {})
        used = sum(held.get(use, 0) for use in uses)
        rows.append([f"<td>{tier}</td>", _bytes(held.get("budget")),
                     _cell(memory["layers"][tier], str),
                     _cell(memory["kv_blocks"].get(tier), "{:,}".format),
                     *(_bytes(held.get(use)) for use in uses), _bytes(used)])
    table = svg.grid(["tier", "budget", "layers", "KV blocks",
                      *(use.replace("_", " ") for use in uses), "in all"], rows)
    bars = svg.bar_chart([(tier, sum(memory.get(tier, {}).get(use, 0) for use in uses) / 1e6)
                          for tier in _TIERS], title="bytes held per tier, MB",
                         css_class="memory-bar", value_format="{:,.1f} MB")
    group = memory.get("group")
    note = "" if group is None else (
        f"<p>a device group of {len(memory.get('ranks', []))} ranks (tensor parallel "
        f"{group['tensor_parallel_size']} x pipeline parallel "
        f"{group['pipeline_parallel_size']}): the first rank's share</p>\n")
    return f"{note}{table}\n{bars}"


def _bytes(value) -> str:
    return _cell(value, lambda v: f"{v / 2**20:,.1f} MiB")
