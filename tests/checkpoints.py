"""Tiny random checkpoints saved by transformers itself (the token-exact reference),
with a real tokenizer trained by fusegen's synthetic builder."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fusegen.engine.models.synthetic import build_tokenizer

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# Their norms start as constants (ones, or zeros under Gemma's 1 + w): drawn at random
# around that value instead, so that a norm fusegen drops or misapplies changes the tokens.
RANDOM_NORMS = {"qwen3": 1.0, "gemma2": 0.0, "gemma3": 0.0, "phi3": 1.0, "mixtral": 1.0,
                "qwen3_moe": 1.0}
# Gemma multiplies the embedding by sqrt(hidden_size): divided by it here, so that the
# layers, not the input token alone, decide the next token.
SCALED_EMBEDDING = {"gemma2", "gemma3"}


def make_hf_checkpoint(path: Path, arch: str = "llama", tokenizer: str = "bpe",
                       seed: int = 0, max_shard_size: str | None = None,
                       **overrides) -> Path:
    import transformers

    path = Path(path)
    build_tokenizer(path, kind=tokenizer, vocab_size=400)
    tok = json.loads((path / "tokenizer.json").read_text())
    vocab = max(max(tok["model"]["vocab"].values()),
                max((t["id"] for t in tok.get("added_tokens", [])), default=0)) + 1
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    fields = dict(
        vocab_size=-(-vocab // 64) * 64, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.3,
        bos_token_id=ids.get(_content(tok_config.get("bos_token"))),
        eos_token_id=ids.get(_content(tok_config.get("eos_token"))),
    )
    if arch == "mistral":
        fields["sliding_window"] = None
    if arch == "phi3":  # Phi3Config's default pad id (32000) is past the tiny vocabulary
        fields["pad_token_id"] = None
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    _reinit(model, arch)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


@torch.no_grad()
def _reinit(model, arch: str) -> None:
    if arch in RANDOM_NORMS:
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(RANDOM_NORMS[arch], 0.5)
    if arch in SCALED_EMBEDDING:
        model.model.embed_tokens.weight /= model.config.hidden_size ** 0.5


def _content(token):
    return token.get("content") if isinstance(token, dict) else token


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int,
              ignore_eos: bool = True) -> list[int]:
    """transformers' own greedy continuation of one prompt, fp32, no batching.
    `ignore_eos`: eos neither stops nor is forbidden, as with fusegen's `ignore_eos`
    (`min_new_tokens` would forbid it)."""
    model = load_hf(path)
    kwargs = {"eos_token_id": None} if ignore_eos else {}
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                         dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


_HF_MODELS: dict[str, object] = {}


def load_hf(path: Path):
    import transformers

    key = str(path)
    if key not in _HF_MODELS:
        # Capped attention scores (Gemma 2) only in transformers' eager attention: some
        # releases run SDPA by default and drop the cap there.
        config = json.loads((Path(path) / "config.json").read_text())
        eager = {"attn_implementation": "eager"} if config.get("attn_logit_softcapping") else {}
        _HF_MODELS[key] = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, **eager).eval()
    return _HF_MODELS[key]
