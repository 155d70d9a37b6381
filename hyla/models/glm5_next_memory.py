"""GLM-5-Next's memory report: what hyla.models.memory reports for every family, plus the DSA
indexer's cache, the KDA state per request at each tensor-parallel degree and, for comparison,
vLLM's page unification for this model as seed 000 derives it. Everything is computed from the
config; nothing below is a typed-in figure.

hyla's indexer cache, per token and indexed layer with a full indexer, under the MLA latents'
page ids: the token's indexer key and pooling logits (2 x index_head_dim, read until its pool of
index_kpool tokens is complete) and, per pool, one pooled key (index_head_dim); model dtype.
Shared indexer layers cache latents only.

vLLM (seed 000), at tensor-parallel degree tp:
- MLA page per token and layer: 1 latent head of kv_lora_rank + qk_rope_head_dim, bf16 (TP does
  not split it); indexer: one fp8 pooled key + a 4-byte scale per 128 channels per pool of
  index_kpool tokens; the incomplete pool's tokens sit in a per-request ring, outside the pages;
- KDA "mamba page": the state (H / tp) x K x K fp32 plus the q, k, v conv windows
  3 x (H*K / tp) x (W - 1) bf16;
- attention block size = align x cdiv(mamba page, align x MLA bytes per token) tokens (align 128
  for MLA hybrids), so that one layer's MLA block holds a whole state; the state is padded to
  that block (the padding fraction below);
- one block id holds every MLA + indexer layer's page; it fits floor(that / mamba block) KDA
  states, so the KDA layers form cdiv(#KDA, that) groups, filled round-robin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.models.memory import MemoryReport, _nbytes, memory_report
from hyla.models.presets import GLM_5_3_FLASH

def released_config():
    """The GLM-5.3-Flash-sized Glm5NextConfig (GLM_5_3_FLASH)."""
    from hyla.models.glm5_next_config import Glm5NextConfig

    return Glm5NextConfig.from_hf_dict(GLM_5_3_FLASH)


def indexer_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> int:
    """hyla's indexer cache per token over all full indexer layers (rounded up per layer)."""
    d, p = config.index_head_dim, config.index_kpool
    return len(config.indexer_layers) * -(-(2 * d * p + d) * _nbytes(dtype) // p)


def kda_state_bytes(config, tp: int = 1, state_dtype: torch.dtype = torch.float32,
                    dtype: torch.dtype = torch.bfloat16) -> int:
    """One KDA layer's state + conv windows for one request on one of `tp` ranks (heads split)."""
    h, k, w = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim - 1
    if h % tp:
        raise ValueError(f"linear_num_heads ({h}) is not divisible by the tensor-parallel degree {tp}")
    return (h // tp) * k * k * _nbytes(state_dtype) + 3 * (h // tp) * k * w * _nbytes(dtype)


@dataclass
class VllmPageUnification:
    """vLLM's hybrid page sizing for one tp degree (all sizes in bytes unless named)."""

    tp: int
    mamba_page: int  # one KDA layer's state + conv for one request
    mla_bytes_per_token: int  # one MLA layer
    indexer_bytes_per_pool: int  # one indexer layer, fp8 key + scales
    block_size: int  # tokens per attention block
    mla_block: int  # one MLA layer's block (= the padded mamba page)
    indexer_block: int  # one indexer layer's block
    kda_groups: list[int]  # KDA layers per group

    @property
    def padding(self) -> float:
        """Fraction of the padded state that is padding, relative to the state."""
        return (self.mla_block - self.mamba_page) / self.mamba_page

    def __str__(self) -> str:
        kib = 1024
        return "\n".join([
            f"vLLM page unification (TP={self.tp}): KDA state {self.mamba_page:,} B, MLA {self.mla_bytes_per_token:,} "
            f"B/token, indexer {self.indexer_bytes_per_pool} B/pool",
            f"  attention block {self.block_size} tokens; MLA block {self.mla_block:,} B "
            f"({self.mla_block / kib:,.0f} KiB), indexer block {self.indexer_block:,} B ({self.indexer_block / kib:.3f} KiB)",
            f"  state padded to the MLA block: {100 * self.padding:.2f}% padding; KDA groups {self.kda_groups}",
        ])


def vllm_page_unification(config, tp: int = 8, align: int = 128) -> VllmPageUnification:
    """Seed 000's derivation for `config` at tensor-parallel degree tp (bf16 latents, fp32 state,
    bf16 conv, fp8 indexer keys with one 4-byte scale per 128 channels)."""
    mamba = kda_state_bytes(config, tp)
    per_token = (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    per_pool = config.index_head_dim + -(-config.index_head_dim // 128) * 4
    block_size = align * -(-mamba // (align * per_token))
    mla_block = block_size * per_token
    indexer_block = block_size // config.index_kpool * per_pool
    n_mla, n_idx = len(config.attention_layers), len(config.indexer_layers)
    per_block = (n_mla * mla_block + n_idx * indexer_block) // mla_block
    kda = len(config.linear_layers)
    n_groups = -(-kda // per_block)
    groups = [len(range(g, kda, n_groups)) for g in range(n_groups)]
    return VllmPageUnification(tp, mamba, per_token, per_pool, block_size, mla_block, indexer_block, groups)


@dataclass
class Glm5NextMemoryReport:
    """hyla's figures (base: the family-agnostic report) plus the indexer and vLLM's sizing."""

    base: MemoryReport
    indexer_bytes_per_token: int
    kda_state_by_tp: dict[int, int]  # tp -> bytes of every KDA layer's state + conv per request per rank
    vllm: VllmPageUnification

    def __str__(self) -> str:
        lines = [str(self.base),
                 f"indexer / token   {self.indexer_bytes_per_token:,} B (per-token keys + pooled keys, hyla's pages)",
                 "KDA state / request / rank  " + ", ".join(
                     f"TP={tp}: {b / 2**20:,.2f} MiB" for tp, b in self.kda_state_by_tp.items()),
                 str(self.vllm)]
        return "\n".join(lines)


def glm5_next_memory_report(config=None, dtype: torch.dtype = torch.bfloat16, state_dtype: torch.dtype = torch.float32,
                            tp_degrees: tuple[int, ...] = (1, 2, 4, 8), vllm_tp: int = 8) -> Glm5NextMemoryReport:
    """The report for `config` (default: GLM-5.3-Flash's sizes)."""
    config = released_config() if config is None else config
    n_kda = len(config.linear_layers)
    return Glm5NextMemoryReport(
        base=memory_report(config, dtype, state_dtype),
        indexer_bytes_per_token=indexer_bytes_per_token(config, dtype),
        kda_state_by_tp={tp: n_kda * kda_state_bytes(config, tp, state_dtype, dtype) for tp in tp_degrees},
        vllm=vllm_page_unification(config, vllm_tp),
    )


if __name__ == "__main__":
    print(glm5_next_memory_report())
