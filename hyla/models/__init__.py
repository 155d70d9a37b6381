"""HF-format models: configs, checkpoint loading, the model <-> engine API (hyla.models.base).

Families (chosen by config.json's `model_type`): Kimi-Linear ("kimi_linear"), Qwen3-Next
("qwen3_next") and Qwen3.5 dense / MoE in the causal-LM layout ("qwen3_5_text", "qwen3_5_moe_text")
or the released multimodal one, text only ("qwen3_5", "qwen3_5_moe"), and GLM-5-Next ("glm5_next",
text only: KDA + DSA-indexed MLA, mHC, MoE) and Kimi K3 ("kimi_k3", text only: KDA + gated MLA,
block Attention Residuals, latent SiTU MoE, MXFP4 experts); `load_model` builds any.
The layer contract (ForwardBatch, the layer caches) is hyla.contract.
"""

from hyla.models.base import HybridForCausalLM
from hyla.models.config import KimiLinearConfig
from hyla.models.default import default_model_path
from hyla.models.glm5_next import Glm5NextForCausalLM
from hyla.models.glm5_next_config import Glm5NextConfig
from hyla.models.kimi_k3 import KimiK3ForCausalLM
from hyla.models.kimi_k3_config import KimiK3Config
from hyla.models.kimi_linear import KimiLinearForCausalLM
from hyla.models.loader import load_config, load_model
from hyla.models.memory import MemoryReport, memory_report
from hyla.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MultimodalForCausalLM
from hyla.models.qwen3_5_config import Qwen3_5Config, Qwen3_5MoeConfig
from hyla.models.qwen3_next import Qwen3NextForCausalLM
from hyla.models.qwen3_next_config import Qwen3NextConfig
from hyla.models.tiktoken_tokenizer import TiktokenTokenizer
from hyla.models.tokenizer import Tokenizer, load_tokenizer
from hyla.models.tokenizer_base import BaseTokenizer

__all__ = [
    "HybridForCausalLM", "KimiLinearConfig", "KimiLinearForCausalLM",
    "Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3_5Config", "Qwen3_5MoeConfig", "Qwen3_5ForCausalLM",
    "Qwen3_5MultimodalForCausalLM", "Glm5NextConfig", "Glm5NextForCausalLM", "KimiK3Config", "KimiK3ForCausalLM", "load_config", "load_model", "MemoryReport", "memory_report",
    "Tokenizer", "TiktokenTokenizer", "BaseTokenizer", "load_tokenizer", "default_model_path",
]
