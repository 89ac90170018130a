"""`Tokenizer`: a checkpoint's tokenizer.json + tokenizer_config.json, and its chat template.

Encoding and decoding run in the `tokenizers` library, so ids match transformers'
`AutoTokenizer` (which drives the same library) for tokenizers that it loads from
tokenizer.json. transformers 5 ignores `add_bos_token`/`add_eos_token` in
tokenizer_config.json whenever tokenizer.json exists: the post-processor in tokenizer.json
alone decides which special tokens `encode` adds, and a missing post-processor adds none.
"""
from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass
from datetime import datetime

from tokenizers import Tokenizer as _Backend

from fusegen.engine.template_sandbox import (DEFAULT_MAX_SIZE, BoundedSandbox,
                                              TemplateSizeError, json_size)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class PromptError(ValueError):
    """A text that cannot be a prompt, found while making one (a chat template's text over
    the prompt limit, a tokenizer that failed on it): that prompt's error, `code` its
    error code ("prompt_too_long", "invalid_prompt")."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Tokenizer:
    # Where the chat template comes from, for the errors when there is none: a
    # checkpoint's tokenizer files, or (from_gguf) the GGUF file's metadata.
    template_key, template_home = "chat_template", "tokenizer files"
    # How errors name the tokenizer's own template ("the chat template in <file>").
    template_origin = "the chat template"
    # The engine's, once it has one: the most text a chat template may write (checked
    # as it renders, before tokenizing); DEFAULT_MAX_SIZE characters without it.
    prompt_limit: PromptLimit | None = None

    def __init__(self, backend: _Backend, config: dict | None = None, chat_template: str | None = None):
        config = config or {}
        self._backend = backend
        # Special tokens as strings, in the form chat templates see them (bos_token, eos_token ...).
        self.special_tokens = {n: t for n in _SPECIAL_NAMES if (t := _token_content(config.get(n))) is not None}
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1  # ids may have holes
        self.bos_token_id = self._id_of("bos_token")
        eos = self._id_of("eos_token")
        self.eos_token_ids = [] if eos is None else [eos]
        self.pad_token_id = self._id_of("pad_token")
        self.chat_template = chat_template
        # transformers skips this cleanup for BPE models; it matters only for WordPiece/Unigram ones.
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces")) and (
            type(backend.model).__name__ != "BPE"
        )

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        path = pathlib.Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found: fusegen reads the fast-tokenizer file tokenizer.json. Create it with "
                f"`transformers.AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` on a machine with transformers."
            )
        backend = _Backend.from_file(str(file))
        config = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins, as in transformers
            if (path / name).is_file():
                config.update(_read_json(path / name))
        template, file = _chat_template(path, config)
        tokenizer = cls(backend, config, template)
        tokenizer.template_origin = f"the chat template in {file}"
        return tokenizer

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """The tokenizer a GGUF file embeds (engine/weights/gguf_tokenizer.py)."""
        from fusegen.engine.weights.gguf import GGUFFile
        from fusegen.engine.weights.gguf_tokenizer import gguf_tokenizer

        tokenizer = cls(*gguf_tokenizer(GGUFFile.open(path).metadata, str(path)))
        tokenizer.template_key, tokenizer.template_home = "tokenizer.chat_template", "GGUF metadata"
        tokenizer.template_origin = f"the chat template in {path}'s metadata"
        return tokenizer

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry: no token stands for more bytes of
        text (a byte-level entry spells each byte with one character, "▁" stands for one
        space, "<0x41>" for one byte). Only a normalizer that folds characters into
        shorter ones (NFC, NFKC) could pack more into a token, and only in text made of
        such characters matching the longest entries: not a text that would fit."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except BaseException as exc:
            if _is_panic(exc):
                raise _panic_error(exc, [text]) from None
            raise

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        try:
            encodings = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        except BaseException as exc:
            if _is_panic(exc):
                raise _panic_error(exc, texts) from None
            raise
        return [e.ids for e in encodings]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up_spaces else text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, *, tokenize: bool = False
                            ) -> str | list[int]:
        """The conversation as the model's template (or `chat_template`) writes it (with
        `tokenize`, as transformers' keyword: its ids, `encode_chat`'s). Keys
        whose value is None are left out, as transformers does: a Parquet struct column
        has every field in every row, and templates test for a key, not for None.

        The template renders in the bounded sandbox (engine/template_sandbox.py): a
        template that runs too long raises TemplateTimeError naming it, one that builds
        too large a value TemplateSizeError, and text longer than the prompt limit
        PromptError (prompt_too_long), as soon as it passes it."""
        if tokenize:
            return self.encode_chat(messages, add_generation_prompt, chat_template)
        if not chat_template and self.chat_template is None:
            raise ValueError(self._no_template_message())
        source, origin = self._template(chat_template)
        limit = self.prompt_limit
        template = _compile_template(source, limit.max_bytes if limit else DEFAULT_MAX_SIZE)
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {"messages": messages, "tools": None, "documents": None,
                     "add_generation_prompt": add_generation_prompt, **self.special_tokens}
        try:
            return template.environment.render(template, variables, origin)
        except TemplateSizeError as exc:
            if exc.output_limit is None:
                raise
            what = f"the conversation as {origin} writes it"
            if limit is None:
                raise PromptError("prompt_too_long", f"{what} has more than "
                                  f"{exc.output_limit:,} characters, the most a chat "
                                  "template may write") from None
            raise PromptError(*limit.message(f"more than {exc.output_limit:,} characters",
                                             what).split(": ", 1)) from None

    def _template(self, chat_template: str | None) -> tuple[str, str]:
        """The template to render and how errors name it."""
        if chat_template:
            return chat_template, "the chat_template passed in"
        return self.chat_template, self.template_origin

    def _no_template_message(self) -> str:
        if self.template_key != "chat_template":  # a GGUF file: no files to add one to
            return (f"this tokenizer has no chat template (no {self.template_key} in its "
                    f"{self.template_home}): pass plain-text prompts, or pass a template "
                    "(LLM.chat(..., chat_template=...))")
        return ("this tokenizer has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja): pass plain-text prompts, pass a template (LLM.chat(..., "
                "chat_template=...)), or add chat_template.jinja to the checkpoint")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
        """The conversation's prompt ids (`chat_prompt`'s)."""
        return self.chat_prompt(messages, add_generation_prompt, chat_template)[1]

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> tuple[str, list[int]]:
        """The conversation as the template writes it, and its prompt ids as transformers'
        `apply_chat_template(..., tokenize=True)` gives them: the text already carries
        the special tokens the template writes (BOS...), so the post-processor adds none
        again. A text that cannot be a prompt (over the prompt limit in bytes, a lone
        surrogate) raises PromptError before it is tokenized."""
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template)
        origin = self._template(chat_template)[1]
        problem = prompt_problem(text, self.prompt_limit, f"the conversation as {origin} writes it")
        if problem:
            raise PromptError(*problem.split(": ", 1))
        return text, self.encode(text, add_special_tokens=False)


@dataclass(frozen=True, slots=True)
class PromptLimit:
    """The most text that can be a prompt, known before tokenizing it: no token covers
    more bytes than the longest vocabulary entry, so a text over max_model_len x that
    many bytes cannot fit the context. Tokenizing costs a few hundred bytes of memory
    per byte of text: checking first keeps one huge cell from taking the worker down."""
    max_model_len: int
    max_token_bytes: int

    @property
    def max_bytes(self) -> int:
        return self.max_model_len * self.max_token_bytes

    def too_long(self, num_bytes: int, what: str = "the prompt") -> str | None:
        """A `prompt_too_long: ...` error for a text of num_bytes, or None if it may fit."""
        if num_bytes <= self.max_bytes:
            return None
        return self.message(f"{num_bytes:,} bytes", what)

    def message(self, size: str, what: str) -> str:
        """The `prompt_too_long: ...` error for `what`, of `size` ("9,000 bytes")."""
        return (f"prompt_too_long: {what} has {size}; no text over "
                f"{self.max_bytes:,} bytes fits the context (max_model_len "
                f"{self.max_model_len} tokens x {self.max_token_bytes} bytes, the longest "
                "token); shorten it")

    def conversation_too_long(self, messages: list[dict]) -> str | None:
        """`too_long` over a conversation's content, before its template renders it."""
        num_bytes = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages)
        return self.too_long(num_bytes, "the messages' content")


