"""Command-line flags. The engine's come from `EngineOptions`, the one list of engine
settings, and the sampling ones from `SamplingParams`: their field names give the flags,
their help texts the --help."""
from __future__ import annotations

import click

from fusegen.engine.options import FIELDS
from fusegen.engine.sampling_params import FIELDS as SAMPLING_FIELDS


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


def sampling_flags(job_option) -> list:
    """The sampling flags, one per `SamplingParams` field with its help text, each read
    into the job's default of its name (a row column of the same name overrides it for
    that row); `job_option` adds the job's default to its help."""
    flags = []
    for f in SAMPLING_FIELDS:
        flag, kind = "--" + f.name.replace("_", "-"), f.metadata["kind"]
        help = f"{f.metadata['help'].removesuffix('.')} (row column overrides)."
        if kind is bool:
            flags.append(job_option(f"{flag}/--no-{flag[2:]}", help))
        elif kind is list:  # repeated; token ids are read as ints
            item = int if f.type == "list[int]" else None
            flags.append(job_option(flag, help, multiple=True, type=item))
        else:
            flags.append(job_option(flag, help, type=kind if kind in (int, float) else None))
    return flags
