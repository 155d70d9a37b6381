"""HF-format models: configs, checkpoint loading, the model <-> engine API (hyla.models.base).

Families (chosen by config.json's `model_type`): Kimi-Linear ("kimi_linear") and Qwen3-Next
("qwen3_next"); `load_model` builds either. The layer contract (ForwardBatch, the layer caches)
is hyla.contract.
"""

from hyla.models.base import HybridForCausalLM
from hyla.models.config import KimiLinearConfig
from hyla.models.default import default_model_path
from hyla.models.kimi_linear import KimiLinearForCausalLM
from hyla.models.loader import load_config, load_model
from hyla.models.memory import MemoryReport, memory_report
from hyla.models.qwen3_next import Qwen3NextForCausalLM
from hyla.models.qwen3_next_config import Qwen3NextConfig
from hyla.models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "HybridForCausalLM", "KimiLinearConfig", "KimiLinearForCausalLM",
    "Qwen3NextConfig", "Qwen3NextForCausalLM", "load_config", "load_model", "MemoryReport", "memory_report",
    "Tokenizer", "load_tokenizer", "default_model_path",
]
