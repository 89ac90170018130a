"""fusegen: batch offline inference for large transformer language models.

    from fusegen import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0.0))

The repository's folders install as subpackages: `fusegen.engine` (the generation
engine, usable alone), `fusegen.kernels`, `fusegen.jobs` (jobs, the CLI, the
benchmark) and `fusegen.workflows`.
"""
import ctypes as _ctypes
import sys as _sys


def _one_malloc_arena() -> None:
    """Every thread started from here on allocates from glibc's main arena (M_ARENA_MAX
    1), the engine's thread among them: before torch and numpy start theirs, so that no
    other arena is there to be handed out (fusegen.engine.host says why)."""
    if _sys.platform.startswith("linux"):
        try:
            _ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX; musl's mallopt ignores it
        except (OSError, AttributeError):
            pass


_one_malloc_arena()

# after the arena setting
from fusegen.engine import (LLM, CompletionOutput, EngineConfig, EngineConfigError,  # noqa: E402
                            EngineOptions, LLMEngine, ModelConfig, ModelLoadError,
                            RequestOutput, SamplingParams)
from fusegen.engine.sampling_params import (GuidedDecodingParams,  # noqa: E402
                                            StructuredOutputsParams)


def _version() -> str:
    """The installed distribution's version; a checkout run without installing (on
    PYTHONPATH) has no metadata and says so."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fusegen")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
__all__ = ["__version__", "LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EngineConfig", "EngineOptions", "StructuredOutputsParams", "GuidedDecodingParams",
           "ModelConfig", "ModelLoadError", "EngineConfigError"]
