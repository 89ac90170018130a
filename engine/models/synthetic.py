"""Small random checkpoints in Hugging Face format, built without transformers.

Tests, `fusegen demo` and the benchmark need real-looking model directories on machines
with no network and no transformers, so everything here is built from `tokenizers`,
`torch` and `safetensors` alone. Output is deterministic for the same arguments.

Two tokenizer styles, the two the detokenizer must get right:
- "bpe": byte-level BPE like GPT-2 / Llama-3. Special tokens `<|begin_of_text|>` (bos,
  added by the post-processor) and `<|end_of_text|>` (eos) sit after the learned vocabulary,
  as in Llama-3 and Qwen2.
- "sentencepiece": Llama-2 style. ids 0-2 are `<unk>` `<s>` `</s>`, 3-258 the byte-fallback
  tokens `<0x00>`..`<0xFF>`; characters outside a small Latin alphabet (CJK, emoji, newline)
  are always spelled in bytes. Metaspace pre-tokenizer, `<s>` added by the post-processor.
"""
from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers

from fusegen.engine.models.registry import SUPPORTED_ARCHITECTURES, get_architecture
from fusegen.engine.models.architecture import Architecture
from fusegen.engine.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Varied enough that BPE learns real merges while rare multi-byte characters (emoji, CJK)
# stay split across several byte tokens: that is what the detokenizer tests lean on.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he went out in his boat, and every evening he came back with the day's catch.
The weather today is sunny, with a high of 24 degrees and a light breeze from the west.
Please remember to bring your passport, your tickets and 3 copies of the signed contract.
In 1969, Apollo 11 landed on the Moon; Neil Armstrong and Buzz Aldrin walked on its surface.
The answer is 42. The total came to $1,234.56 (including tax), paid on 2024-03-15 at 09:30.
def greet(name):\n    return f"Hello, {name}!"\nprint(greet("world"))
for i in range(10): total += i * 2  # sum of even numbers
{"id": 7, "name": "Ada Lovelace", "tags": ["math", "poetry"], "score": 9.5}
Machine learning models learn patterns from data; larger models need more memory and compute.
Questions? Answers! Quotes: "yes", 'no', maybe... Lists: first, second; third: fourth.
She said: "I will be there at 5 o'clock, don't wait for me." He nodded and left quietly.
Le petit déjeuner est servi à huit heures. Où est la gare ? Très bien, merci beaucoup !
Les élèves ont étudié l'histoire de la Révolution française pendant toute l'année.
Ich möchte einen Kaffee, bitte. Die Straße ist sehr groß und schön. Grüße aus München!
Über den Wolken muss die Freiheit wohl grenzenlos sein. Äpfel, Öl und Übung.
Emoji are fun 🎉🚀 and sometimes sad 😢. Weather: ☀️ then 🌧️. Cheers 🍻! Love ❤️ and 👍.
中文文本：我们今天去公园散步。天气很好，阳光明媚。你好，世界！
日本語のテキスト：こんにちは、元気ですか？東京は大きな都市です。
한국어 문장: 안녕하세요, 만나서 반갑습니다.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -17 +42 1e-5 50% 7/8.
Punctuation: ! ? . , ; : - -- ... ( ) [ ] { } < > / \\ | @ # $ % ^ & * _ = + ~ `
    Indented line with tabs\tand  double  spaces.
