"""GLM-5-Next's tensor-parallel plan: Kimi-Linear's (hyla.parallel.tp_kimi), whose KDA, MLA and
MoE modules it shares, with GLM's field names.

Per rank: KDA heads split (A_log is [H] here, split like the rest); the DSA-MLA heads split
(q_b_proj, kv_b_proj, o_proj) with the latent projections replicated; the DSA indexer (its
projections, norm and pooled-key compression) and the mHC hyper-connection parameters
replicated, so every rank selects the same keys and mixes the same streams: exact, at the cost
of the indexer's compute and cache on every rank. MLPs / experts (clamped SwiGLU) as Kimi's.
"""

from __future__ import annotations

from hyla.parallel.tp_kimi import KimiShardPlan


class Glm5NextShardPlan(KimiShardPlan):
    shared_field = "n_shared_experts"
