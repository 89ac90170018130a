"""`--report`: a small self-contained HTML summary of a job run, `_report.html` beside its
manifest: the counts, errors by code, throughput, and output tokens/s over time as an
inline SVG plot (no script, no stylesheet or font fetched, no plotting package)."""
from __future__ import annotations

from fusegen.jobs import svg
from fusegen.jobs.progress import JobResult
from fusegen.jobs.spec import JobSpec
from fusegen.jobs.storage import filesystem

# Its leading "_" keeps it out of the dataset: Parquet readers skip such files.
REPORT = "_report.html"
_MAX_POINTS = 400  # a long run's timeline is thinned to this many intervals


def write_report(spec: JobSpec, result: JobResult, manifest: dict) -> str:
    """Write the report into the output directory; returns its path there."""
    fs, root = filesystem(spec.output, spec.storage_options)
    path = f"{root.rstrip('/')}/{REPORT}"
    with fs.open(path, "w", encoding="utf-8") as f:
        f.write(render_report(result, manifest))
    return path


def render_report(result: JobResult, manifest: dict) -> str:
    config = manifest.get("config", {})  # the public spec: credentials already masked
    rows = [("model", config.get("model")), ("input", config.get("input")),
            ("output", result.output), ("fingerprint", manifest.get("fingerprint")),
            *_numbers(result)]
    errors = "".join(f"<li>{svg.e(code)}: {n}</li>" for code, n in
                     sorted(result.errors_by_code.items())) or "<li>none</li>"
    return svg.page("fusegen job report", f"""{svg.key_values(rows)}
<h2>Errors by code</h2><ul>{errors}</ul>
<h2>Throughput over time</h2>
{throughput_svg(result.timeline)}""")


def _numbers(r: JobResult) -> list[tuple[str, object]]:
    secs = max(r.wall_seconds, 1e-9)
    parts = f"{r.num_parts}" + (f" ({r.num_parts_skipped} kept from an earlier run)"
                                if r.num_parts_skipped else "")
    return [("parts", parts), ("rows", r.num_rows), ("errors", r.num_errors),
            ("rows cut at the length limit", r.num_truncated),
            ("rows with invalid structured output", r.num_structured_invalid),
            ("prompt tokens", r.num_prompt_tokens),
            ("prompt tokens from the prefix cache", r.prompt_tokens_cached),
            ("generated tokens", r.num_generated_tokens),
            ("wall time", f"{r.wall_seconds:.1f} s"),
            ("this run", f"{r.rows_computed / secs:.1f} rows/s, "
                         f"{r.tokens_computed / secs:.1f} output tokens/s")]


def throughput_rates(timeline: list) -> list[tuple[float, float]]:
    """(end of interval in seconds, output tokens/s over it) between timeline points
    ((seconds, rows, tokens), cumulative), thinned to at most _MAX_POINTS intervals."""
    step = max(1, -(-(len(timeline) - 1) // _MAX_POINTS))
    points = timeline[::step]
    if timeline and points[-1] is not timeline[-1]:
        points.append(timeline[-1])
    return [(t1, (k1 - k0) / (t1 - t0)) for (t0, _, k0), (t1, _, k1) in zip(points, points[1:])
            if t1 > t0]


def throughput_svg(timeline: list) -> str:
    """Output tokens/s against seconds since the start, as a step line with labelled axes."""
    rates = throughput_rates(timeline)
    if not rates:
        return "<p>no throughput recorded (nothing ran in this run)</p>"
    points, t_prev = [], 0.0
    for t, rate in rates:  # a step per interval: its mean rate held over it
        points += [(t_prev, rate), (t, rate)]
        t_prev = t
    return svg.line_chart([svg.Series("throughput", points)], title="output tokens/s",
                          x_max_format="{:.1f} s")
