"""HF-format models: config, checkpoint loading, the cache-driven forward contract."""

from hyla.models.batch import ForwardBatch
from hyla.models.cache import HybridCache, KDALayerCache, MLALayerCache
from hyla.models.config import KimiLinearConfig
from hyla.models.default import default_model_path
from hyla.models.kimi_linear import KimiLinearForCausalLM
from hyla.models.loader import load_model
from hyla.models.memory import MemoryReport, memory_report
from hyla.models.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "ForwardBatch", "HybridCache", "KDALayerCache", "MLALayerCache", "KimiLinearConfig", "KimiLinearForCausalLM",
    "load_model", "MemoryReport", "memory_report", "Tokenizer", "load_tokenizer", "default_model_path",
]
