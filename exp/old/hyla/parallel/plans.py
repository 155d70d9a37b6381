"""Which tensor-parallel plan serves which `model_type` (imported on first use, as the loader's
FAMILIES), and the startup check that N divides what the plan splits."""

from __future__ import annotations

import importlib

from hyla.parallel.tensor import ShardPlan

PLANS = {
    "kimi_linear": "hyla.parallel.tp_kimi:KimiShardPlan",
    "kimi_k3": "hyla.parallel.tp_kimi_k3:KimiK3ShardPlan",
    "qwen3_next": "hyla.parallel.tp_qwen3_next:Qwen3NextShardPlan",
    "qwen3_5_text": "hyla.parallel.tp_qwen3_next:Qwen3NextShardPlan",
    "qwen3_5_moe_text": "hyla.parallel.tp_qwen3_next:Qwen3NextShardPlan",
    "qwen3_5": "hyla.parallel.tp_qwen3_next:Qwen3NextShardPlan",
    "qwen3_5_moe": "hyla.parallel.tp_qwen3_next:Qwen3NextShardPlan",
    "glm5_next": "hyla.parallel.tp_glm5_next:Glm5NextShardPlan",
}


def make_plan(model_type: str, rank: int, world: int, group=None, expert_parallel: bool = False) -> ShardPlan:
    """The plan of one rank; ValueError when the family has none."""
    if model_type not in PLANS:
        raise ValueError(f"tensor parallelism is not available for model_type {model_type!r} "
                         f"(supported: {sorted(PLANS)})")
    module, name = PLANS[model_type].split(":")
    return getattr(importlib.import_module(module), name)(rank, world, group, expert_parallel)


def check_parallel(config, world: int, expert_parallel: bool = False) -> None:
    """Raise ValueError (naming the config field) when `world` ranks cannot split `config`:
    run at startup, before any worker starts."""
    if world > 1:
        make_plan(config.model_type, 0, world, None, expert_parallel).configure(config)