Trailing spaces   \nand blank lines\n\n\nare part of real text too.
The history of science is full of surprises: chemistry grew out of alchemy, astronomy out
of astrology, and modern medicine out of centuries of trial and error.
Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.
The library opens at nine and closes at six; books may be borrowed for three weeks.
Our team shipped the new release on Friday, and the users reported fewer errors than before.
It was the best of times, it was the worst of times, it was the age of wisdom.
To be, or not to be, that is the question. All the world's a stage.
"""

# The sentencepiece kind keeps only these characters whole; everything else (CJK, emoji,
# newline, tab) goes through byte fallback, like rare characters in Llama-2.
_SP_ALPHABET = [chr(c) for c in range(0x21, 0x7F)] + list("▁éèàçôöüäßÉÜÖÄ")

_BPE_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")
_SP_SPECIALS = ("<unk>", "<s>", "</s>")

_BPE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
_SP_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}"
    "{% else %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}{% endif %}"
    "{% endfor %}"
)


def build_tokenizer(path, kind: str = "bpe", vocab_size: int = 512) -> pathlib.Path:
    """Write tokenizer.json and tokenizer_config.json into `path`; returns `path`.

    `vocab_size` counts every id including special tokens; a corpus this small may yield a
    few fewer tokens than asked for when `vocab_size` is large.
    """
    # At least the specials and all 256 bytes (plus the whole-character alphabet for sentencepiece).
    minimum = {"bpe": len(_BPE_SPECIALS) + 256, "sentencepiece": len(_SP_SPECIALS) + 256 + len(_SP_ALPHABET)}
    if kind in minimum and vocab_size < minimum[kind]:
        raise ValueError(f"vocab_size for a {kind} tokenizer must be at least {minimum[kind]}, got {vocab_size}")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind == "bpe":
        tok, (bos, eos), template = _bpe_tokenizer(vocab_size), _BPE_SPECIALS, _BPE_TEMPLATE
        extra = {}
    elif kind == "sentencepiece":
        tok, (unk, bos, eos), template = _sp_tokenizer(vocab_size), _SP_SPECIALS, _SP_TEMPLATE
        extra = {"unk_token": unk, "legacy": False}
    else:
        raise ValueError(f"tokenizer kind must be 'bpe' or 'sentencepiece', got {kind!r}")
    tok.save(str(path / "tokenizer.json"))
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": bos,
        "eos_token": eos,
        **extra,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
    }
    _write_json(path / "tokenizer_config.json", config)
    return path


def _bpe_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(_BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    # Specials after the learned vocabulary, as in Llama-3 / Qwen2.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _BPE_SPECIALS])
    bos = _BPE_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


def _sp_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
    # Train merges over Metaspace words, then lay the vocabulary out like Llama-2:
    # specials, then the 256 byte tokens, then the learned pieces.
    trainer_tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(_SP_SPECIALS) - 256,
        initial_alphabet=_SP_ALPHABET,
        limit_alphabet=len(_SP_ALPHABET),
        show_progress=False,
    )
    trainer_tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    pieces = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, t in enumerate(_SP_SPECIALS)}
    vocab.update({f"<0x{b:02X}>": len(_SP_SPECIALS) + b for b in range(256)})
    for piece, _ in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]

    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SP_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return tok


def build_checkpoint(
    path,
    arch: str = "llama",
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool | None = None,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    dtype: str = "float32",
    init_std: float = 0.02,
    seed: int = 0,
    tokenizer: str = "bpe",
    eos_token_id: int | list[int] | None = None,
    max_shard_bytes: int | None = None,
) -> pathlib.Path:
    """Write a random checkpoint (config, weights, generation config, tokenizer) into `path`.

    `vocab_size` defaults to the tokenizer's size rounded up to a multiple of 64 (the extra
    rows are never produced by the tokenizer, as in real padded vocabularies).
    """
    family = _architecture(arch)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    path = pathlib.Path(path)
    build_tokenizer(path, tokenizer)
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    num_tokenizer_ids = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    if vocab_size is None:
        vocab_size = -(-num_tokenizer_ids // 64) * 64
    elif vocab_size < num_tokenizer_ids:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {num_tokenizer_ids} ids")
    bos, eos = (_SP_SPECIALS[1:] if tokenizer == "sentencepiece" else _BPE_SPECIALS)
    bos_id = tok.token_to_id(bos)
    eos_id = tok.token_to_id(eos) if eos_token_id is None else eos_token_id
    head_dim = head_dim or hidden_size // num_heads

    config = _hf_config(
        family, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, rope_scaling=rope_scaling,
        dtype=dtype, init_std=init_std, bos_id=bos_id, eos_id=eos_id,
    )
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    # The tensors are what fusegen's loader expects for this config.json; rope settings
    # do not change them (so a rope type fusegen refuses still builds, e.g. to test the refusal).
    cfg = ModelConfig.from_dict({k: v for k, v in config.items() if not k.startswith("rope")})
    _save_weights(path, _random_weights(family, cfg, init_std, seed, DTYPES[dtype]), max_shard_bytes)
    return path


def _architecture(name: str) -> Architecture:
    by_type = {a.model_type: a for a in map(get_architecture, SUPPORTED_ARCHITECTURES)}
    if name not in by_type:
        raise ValueError(f"arch must be one of {sorted(by_type)}, got {name!r}")
    return by_type[name]


def _hf_config(arch: Architecture, *, vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
               head_dim, tie_word_embeddings, attention_bias, max_position_embeddings, rope_theta,
               rope_scaling, dtype, init_std, bos_id, eos_id) -> dict:
    """config.json with the keys transformers 5 writes for the class, plus the legacy keys
    (`rope_theta`, `rope_scaling`, `torch_dtype`) that most published checkpoints carry,
    so a loader written against either format reads it."""
    rope_parameters = {"rope_theta": rope_theta, "rope_type": "default"}
    if rope_scaling:  # legacy configs name the type "type", transformers 5 "rope_type"
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        rope_parameters = {k: v for k, v in rope_scaling.items() if k != "type"}
        rope_parameters.update(rope_type=rope_type, rope_theta=rope_theta)
    config = {
        "architectures": [arch.hf_names[0]],
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "dtype": dtype,
        "eos_token_id": eos_id,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": init_std,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "model_type": arch.model_type,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": rope_parameters,
        "rope_scaling": rope_scaling,
        "rope_theta": rope_theta,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    config.update(arch.synthetic_config(num_layers, attention_bias))
    return dict(sorted(config.items()))


def _random_weights(arch: Architecture, cfg: ModelConfig, std: float, seed: int,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def draw(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("norm.weight"):
            # 1 + noise, so a loader that drops or misplaces norm weights changes the output
            return (1.0 + 0.1 * torch.randn(*shape, generator=gen)).to(dtype)
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    # transformers' order: the embedding, the layers, the rest. The draws follow it, so
    # the same arguments give the same bytes.
    embedding, *rest = arch.fixed_tensors(cfg)
    layers = [(arch.layer_prefix.format(i) + name, shape, param)
              for i in range(cfg.num_layers) for name, shape, param in arch.layer_tensors(cfg)]
    return {name: draw(name, shape) for name, shape, _ in [embedding, *layers, *rest]}


def _save_weights(path: pathlib.Path, weights: dict[str, torch.Tensor], max_shard_bytes: int | None):
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a rebuild with other sharding must not leave stale shards
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(weights, str(path / "model.safetensors"), metadata=metadata)
        return
    shards, size = [{}], 0  # greedy in name order; a tensor larger than the limit gets its own shard
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(path / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(file: pathlib.Path, obj: dict):
    file.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
