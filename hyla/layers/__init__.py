"""nn.Modules of hybrid linear-attention models, built on hyla.ops."""

from hyla.layers.kda import KimiDeltaAttention
from hyla.layers.mla import MLAAttention
from hyla.layers.mlp import MLP, Expert
from hyla.layers.moe import MoE, Router
from hyla.layers.norm import GatedRMSNorm, RMSNorm

__all__ = ["KimiDeltaAttention", "MLAAttention", "MLP", "Expert", "MoE", "Router", "GatedRMSNorm", "RMSNorm"]
