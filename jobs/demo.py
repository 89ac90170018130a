"""`fusegen demo`: a random model and a prompt dataset built locally (nothing downloaded),
then a real job over them. The README's first command."""
from __future__ import annotations

from pathlib import Path

import click

from fusegen.jobs.errors import JobError

_TOPICS = ["the sea", "a lighthouse", "autumn", "a train station", "bread", "the moon",
           "a library", "rain on a roof"]


def write_demo_prompts(path: Path, num_rows: int) -> None:
    """id, prompt and a per-row max_tokens override on every fifth row; row 3 has a null
    prompt, to show an error row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [f"Write one sentence about {_TOPICS[i % len(_TOPICS)]}." for i in range(num_rows)]
    if num_rows > 3:
        prompts[3] = None
    table = pa.table({"id": list(range(num_rows)), "prompt": prompts,
                      "max_tokens": [4 if i % 5 == 4 else None for i in range(num_rows)]})
    pq.write_table(table, path, row_group_size=16)


@click.command()
@click.option("--dir", "directory", default="./fusegen-demo", show_default=True,
              help="Where the model, the dataset and the output go.")
@click.option("--rows", default=64, show_default=True, help="Prompts in the sample dataset.")
@click.option("--max-tokens", default=24, show_default=True, help="Tokens generated per row.")
def demo(directory, rows, max_tokens):
    """Build a small random checkpoint (real tokenizer) and a sample prompt dataset in
    DIR, run a generation job over them, and show where the output is."""
    from fusegen.engine.models.synthetic import build_checkpoint
    from fusegen.jobs.run_cmd import setup_logging
    from fusegen.jobs.runner import run_job
    from fusegen.jobs.spec import JobSpec

    root = Path(directory).resolve()
    model, data, output = root / "model", root / "prompts.parquet", root / "output"
    root.mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").is_file():
        click.echo(f"building a random checkpoint in {model} ...")
        build_checkpoint(model, seed=0)
    write_demo_prompts(data, rows)
    spec = JobSpec(model=str(model), input=str(data), output=str(output), id_column="id",
                   max_tokens=max_tokens, partition_rows=16, overwrite=True)
    setup_logging()
    try:
        result = run_job(spec)
    except JobError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(result.summary())
    _show_rows(output)
    click.echo(f"\nThe weights are random, so the text is noise; everything else is real.\n"
               f"Run the same job yourself:\n  fusegen run --model {model} --input {data} "
               f"--output {root / 'output2'} --max-tokens {max_tokens}")


def _show_rows(output: Path, num_rows: int = 5) -> None:
    import pyarrow.parquet as pq

    first = pq.read_table(sorted(output.glob("part-*.parquet"))[0])
    click.echo(f"\nfirst rows of {output}/part-00000.parquet:")
    for row in first.slice(0, num_rows).to_pylist():
        shown = row["generated_text"] if row["error"] is None else row["error"]
        click.echo(f"  [{row['id']}] {row['prompt']!r} -> {row['finish_reason']}: {shown!r}"[:160])
