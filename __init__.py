"""fusegen: batch offline inference for large transformer language models.

    from fusegen import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0.0))

The repository's folders install as subpackages: `fusegen.engine` (the generation
engine, usable alone), `fusegen.kernels`, `fusegen.jobs` (jobs, the CLI, the
benchmark) and `fusegen.workflows`.
"""
from fusegen.engine import (LLM, CompletionOutput, EngineConfig, EngineConfigError,
                            EngineOptions, LLMEngine, ModelConfig, ModelLoadError,
                            RequestOutput, SamplingParams)

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EngineConfig", "EngineOptions",
           "ModelConfig", "ModelLoadError", "EngineConfigError"]
