"""fusegen's generation engine, usable alone from Python:

    from engine import LLM, SamplingParams
    llm = LLM("path/to/checkpoint")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=64, temperature=0.0))
"""
from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineConfigError, ModelLoadError
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "EngineConfig",
           "ModelConfig", "ModelLoadError", "EngineConfigError"]
