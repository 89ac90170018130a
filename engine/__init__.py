"""fusegen's generation engine, usable alone from Python:

    from fusegen.engine import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0.0))
"""
from fusegen.engine.config import EngineConfig
from fusegen.engine.options import EngineOptions
from fusegen.engine.models.config import ModelConfig
from fusegen.engine.errors import EngineConfigError, ModelLoadError
from fusegen.engine.llm import LLM
from fusegen.engine.llm_engine import LLMEngine
from fusegen.engine.outputs import CompletionOutput, RequestOutput
from fusegen.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EngineConfig", "EngineOptions",
           "ModelConfig", "ModelLoadError", "EngineConfigError"]
