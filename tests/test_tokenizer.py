"""Tokenizer against transformers' AutoTokenizer on both synthetic tokenizer styles."""
import json
import shutil

import jinja2
import pytest

from fusegen.engine.models.synthetic import build_tokenizer
from fusegen.engine.tokenizer import PromptLimit, Tokenizer, prompt_problem

transformers = pytest.importorskip("transformers")

KINDS = ["bpe", "sentencepiece"]
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "emoji 🎉🚀 and 😢!",
    "中文：我们今天去公园。日本語のテキスト",
    "café, naïve, Straße, Übung, élève",
    "line one\nline two\n\n\ttabbed\n",
    "digits 3.14159 and $1,234.56 on 2024-03-15",
    "<s> and </s> and <|begin_of_text|> typed as text",
    "",
    "   ",
    "🎉",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " Où est la gare ? 🚉 "},
    {"role": "assistant", "content": "Tout droit."},
    {"role": "user", "content": "Merci !"},
]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    """(fusegen Tokenizer, transformers tokenizer) over the same files."""
    path = build_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, add_special_tokens):
    tok, hf = pair
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text
    assert tok.encode_batch(TEXTS, add_special_tokens) == [tok.encode(t, add_special_tokens) for t in TEXTS]


def test_bos_added_by_post_processor(pair):
    tok, _ = pair
    ids = tok.encode("Hello")
    assert ids[0] == tok.bos_token_id and tok.encode("Hello", add_special_tokens=False) == ids[1:]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pair, skip_special_tokens):
    tok, hf = pair
    for text in TEXTS:
        ids = hf.encode(text) + tok.eos_token_ids
        assert tok.decode(ids, skip_special_tokens) == hf.decode(ids, skip_special_tokens=skip_special_tokens), text


def test_special_tokens_and_vocab_size(pair):
    tok, hf = pair
    assert tok.bos_token_id == hf.bos_token_id is not None
    assert tok.eos_token_ids == [hf.eos_token_id]
    assert tok.pad_token_id is None and hf.pad_token_id is None
    assert tok.vocab_size == len(hf) == 512


def test_no_token_covers_more_bytes_than_the_longest_entry(pair):
    tok, _ = pair
    longest = max(len(t.encode()) for t in tok._backend.get_vocab(with_added_tokens=True))
    assert tok.max_token_bytes == longest
    for text in TEXTS + ["<|begin_of_text|>" * 9, " " * 300, "\u00e9" * 50 + "🎉" * 20]:
        assert len(text.encode()) <= len(tok.encode(text, False)) * tok.max_token_bytes, text


def test_prompt_limit_checks_size_and_unicode_before_tokenizing():
    limit = PromptLimit(256, 17)
    assert limit.max_bytes == 4352 and limit.too_long(4352) is None
    assert limit.too_long(4353, "the messages' content") == (
        "prompt_too_long: the messages' content has 4,353 bytes; no text over 4,352 bytes "
        "fits the context (max_model_len 256 tokens x 17 bytes, the longest token); shorten it")
    assert prompt_problem("\u00e9" * 2176, limit) is None  # 4,352 bytes
    assert prompt_problem("\u00e9" * 2177, limit).startswith(
        "prompt_too_long: the prompt has 4,354 bytes;")
    assert prompt_problem("x" * 10**6) is None  # no limit: only Unicode is checked
    assert prompt_problem("ok \udc80 ok", limit) == (
        "invalid_prompt: the prompt is not valid Unicode: lone surrogate U+DC80 at "
        "character 3; remove it from the text")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt):
    tok, hf = pair
    expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt) == expected
    assert expected.startswith(hf.bos_token) and "Tout droit." in expected


def test_chat_template_raise_exception(tmp_path):
    tok = Tokenizer.from_dir(build_tokenizer(tmp_path, "sentencepiece"))
    with pytest.raises(jinja2.TemplateError, match="Unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(tmp_path):
    build_tokenizer(tmp_path, "bpe")
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES)


def test_chat_template_file_takes_precedence(tmp_path):
    build_tokenizer(tmp_path, "bpe")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    tok, hf = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False) == (
        "[system][user][assistant][user]"
    )


def _edit_json(path, edit) -> None:
    """Rewrite the JSON file at `path` with `edit` applied to its object."""
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_no_chat_template_is_a_clear_error(tmp_path):
    build_tokenizer(tmp_path, "bpe")
    _edit_json(tmp_path / "tokenizer_config.json", lambda config: config.pop("chat_template"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_special_tokens_as_added_token_dicts(tmp_path):
    build_tokenizer(tmp_path, "sentencepiece")
    _edit_json(tmp_path / "tokenizer_config.json", lambda config: config.update(
        eos_token={"__type": "AddedToken", "content": "</s>", "special": True},
        pad_token={"content": "<unk>"}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, [2], 0)


def test_without_tokenizer_config(tmp_path):
    build_tokenizer(tmp_path, "bpe")
    (tmp_path / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == (None, [], None)
    assert tok.encode("Hi")[0] == 510  # the post-processor still adds <|begin_of_text|>


def test_missing_tokenizer_json_names_the_file(tmp_path):
    build_tokenizer(tmp_path / "ok", "bpe")
    shutil.copy(tmp_path / "ok" / "tokenizer_config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_add_bos_token_in_config_follows_transformers(tmp_path):
    # transformers 5 lets tokenizer.json's post-processor decide, whatever add_bos_token says.
    build_tokenizer(tmp_path, "sentencepiece")
    _edit_json(tmp_path / "tokenizer_config.json",
               lambda config: config.update(add_bos_token=False))
    tok, hf = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode("Hello") == hf.encode("Hello")


def test_no_post_processor_adds_no_special_tokens(tmp_path):
    build_tokenizer(tmp_path, "bpe")
    _edit_json(tmp_path / "tokenizer.json", lambda data: data.update(post_processor=None))
    tok, hf = Tokenizer.from_dir(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode("Hello") == hf.encode("Hello") == tok.encode("Hello", add_special_tokens=False)


def test_chat_template_in_a_fresh_process(tmp_path):
    # Nothing else imported jinja2.ext there: the tokenizer must import what it uses.
    import subprocess
    import sys
    from pathlib import Path

    from fusegen.engine.models.synthetic import build_tokenizer

    build_tokenizer(tmp_path, kind="bpe")
    code = ("import sys; from fusegen.engine.tokenizer import Tokenizer; "
            "print(Tokenizer.from_dir(sys.argv[1]).apply_chat_template("
            "[{'role': 'user', 'content': 'hi'}]))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, cwd=Path(__file__).parents[1], timeout=120)
    assert done.returncode == 0, done.stderr
    assert "hi" in done.stdout
