"""The architectures fusegen runs, one module each, found by their config.json name
(the registry is registry.py; importing this package registers every family).

Adding an architecture: write `engine/models/<family>.py` with a `@register`ed
`Architecture` subclass (see `architecture.py` for what it states), and import the
module below.
"""
from __future__ import annotations

from fusegen.engine.models.registry import (  # noqa: F401
    SUPPORTED_ARCHITECTURES, get_architecture, register)
# Each module registers itself on import.
from fusegen.engine.models import (  # noqa: F401
    llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, mixtral, qwen3_moe)
