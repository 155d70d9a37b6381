"""nn.Modules of hybrid linear-attention models, built on hyla.ops."""

from hyla.layers.attention import GatedAttention, RotaryEmbedding
from hyla.layers.delta_rule import ShortConvDeltaRule
from hyla.layers.gdn import GatedDeltaNet
from hyla.layers.kda import KimiDeltaAttention
from hyla.layers.mla import MLAAttention
from hyla.layers.mlp import MLP
from hyla.layers.moe import MoE, Router, StackedExperts
from hyla.layers.norm import GatedRMSNorm, RMSNorm, SiLUGatedRMSNorm, ZeroCentredRMSNorm
from hyla.layers.qwen_moe import Qwen3NextSparseMoE, SoftmaxRouter

__all__ = [
    "KimiDeltaAttention", "GatedDeltaNet", "ShortConvDeltaRule", "MLAAttention", "GatedAttention",
    "RotaryEmbedding", "MLP", "StackedExperts", "MoE", "Router", "Qwen3NextSparseMoE", "SoftmaxRouter", "GatedRMSNorm",
    "RMSNorm", "ZeroCentredRMSNorm", "SiLUGatedRMSNorm",
]
