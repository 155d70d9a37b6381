"""FP8 (e4m3) attention KV pages (`kv_cache_dtype="fp8"`, vLLM's `--kv-cache-dtype fp8`): the
format, its torch definitions, and the value check.

A paged tensor of an attention layer (MLA latents [pages, page_size, C], GQA keys / values
[pages, page_size, Hkv, D]) is stored as float8_e4m3fn next to a float32 scale tensor of the
same leading shape whose last dim holds one scale per column group of a row:

    data  [..., C]  float8_e4m3fn        scale [..., G]  float32
    row value = e4m3 value x scale of its column group, the product in fp32

Scales are dynamic and per token: they are computed when a token's row is written, from that
row alone (s = max(amax of the group, 1e-10) / 448, q = x / s rounded to nearest even, clamped to
+-448: per_token_group_quant, the activation quantiser of the FP8 GEMMs, hyla.ops.fp8), so a
row never changes after it is written and copying rows (copy-on-write of a shared prefix page,
PagedLayerCache.copy_rows) copies their scales with them; no calibration, no per-tensor state.

Groups (what the scale tensor's last dim holds):

- GQA keys and values: one group per (token, KV head): scale [..., Hkv, 1]. Heads have
  unrelated magnitudes (a key head after its RMSNorm, a value head straight from v_proj), and
  a per-head scale is what the kernels read with the head's row anyway.
- MLA latents: two groups per token, the normalised compressed KV c (kv_lora_rank columns) and
  the positional part k_pe (qk_rope_head_dim columns): scale [..., 2]; one group when there is
  no positional part (GLM-5-Next's NoPE latents): [..., 1]. Why the positional part gets its
  own scale: c leaves an RMSNorm (its amax is a few times its weight), k_pe is a raw projection
  whose magnitude nothing ties to c's (DeepSeek-style k_pe carries large outliers; FlashMLA's
  FP8 layout keeps it apart for the same reason, in bf16). With one scale, the larger part sets
  the step for both and the smaller one loses its mantissa (down to e4m3's subnormals); a second
  fp32 scale costs 4 bytes per token and layer against the 64+ bytes of k_pe.

Reading: a kernel dequantises each row it loads to the step's compute dtype (the model dtype:
the queries'), (q x s) in fp32 then rounded once, and the attention then runs exactly as over a
cache in the model dtype. The rounding error of a stored value is at most 2^-4 of its
magnitude (3 mantissa bits; half an ulp), plus 2^-10 x s below e4m3's normal range.

Memory: per token and layer C bytes + 4 G (hyla.models.memory.kv_bytes_per_token).

Where: the torch ops hyla.ops.mla / hyla.ops.paged_attention (kv_scale / k_scale, v_scale), their
Triton kernels (hyla.ops.triton.kv_fp8; gated attention routed by hyla.ops.dispatch with the scales), the
layers' own torch code (hyla.layers.mla, attention, dsa), and every family's allocate_cache
(model.kv_cache_dtype, which the engine sets from EngineConfig.kv_cache_dtype). Not FP8: GLM-5-Next's
indexer rows, an MTP head's pages and a draft model's pools (model dtype).
"""

from __future__ import annotations

import torch

from hyla.ops.fp8_checks import FP8_DTYPE
from hyla.ops.fp8_quant import FP8_MAX, per_token_group_quant

__all__ = ["KV_CACHE_DTYPES", "SCALE_DTYPE", "check_kv_cache_dtype", "is_fp8_kv", "latent_groups",
           "quantize_rows", "dequantize_rows", "paged_pair", "FP8_DTYPE", "FP8_MAX"]

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # EngineConfig.kv_cache_dtype / --kv-cache-dtype
SCALE_DTYPE = torch.float32


def check_kv_cache_dtype(value, name: str = "kv_cache_dtype") -> str:
    """value if it is one of KV_CACHE_DTYPES, else a ValueError naming `name` and the accepted
    values (vLLM's "fp8_e5m2" and "fp8_inc" are not supported: hyla's FP8 is e4m3)."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"{name} must be one of {list(KV_CACHE_DTYPES)} (fp8 = fp8_e4m3: e4m3 pages with "
                         f"per-token scales), got {value!r}")
    return value


def is_fp8_kv(kv_cache_dtype: str | None) -> bool:
    """Whether a (checked) kv_cache_dtype stores FP8 pages ("auto" / None: the model dtype)."""
    return kv_cache_dtype is not None and check_kv_cache_dtype(kv_cache_dtype) != "auto"


def latent_groups(kv_lora_rank: int, rope: int) -> tuple[int, ...]:
    """An MLA latent's column groups: (c, k_pe), or (c,) without a positional part."""
    return (kv_lora_rank, rope) if rope else (kv_lora_rank,)


def quantize_rows(x: torch.Tensor, groups: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] (any float dtype), groups summing to C -> (q [..., C] e4m3, s [..., len(groups)]
    fp32): each row's groups quantised on their own (per_token_group_quant's scale and rounding)."""
    if sum(groups) != x.shape[-1]:
        raise ValueError(f"groups {groups} do not cover the {x.shape[-1]} columns")
    flat = x.reshape(-1, x.shape[-1])
    qs, ss = [], []
    for part in flat.split(list(groups), dim=-1):
        q, s = per_token_group_quant(part, group=part.shape[-1])
        qs.append(q)
        ss.append(s)
    q = qs[0] if len(qs) == 1 else torch.cat(qs, -1)
    s = ss[0] if len(ss) == 1 else torch.cat(ss, -1)
    return q.view(x.shape), s.view(*x.shape[:-1], len(groups))


def dequantize_rows(q: torch.Tensor, s: torch.Tensor, groups: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """q [..., C] e4m3, s [..., G] -> [..., C] in dtype: q x s in fp32, rounded once to dtype."""
    if len(groups) == 1:
        return (q.float() * s.float()).to(dtype)
    # per group (no host -> device copy: DSA's gather runs inside CUDA graphs)
    parts = [p.float() * s[..., i:i + 1].float() for i, p in enumerate(q.split(list(groups), dim=-1))]
    return torch.cat(parts, -1).to(dtype)


def paged_pair(shape: tuple[int, ...], groups: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed FP8 pages [*shape] and their scales [*shape[:-1], len(groups)] (fp32, zero: an
    unwritten row reads as zeros, as a zeroed page in the model dtype does)."""
    if sum(groups) != shape[-1]:
        raise ValueError(f"groups {groups} do not cover the {shape[-1]} columns of {shape}")
    return (torch.zeros(shape, dtype=FP8_DTYPE, device=device),
            torch.zeros(*shape[:-1], len(groups), dtype=SCALE_DTYPE, device=device))
