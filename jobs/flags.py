"""Command-line flags. The engine's come from `EngineOptions`, the one list of engine
settings: its field names give the flags, its help texts their --help."""
from __future__ import annotations

import click

from fusegen.engine.options import FIELDS


def option(flag: str, help: str, default_text, *aliases: str, **kwargs):
    """A flag whose default is None, so that a job file's value survives unless the flag
    is given; --help still shows the real default. `aliases`: more names for it."""
    name = flag.split("/")[0].lstrip("-").replace("-", "_")
    return click.option(flag, *aliases, name, default=None,
                        help=f"{help}  [default: {default_text}]", **kwargs)


# Shorter names beside an engine option's own flags, as other engines spell them.
_ALIASES = {"enable_prefix_caching": ("--prefix-caching/--no-prefix-caching",)}


def engine_flags(names: tuple[str, ...] | None = None, exclude: tuple[str, ...] = (),
                 defaults: dict | None = None):
    """click options for the engine settings `names` (all when None), in their order.
    `defaults`: where a command's own default differs from the engine's (for --help).
    Values are checked by EngineOptions, whose errors name the option and its limit."""
    flags = []
    for f in FIELDS:
        if (names is not None and f.name not in names) or f.name in exclude:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), f.metadata["kind"]
        default = (defaults or {}).get(f.name, f.default)
        default = f.metadata["unset"] if default is None else default
        if kind is bool:
            flags.append(option(f"{flag}/--no-{flag[2:]}", f.metadata["help"], default,
                                *_ALIASES.get(f.name, ())))
        else:
            flags.append(option(flag, f.metadata["help"], default,
                                type=int if kind is int else str))
    return flags


def with_flags(flags):
    """Decorate a click command with `flags`, in order."""
    def decorate(fn):
        for flag in reversed(flags):
            fn = flag(fn)
        return fn
    return decorate


# The sampling flags beside --max-tokens ... --stop: (flag, help, click kwargs).
_SAMPLING = (
    ("--n", "Completions per row, each an output row with its completion_index.", {"type": int}),
    ("--min-p", "Drop tokens below min_p x the top token's probability.", {"type": float}),
    ("--stop-token-ids", "Token id that ends a row's generation; repeat for several.",
     {"type": int, "multiple": True}),
    ("--ignore-eos/--no-ignore-eos", "Keep generating past end-of-sequence tokens.", {}),
    ("--presence-penalty", "Subtracted from the logit of every token generated so far, "
     "in [-2, 2].", {"type": float}),
    ("--frequency-penalty", "Subtracted per occurrence of a generated token, in [-2, 2].",
     {"type": float}),
    ("--repetition-penalty", "Divides positive (multiplies negative) logits of tokens in "
     "the prompt or output; > 0, 1 for none.", {"type": float}),
    ("--min-tokens", "End-of-sequence and stop token ids are masked until this many "
     "tokens were generated.", {"type": int}),
    ("--logit-bias", "JSON object of token id -> bias added to its logit, e.g. "
     "'{\"50256\": -100}'.", {}),
    ("--bad-words", "A word that must not be generated; repeat for several.",
     {"multiple": True}),
    ("--logprobs", "Top-k logprobs per generated token (0: the sampled token's only), as "
     "a `logprobs` list column.", {"type": int}),
    ("--prompt-logprobs", "Top-k logprobs per prompt token, as a `prompt_logprobs` list "
     "column.", {"type": int}),
    ("--json-schema", "Constrain output to a JSON Schema: its JSON text or a file holding "
     "it.", {}),
    ("--response-format", "OpenAI's response_format as JSON, e.g. "
     "'{\"type\": \"json_object\"}' (type json_schema: its schema).", {}),
    ("--regex", "Constrain output to this regular expression.", {}),
    ("--choice", "Constrain output to one of these strings; repeat for each.",
     {"multiple": True}),
    ("--grammar", "Constrain output to this Lark or GBNF grammar.", {}),
)


def sampling_flags(job_option) -> list:
    """The sampling flags, each read into the job field of its name (a row column of the
    same name overrides it for that row); `job_option` adds the field's default to its
    help."""
    return [job_option(flag, f"{help} (row column overrides)", **kwargs)
            for flag, help, kwargs in _SAMPLING]

