"""The tokenizer fusegen builds from a GGUF file's embedded vocabulary encodes and decodes
as transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=name)` does: on the real
SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece-style) files, and on tiny files
of the other kinds the tests write."""
import json

import pytest

from checkpoints import make_hf_checkpoint
from gguf_checkpoints import gemma3_path, smollm2_path, write_gguf
from fusegen.engine import ModelLoadError
from fusegen.engine.tokenizer import Tokenizer
from fusegen.engine.weights.gguf_tokenizer import recover_merges

transformers = pytest.importorskip("transformers", reason="transformers is the reference "
                                   "(pip install transformers)")

TEXTS = [
    "Hello world", " leading space", "   three leading spaces", "trailing space ",
    "two  spaces\tand a tab", "line one\nline two\n\n\nthree newlines", "\n starts with newline",
    "emoji 🎉🚀 and a family 👨‍👩‍👧", "日本語のテキストと中文混合", "한국어 텍스트",
    "accents: café naïve façade", "numbers 1234567890 3.14159", "code: def f(x): return x**2",
    "<|im_start|>user\nHi there<|im_end|>\n", "<start_of_turn>user\nHi<end_of_turn>",
    "<bos><eos> specials inline", "mixed   <|endoftext|>   spacing", "x" * 300, "",
]


def _reference(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _assert_same(ours: Tokenizer, theirs):
    # The whole backend: model, merges, added tokens, normalizer, pre-tokenizer, decoder.
    want = json.loads(theirs.backend_tokenizer.to_str())
    # transformers' byte-level class adds GPT-2's "<|endoftext|>" when the vocabulary
    # lacks it, under an id past the model's embedding; fusegen adds no such token.
    extra = [t for t in want["added_tokens"] if t["id"] >= ours.vocab_size]
    assert [t["content"] for t in extra] in ([], ["<|endoftext|>"])
    want["added_tokens"] = [t for t in want["added_tokens"] if t not in extra]
    assert json.loads(ours._backend.to_str()) == want
    for text in (t for t in TEXTS if not extra or "<|endoftext|>" not in t):
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == \
            theirs(text, add_special_tokens=False).input_ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                theirs.decode(ids, skip_special_tokens=skip), text
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert ours.special_tokens.get(name) == getattr(theirs, name), name
    assert ours.chat_template == theirs.chat_template


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    return Tokenizer.from_gguf(path), _reference(path)


@pytest.fixture(scope="module")
def gemma3():
    path = gemma3_path()
    return Tokenizer.from_gguf(path), _reference(path)


def test_smollm2_byte_level_bpe(smollm2):
    ours, theirs = smollm2
    _assert_same(ours, theirs)
    assert ours.encode("Hello world") == [19556, 905]  # no BOS: the file says so
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, [2], 49152)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_gemma3_sentencepiece(gemma3):
    ours, theirs = gemma3
    _assert_same(ours, theirs)
    assert ours.encode("Hello world") == [2, 9259, 1902]  # BOS added, as the file says
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (2, [1], 262144)
    assert ours.chat_template is None  # this file embeds none


@pytest.mark.parametrize("pre", [None, "llama-bpe", "qwen2"])
def test_tiny_byte_level_file(pre, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bpe")
    hf_dir = make_hf_checkpoint(tmp / "hf", "llama", "bpe")
    extra = {"tokenizer.ggml.pre": pre} if pre else {}
    path = write_gguf(hf_dir, tmp / "tiny.gguf", extra=extra)
    _assert_same(Tokenizer.from_gguf(path), _reference(path))


def test_tiny_sentencepiece_file(tmp_path_factory):
    # A Llama-2 layout (<unk> <s> </s>, 256 byte tokens, pieces): no merges in the
    # file, so both rebuild them from the scores.
    tmp = tmp_path_factory.mktemp("sp")
    hf_dir = make_hf_checkpoint(tmp / "hf", "llama", "sentencepiece")
    path = write_gguf(hf_dir, tmp / "tiny.gguf", tokenizer="llama")
    ours = Tokenizer.from_gguf(path)
    _assert_same(ours, _reference(path))
    assert ours.encode("Hi")[0] == ours.bos_token_id  # SentencePiece files add BOS


def test_recover_merges_ranking():
    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "bc", "abc", "ca"])}
    # best score first; one score shared by abc's two splits and ca: longer left first
    scores = {"ab": -1.0, "bc": -1.0, "abc": -2.0, "ca": -2.0, "a": 0.0}
    want = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc"), ("c", "a")]
    assert recover_merges(vocab, scores) == want
    from transformers.tokenization_utils_base import generate_merges
    assert generate_merges(vocab, scores) == want


def test_unsupported_tokenizer_kind(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("t5")
    hf_dir = make_hf_checkpoint(tmp / "hf", "llama", "bpe")
    path = write_gguf(hf_dir, tmp / "t5.gguf", extra={"tokenizer.ggml.model": "t5"})
    with pytest.raises(ModelLoadError, match="t5.gguf: tokenizer.ggml.model 't5' not "
                       "supported; fusegen builds 'gpt2' .* and 'llama' .* tokenizers"):
        Tokenizer.from_gguf(path)
