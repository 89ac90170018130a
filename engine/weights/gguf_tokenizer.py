"""A `tokenizers` backend built from a GGUF file's embedded vocabulary.

A GGUF carries no tokenizer.json: `tokenizer.ggml.model` names the kind, and the
vocabulary, merges, scores and token types are metadata arrays. fusegen builds the
same backend transformers' GGUF loader builds (`AutoTokenizer.from_pretrained(dir,
gguf_file=name)`), so ids and text match it:
- "gpt2": byte-level BPE from the tokens and merges, the pre-tokenizer's split regex
  chosen by `tokenizer.ggml.pre`;
- "llama": SentencePiece-style BPE with byte fallback; merges from the file, or
  recovered from the vocabulary ranked by score; Gemma files (no merges, scores out of
  merge order, runs of spaces stored as spaces) get Gemma's normalizer and ranking.
Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain
added tokens; BOS / EOS are added as `tokenizer.ggml.add_bos_token` / `add_eos_token`
say (a SentencePiece file that does not say adds BOS, as llama.cpp does).
"""
from __future__ import annotations

import itertools

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from fusegen.engine.errors import ModelLoadError

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
_GEMMA = ("gemma", "gemma2", "gemma3")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> the split its merges were learned over (others: GPT-2's).
_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe",
                            "dbrx"), _LLAMA3_SPLIT),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT)}


def gguf_tokenizer(meta: dict, source: str) -> tuple[Backend, dict, str | None]:
    """(backend, tokenizer_config-style dict of special tokens, chat template)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ModelLoadError(f"{source}: the GGUF file has no embedded tokenizer "
                             "(tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind == "gpt2":
        backend = _byte_level(tokens, _merges(meta, source))
    elif kind == "llama":
        gemma = meta.get("general.architecture") in _GEMMA
        backend = _gemma(meta) if gemma else _sentencepiece(tokens, _merges(meta, source))
    else:
        raise ModelLoadError(f"{source}: tokenizer.ggml.model {kind!r} not supported; fusegen "
                             "builds 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) "
                             "tokenizers")
    config = _special_tokens(meta, tokens, source)
    _add_tokens(backend, meta, config, byte_level=kind == "gpt2")
    if (split := _SPLITS.get(meta.get("tokenizer.ggml.pre"))) is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    backend.post_processor = _post_processor(
        config.get("bos_token") if add_bos else None,
        config.get("eos_token") if meta.get("tokenizer.ggml.add_eos_token") else None, backend)
    return backend, config, meta.get("tokenizer.chat_template")


def _special_tokens(meta: dict, tokens: list[str], source: str) -> dict[str, str]:
    """bos_token, eos_token ... as strings, as tokenizer_config.json names them."""
    config = {}
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise ModelLoadError(f"{source}: tokenizer.ggml.{key} is {token_id}, outside the "
                                 f"vocabulary of {len(tokens)} tokens; the file is damaged")
        config[name] = tokens[token_id]
    return config


def _byte_level(tokens: list[str], merges: list[tuple[str, str]]) -> Backend:
    # Tokens outside the byte alphabet (a few converters write raw text) are respelled.
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], merges: list[tuple[str, str]]) -> Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                          dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return backend


def _gemma(meta: dict) -> Backend:
    # Runs of two or more spaces are stored as spaces but looked up as "▁▁"; merges are
    # recovered from the vocabulary ranked by file order (Gemma's scores are not).
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t
              for t in meta["tokenizer.ggml.tokens"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = recover_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                          dropout=None, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                                 invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    return backend


def _merges(meta: dict, source: str) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" in meta:
        return [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokens, scores = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ModelLoadError(f"{source}: the GGUF tokenizer has neither merges nor scores; "
                             "fusegen cannot rebuild its BPE merges")
    return recover_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))


def recover_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two tokens, best
    score first; among equal scores the longer left piece, then the longer right piece,
    then the order the tokens come in: transformers' `generate_merges` ranking. (Two
    splits of one token never tie, so the groups of equal score are all that is sorted.)"""
    merges = []
    by_score = sorted(scores.items(), key=lambda item: item[1], reverse=True)  # stable
    for _, group in itertools.groupby(by_score, key=lambda item: item[1]):
        pairs = [(t[:i], t[i:]) for t, _ in group for i in range(1, len(t))
                 if t[:i] in vocab and t[i:] in vocab]
        pairs.sort(key=lambda pair: (len(pair[0]), len(pair[1])), reverse=True)
        merges += pairs
    return merges


def _add_tokens(backend: Backend, meta: dict, config: dict, byte_level: bool) -> None:
    """Control tokens (and the named special ones) as special added tokens, user-defined
    ones as plain added tokens, so each stays whole in the text. In a byte-level
    vocabulary a control token outside the byte alphabet is a converter's mislabel:
    adding it would grow the vocabulary past the model's, so it is skipped."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [t for t, kind in zip(tokens, types)
               if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    vocab = backend.get_vocab()
    named = [t for t in config.values() if t in vocab and t not in control]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t in control + named])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab])


def _post_processor(bos: str | None, eos: str | None, backend: Backend):
    # transformers' single-sequence template: [BOS] $A [EOS], each only when asked for.
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1",
                     *([f"{eos}:1"] if eos else [])])
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies spell in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}
