"""`fusegen demo`: builds a model and a dataset locally and runs a job over them."""
import pyarrow.parquet as pq
from click.testing import CliRunner

from fusegen.jobs.cli import main


def test_demo_builds_everything_and_runs_twice(tmp_path):
    args = ["demo", "--dir", str(tmp_path / "demo"), "--rows", "20", "--max-tokens", "4"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "building a random checkpoint" in first.output
    assert "rows: 20, errors: 1 (null_prompt 1)" in first.output
    assert "[3] None -> error: \"null_prompt: row 3 (id=3): column 'prompt' is null\"" in first.output
    parts = sorted((tmp_path / "demo" / "output").glob("part-*.parquet"))
    table = pq.read_table(parts[0])
    assert len(parts) == 2 and table.num_rows == 16
    assert table.column("num_generated_tokens").to_pylist()[4] <= 4
    second = CliRunner().invoke(main, args)  # reuses the model, overwrites the output
    assert second.exit_code == 0 and "building" not in second.output
