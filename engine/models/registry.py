"""The architecture registry: config.json architecture names to the one `Architecture`
instance that serves each. Every family module registers itself here as the package
(engine/models/__init__.py) imports it, so a lookup always sees them all."""
from __future__ import annotations

from collections.abc import KeysView
from typing import TYPE_CHECKING

from fusegen.engine.errors import ModelLoadError
from fusegen.engine.models.config import ARCHITECTURE_FLAGS

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
        ARCHITECTURE_FLAGS[name] = arch.config_flags
    return cls


def get_architecture(name: str) -> Architecture:
    try:
        return _ARCHITECTURES[name]
    except KeyError:
        raise ModelLoadError(f"architecture {name!r} not supported; fusegen runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}") from None
