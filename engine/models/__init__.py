"""The architectures fusegen runs, one module each, found by their config.json name.

Adding an architecture: write `engine/models/<family>.py` with a `@register`ed
`Architecture` subclass (see `architecture.py` for what it states), and import the
module at the bottom of this file.
"""
from __future__ import annotations

from collections.abc import KeysView
from typing import TYPE_CHECKING

from fusegen.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from fusegen.engine.models.architecture import Architecture

_ARCHITECTURES: dict[str, Architecture] = {}  # config.json architecture name -> its module's
# Live view, in registration order: grows as architecture modules register.
SUPPORTED_ARCHITECTURES: KeysView[str] = _ARCHITECTURES.keys()


def register(cls: type[Architecture]) -> type[Architecture]:
    """Class decorator: serve `cls.hf_names` with one instance of `cls`."""
    arch = cls()
    for name in cls.hf_names:
        _ARCHITECTURES[name] = arch
    return cls


def get_architecture(name: str) -> Architecture:
    try:
        return _ARCHITECTURES[name]
    except KeyError:
        raise ModelLoadError(f"architecture {name!r} not supported; fusegen runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}") from None


# Each module registers itself on import; after the registry exists, since they use it.
from fusegen.engine.models import (  # noqa: E402,F401
    llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, mixtral, qwen3_moe)
