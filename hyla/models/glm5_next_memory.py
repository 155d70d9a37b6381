"""GLM-5-Next's memory report: what hyla.models.memory reports for every family, plus the DSA
indexer's cache and, for comparison, vLLM's page unification for this model (seed 000).

Per token and indexed layer with a full indexer, hyla pages (under the MLA latents' page ids):
the token's indexer key and pooling logits (2 x index_head_dim) and, per index_kpool tokens, one
pooled key (index_head_dim). Shared indexer layers cache latents only.
"""

from __future__ import annotations

import torch

from hyla.models.memory import _nbytes


def indexer_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of indexer cache per token over all full indexer layers (rounded up)."""
    d, p = config.index_head_dim, config.index_kpool
    per_layer = -(-(2 * d * p + d) * _nbytes(dtype) // p)
    return len(config.indexer_layers) * per_layer
