"""`fusegen perplexity`: the window plan by hand, a model whose perplexity is known
exactly (all-zero logits: the vocabulary size), and transformers' sliding-window recipe
on a tiny random checkpoint in fp32."""
from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from fusegen.engine import LLM
from fusegen.jobs.bench.perplexity import (Window, measure, perplexity, plan_windows,
                                           read_text, stdlib_docstrings)


# --- the window plan ---------------------------------------------------------------------

def test_windows_score_every_token_but_the_first_once():
    assert plan_windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6),
                                      Window(6, 10, 8)]
    # windows that do not overlap: each one's first token has no context, and goes unscored
    assert plan_windows(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    assert plan_windows(3, 8, 4) == [Window(0, 3, 1)]
    for tokens, window, stride in ((10, 4, 2), (97, 16, 5), (64, 64, 1), (65, 8, 7)):
        windows = plan_windows(tokens, window, stride)
        scored = [j for w in windows for j in range(w.first_scored, w.end)]
        assert scored == list(range(1, tokens))
        assert all(w.end - w.begin <= window for w in windows)
        # past the first window, a scored token has window - stride tokens before it at least
        assert all(w.first_scored - w.begin >= window - stride for w in windows[1:])


@pytest.mark.parametrize("args, message", [
    ((1, 4, 2), "the text has 1 token(s); perplexity needs at least 2"),
    ((10, 1, 1), "--window must be at least 2 tokens; got 1"),
    ((10, 4, 5), "--stride must be in [1, --window 4]; got 5"),
    ((10, 4, 0), "--stride must be in [1, --window 4]; got 0"),
])
def test_bad_plans_name_the_option(args, message):
    with pytest.raises(ValueError) as err:
        plan_windows(*args)
    assert str(err.value) == message


# --- texts -------------------------------------------------------------------------------

def test_a_folder_is_its_text_files_in_path_order(tmp_path):
    (tmp_path / "b.md").write_text("second")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.bin").write_bytes(b"\xff")
    text, files = read_text(str(tmp_path))
    assert text == "first\n\nsecond\n\nthird"
    assert files == [str(tmp_path / "a.txt"), str(tmp_path / "b.md"),
                     str(tmp_path / "sub" / "c.txt")]
    with pytest.raises(ValueError, match=r"TEXT .*nowhere: no such file or folder"):
        read_text(str(tmp_path / "nowhere"))
    (tmp_path / "sub" / "bad.txt").write_bytes(b"ok \xff")
    with pytest.raises(ValueError, match=r"bad.txt: not UTF-8 text \(invalid start byte at byte 3\)"):
        read_text(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no .txt or .md files"):
        read_text(str(empty))


def test_stdlib_docstrings_are_fixed_and_in_source_order():
    import textwrap

    text = stdlib_docstrings(("textwrap",))
    assert text == stdlib_docstrings(("textwrap",))
    assert text.startswith(textwrap.__doc__.strip() + "\n\n")
    parts = text.split("\n\n")
    wrapper = next(i for i, p in enumerate(parts) if p.startswith("Object for wrapping"))
    assert parts.index(textwrap.dedent.__doc__.strip().split("\n\n")[0]) > wrapper
    assert read_text("stdlib-docs")[0] == stdlib_docstrings()
    with pytest.raises(ValueError, match="module sys has no Python source"):
        stdlib_docstrings(("sys",))


# --- against values known by other means -------------------------------------------------

@pytest.fixture(scope="module")
def zero_head_dir(llama_dir, tmp_path_factory) -> Path:
    """The tiny llama with an all-zero lm_head: every position's logits are equal, so
    each token's probability is 1 / vocab_size and the perplexity is vocab_size."""
    path = tmp_path_factory.mktemp("zero-head")
    for f in llama_dir.iterdir():
        shutil.copy(f, path / f.name)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_all_zero_logits_give_the_vocabulary_size(zero_head_dir):
    vocab = json.loads((zero_head_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    ids = [rng.randrange(vocab) for _ in range(150)]
    with LLM(str(zero_head_dir), dtype="float32", device="cpu") as llm:
        result = measure(llm, ids, window=48, stride=20)
    assert (result.num_tokens, result.num_scored, result.num_windows) == (150, 149, 7)
    assert result.mean_nll == pytest.approx(math.log(vocab), rel=1e-6)
    assert result.perplexity == pytest.approx(vocab, rel=1e-5)


def _hf_perplexity(model_dir: Path, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """transformers' sliding-window recipe (its perplexity guide), in fp32, with the
    tokens a window scores counted after the model's internal shift."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encodings = torch.tensor([ids])
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        trg_len = end - prev_end
        input_ids = encodings[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=target_ids).loss
        scored = int((target_ids[:, 1:] != -100).sum())
        nll_sum += float(loss) * scored
        n_tokens += scored
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tokens), n_tokens


def test_perplexity_equals_transformers_in_fp32(llama_dir, tmp_path):
    with LLM(str(llama_dir), dtype="float32", device="cpu") as llm:
        ids = llm.tokenizer.encode(stdlib_docstrings(("textwrap",)),
                                   add_special_tokens=False)[:300]
        result = measure(llm, ids, window=64, stride=24)
    expected, scored = _hf_perplexity(llama_dir, ids, 64, 24)
    assert len(ids) == 300 and result.num_scored == scored == 299
    assert result.perplexity == pytest.approx(expected, rel=1e-4)


def test_command_prints_and_writes_the_figures(llama_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(stdlib_docstrings(("bisect",)))
    out = tmp_path / "ppl.json"
    result = CliRunner().invoke(perplexity, [str(text), "--model", str(llama_dir), "--window",
                                             "64", "--stride", "32", "--max-tokens", "200",
                                             "--dtype", "float32", "--device", "cpu",
                                             "--output", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert (figures["num_tokens"], figures["num_scored"], figures["num_windows"]) == (200, 199, 6)
    assert figures["perplexity"] == pytest.approx(math.exp(figures["total_nll"] / 199))
    assert figures["about"]["text"] == [str(text)] and figures["about"]["config_dtype"] == "float32"
    assert f"perplexity {figures['perplexity']:.4f}" in result.output
    assert "tokens 200, windows 6 of 64 (stride 32), scored 199" in result.output


@pytest.mark.parametrize("args, message", [
    (["nowhere.txt"], "TEXT nowhere.txt: no such file or folder"),
    (["stdlib-docs", "--window", "8", "--stride", "9"], "--stride must be in [1, --window 8]"),
    (["stdlib-docs", "--window", "300"], "--window 300 must be below the engine's context "
                                         "limit 256"),
])
def test_bad_input_is_a_usage_error_naming_it(llama_dir, args, message):
    result = CliRunner().invoke(perplexity, [*args, "--model", str(llama_dir), "--dtype",
                                             "float32", "--device", "cpu"])
    assert result.exit_code == 2 and message in result.output, result.output
