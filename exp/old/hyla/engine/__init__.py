"""hyla.engine: continuous batching over paged KV + state slots (vLLM-style API)."""

from hyla.engine.config import EngineConfig
from hyla.engine.llm import LLM
from hyla.engine.llm_engine import LLMEngine
from hyla.engine.outputs import CompletionOutput, RequestOutput
from hyla.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
