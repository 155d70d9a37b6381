"""Memory of one tensor-parallel rank, for any TP degree, from the config alone.

The rank's model is built on the meta device exactly as a worker builds it (the family's plan:
per-rank config, vocab-parallel embedding / head, expert-parallel stacks), so its tensor bytes
are what a rank loads, with no formula per family to keep in step; state per request and KV per
token come from the per-rank config (hyla.models.memory).

    for n, report in rank_memory_reports(config, (1, 2, 4, 8)): print(n, report)
"""

from __future__ import annotations

import torch

from hyla.models import memory


def rank_memory_report(config, world: int, dtype: torch.dtype = torch.bfloat16,
                       state_dtype: torch.dtype = torch.float32, expert_parallel: bool = False) -> memory.MemoryReport:
    """One rank's MemoryReport at tensor_parallel_size=`world` (world 1: the whole model).
    Raises ValueError naming the config field `world` does not divide."""
    from hyla.models.loader import family_classes
    from hyla.parallel.plans import make_plan

    if world == 1:
        return memory.memory_report(config, dtype, state_dtype)
    plan = make_plan(config.model_type, 0, world, None, expert_parallel)
    local = plan.configure(config)
    model_cls = family_classes(config.model_type)[1]
    # tensors the loader keeps in fp32: the common ones and the family's own (Kimi K3's short convs)
    fp32_names = tuple(memory.FP32_TENSORS) + tuple(getattr(model_cls, "fp32_tensors", ()))
    with torch.device("meta"):
        model = model_cls(local)
        plan.prepare(model)
    seen = {}
    for name, t in model.state_dict(keep_vars=True).items():
        fp32 = name.endswith(fp32_names)
        seen[id(t)] = t.numel() * (4 if fp32 else memory._nbytes(dtype))
    return memory.memory_report(local, dtype, state_dtype, weight_bytes=sum(seen.values()))


def rank_memory_reports(config, degrees=(1, 2, 4, 8), dtype: torch.dtype = torch.bfloat16,
                        state_dtype: torch.dtype = torch.float32, expert_parallel: bool = False):
    """[(degree, MemoryReport or the ValueError text when it does not divide)] per degree."""
    out = []
    for n in degrees:
        try:
            out.append((n, rank_memory_report(config, n, dtype, state_dtype, expert_parallel)))
        except ValueError as e:
            out.append((n, str(e)))
    return out


def format_tp_section(config, degrees=(1, 2, 4, 8), dtype: torch.dtype = torch.bfloat16,
                      state_dtype: torch.dtype = torch.float32, expert_parallel: bool = False) -> str:
    """The per-rank lines of a memory report: weights, state per request, KV per token."""
    lines = [f"per rank ({'expert' if expert_parallel else 'tensor'} parallel)"]
    for n, r in rank_memory_reports(config, degrees, dtype, state_dtype, expert_parallel):
        if isinstance(r, str):
            lines.append(f"  TP={n}: {r}")
        else:
            lines.append(f"  TP={n}: weights {r.weight_bytes / 2**30:,.2f} GiB, state / request "
                         f"{r.state_bytes_per_request / 2**20:,.2f} MiB, KV / token {r.kv_bytes_per_token:,} B")
    return "\n".join(lines)


def tensor_parallel_section(config, dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32,
                            degrees: tuple[int, ...] = (1, 2, 4, 8), expert_parallel: bool = False) -> str:
    """Per-rank weights, state per request and KV per token at each tensor-parallel degree, as
    text (one rank's model built on the meta device, as a worker builds it)."""
    return format_tp_section(config, degrees, dtype, state_dtype, expert_parallel)