def prompt_problem(text: str, limit: PromptLimit | None = None,
                   what: str = "the prompt") -> str | None:
    """Why `text` cannot be tokenized as a prompt ("code: message"), or None: a lone
    surrogate (not encodable as UTF-8), or more bytes than `limit` allows (the message
    calling the text `what`)."""
    try:
        num_bytes = len(text) if text.isascii() else len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return (f"invalid_prompt: the prompt is not valid Unicode: lone surrogate "
                f"U+{ord(text[exc.start]):04X} at character {exc.start}; remove it from the text")
    return None if limit is None else limit.too_long(num_bytes, what)


def messages_problem(messages) -> str | None:
    """Why `messages` is not a conversation (a non-empty list of {role, content} mappings
    with string values; None-valued keys ignored), or None."""
    shape = "must be a non-empty list of {role: string, content: string} messages"
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        return f"{shape}; got {got}"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"{shape}; message {i} is {type(message).__name__}"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"{shape}; message {i} has no string {key!r}"
    return None


def _token_content(token) -> str | None:
    # tokenizer_config stores special tokens as strings or as serialized AddedToken dicts.
    return token.get("content") if isinstance(token, dict) else token


def _read_json(file: pathlib.Path) -> dict:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def _chat_template(path: pathlib.Path, config: dict) -> tuple[str | None, pathlib.Path]:
    """The template and the file it is in. Same precedence as transformers:
    chat_template.jinja beats the tokenizer_config entry; a list of named templates
    means the one called "default"."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8"), \
            path / "chat_template.jinja"
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template, path / "tokenizer_config.json"


@functools.lru_cache(maxsize=16)  # LLM.chat renders every conversation through one template
def _compile_template(source: str, max_size: int):
    # Chat templates come from the checkpoint or the user, i.e. untrusted: render them in
    # the bounded sandbox (`max_size`: the prompt limit), with the same options and
    # helpers as transformers' environment so they render identically.
    import jinja2
    import jinja2.ext

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(max_size, kind="chat", trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols])
    env.add_filter("tojson", tojson, lambda x, ensure_ascii=False, indent=None,
                   separators=None, sort_keys=False: json_size(x, indent, separators))
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _is_panic(exc: BaseException) -> bool:
    """A panic in the `tokenizers` library: pyo3's PanicException, a BaseException that
    `except Exception` lets through (up past a job's task, which then never ends)."""
    return type(exc).__name__ == "PanicException"


def _panic_error(exc: BaseException, texts: list[str]) -> PromptError:
    size = sum(map(len, texts))
    return PromptError("invalid_prompt", f"the tokenizer failed on {size:,} characters of "
                       f"text (the tokenizers library panicked: {str(exc)[:200]}); shorten "
                       "or fix the text")


def _clean_up_tokenization(text: str) -> str:
    # transformers' clean_up_tokenization, for checkpoints that ask for it.
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
