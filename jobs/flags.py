"""Command-line flags. The engine's come from `EngineOptions`, the one list of engine
settings: its field names give the flags, its help texts their --help."""
from __future__ import annotations

import click

from fusegen.engine.options import FIELDS


def option(flag: str, help: str, default_text, **kwargs):
    """A flag whose default is None, so that a job file's value survives unless the flag
    is given; --help still shows the real default."""
    name = flag.split("/")[0].lstrip("-").replace("-", "_")
    return click.option(flag, name, default=None, help=f"{help}  [default: {default_text}]",
                        **kwargs)


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
            flags.append(option(f"{flag}/--no-{flag[2:]}", f.metadata["help"], default))
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
