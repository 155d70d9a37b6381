"""Triton MoE routing: router logits -> top-k expert ids and weights, one program per token.

Replaces the ~15 small torch ops of a router (sigmoid, bias add, group top-2, group top-k,
masks, top-k, gather, renormalise, scale) by one launch, which matters in a decode step where
each launch costs more than its arithmetic. Two rules, the same as the torch routers in
hyla.layers.moe (Kimi-Linear, DeepSeek-V3 "noaux_tc") and hyla.layers.qwen_moe (Qwen3-Next):

- SIGMOID: s = sigmoid(l), c = s + bias; with G > 1 groups, each group scored by the sum of
  its top-2 c, the best `topk_group` groups kept; the top-k experts by c, weighted by s,
  optionally renormalised, times routed_scaling_factor;
- SOFTMAX: p = softmax(l); the top-k experts by p, weighted by p, optionally renormalised.

Top-k is k rounds of argmax (ties go to the lowest expert id); the ids come out in descending
order of their score. Logits are fp32 [M, E] with E <= 1024.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyla.ops.triton import _interpreter
from hyla.ops.triton.pdl import dependent_launch_prologue, pdl_launch

_interpreter.apply()  # no-op unless TRITON_INTERPRET=1


@triton.jit
def _routing_kernel(logits, bias, shared_logit, gate_x, gate_w, weights_out, ids_out, E, H, s_gx, scale,
                    K: tl.constexpr, SHARED: tl.constexpr, GATED: tl.constexpr, GATE_DOT: tl.constexpr, BH: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr,
                    SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    dependent_launch_prologue(PDL)  # first: hyla.ops.triton.pdl
    m = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BE)
    live = o_e < E
    NEG: tl.constexpr = float("-inf")
    l = tl.load(logits + m * E + o_e, mask=live, other=NEG)  # [BE]
    if SIGMOID:
        score = tl.where(live, 1.0 / (1.0 + tl.exp(-l)), 0.0)
        choice = score
        if HAS_BIAS:
            choice = score + tl.load(bias + o_e, mask=live, other=0.0)
        choice = tl.where(live, choice, NEG)
    else:
        z = tl.exp(l - tl.max(l, 0))
        z = tl.where(live, z, 0.0)
        score = z / tl.sum(z, 0)
        choice = tl.where(live, score, NEG)
    if G > 1:  # keep the experts of the TOPK_GROUP groups with the best top-2 sums
        PER: tl.constexpr = BE // G
        cg = tl.reshape(choice, (G, PER))
        o_p = tl.arange(0, PER)
        first = tl.max(cg, 1)
        at = tl.argmax(cg, 1)
        second = tl.max(tl.where(o_p[None, :] == at[:, None], NEG, cg), 1)
        gscore = first + second  # [G]
        o_g = tl.arange(0, G)
        keep = tl.zeros((G,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, 0)
            keep = keep | (o_g == best)
            gscore = tl.where(o_g == best, NEG, gscore)
        group_of = o_e // PER
        kept = tl.sum(tl.where(group_of[:, None] == o_g[None, :], keep[None, :].to(tl.int32), 0), 1) > 0
        choice = tl.where(kept, choice, NEG)
    o_k = tl.arange(0, KP)  # KP = K rounded up to a power of two; slots >= K are not stored
    chosen = tl.zeros((KP,), dtype=tl.int32)
    w = tl.zeros((KP,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.argmax(choice, 0)
        hit = o_e == best
        chosen = tl.where(o_k == j, best, chosen)
        w = tl.where(o_k == j, tl.sum(tl.where(hit, score, 0.0), 0), w)
        choice = tl.where(hit, NEG, choice)
    if RENORM:
        if SIGMOID:
            w = w / (tl.sum(w, 0) + 1e-20)
        else:
            w = w / tl.sum(w, 0)
    OUT: tl.constexpr = K + SHARED  # row width of the outputs
    tl.store(weights_out + m * OUT + o_k, w * scale, mask=o_k < K)
    tl.store(ids_out + m * OUT + o_k, chosen.to(tl.int64), mask=o_k < K)
    if SHARED:  # slot K: the shared expert, stacked as expert E
        sw = 1.0
        if GATED:
            if GATE_DOT:  # the gate's linear here: x[m] . w in fp32, rounded to x's dtype as its output
                o_h = tl.arange(0, BH)
                dot = tl.zeros((BH,), dtype=tl.float32)
                for h0 in range(0, H, BH):
                    m_h = (h0 + o_h) < H
                    xa = tl.load(gate_x + m * s_gx + h0 + o_h, mask=m_h, other=0.0)
                    dot += xa.to(tl.float32) * tl.load(gate_w + h0 + o_h, mask=m_h, other=0.0).to(tl.float32)
                g = tl.sum(dot, 0).to(gate_x.dtype.element_ty).to(tl.float32)
            else:
                g = tl.load(shared_logit + m).to(tl.float32)
            sw = 1.0 / (1.0 + tl.exp(-g))
        tl.store(weights_out + m * OUT + K, sw)
        tl.store(ids_out + m * OUT + K, m * 0 + E)  # int64, as m


def route(logits: torch.Tensor, top_k: int, *, sigmoid: bool, bias: torch.Tensor | None = None,
          num_group: int = 1, topk_group: int = 1, renormalize: bool = True, scale: float = 1.0,
          shared: bool = False, shared_logit: torch.Tensor | None = None,
          shared_gate: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [M, E] fp32 -> (weights [M, top_k] fp32, ids [M, top_k] int64). See the module
    docstring; `supports` says which arguments this kernel takes. shared (or a shared_logit
    [M]): one more slot per token, expert id E with weight 1 (or sigmoid(shared_logit)) — a
    shared expert stacked after the routed ones. shared_gate (x [M, H], w [1, H], one dtype):
    the shared_logit as the gate's linear layer computes it (x . w, rounded to x's dtype),
    computed here: a decode step's launch of that one-row GEMV saved (Qwen3-Next's gated shared
    expert)."""
    if not supports(logits.shape[-1], top_k, num_group):
        raise ValueError(f"routing kernel: unsupported E={logits.shape[-1]}, top_k={top_k}, groups={num_group}")
    logits = logits.float().contiguous()
    M, E = logits.shape
    if shared_gate is not None:
        gx, gw = shared_gate
        if shared_logit is not None or gx.shape != (logits.shape[0], gw.numel()) or gw.dtype != gx.dtype:
            raise ValueError(f"routing kernel: shared_gate needs x [M, H] and w [1, H] of one dtype (and no "
                             f"shared_logit), got {tuple(gx.shape)} {gx.dtype} and {tuple(gw.shape)} {gw.dtype}")
        if gx.stride(-1) != 1:
            gx = gx.contiguous()
        gw = gw.reshape(-1).contiguous()
    extra = int(shared or shared_logit is not None or shared_gate is not None)
    weights = torch.empty(M, top_k + extra, dtype=torch.float32, device=logits.device)
    ids = torch.empty(M, top_k + extra, dtype=torch.int64, device=logits.device)
    if M == 0:
        return weights, ids
    BE = triton.next_power_of_2(E)
    G = num_group if num_group > 1 else 1
    gate = shared_logit.reshape(-1) if shared_logit is not None else logits
    gx, gw = (gx, gw) if shared_gate is not None else (logits, logits)  # unread without the gate
    H = gx.shape[1]
    BH = min(1024, triton.next_power_of_2(H)) if shared_gate is not None else 16  # no variant per E otherwise
    _routing_kernel[(M,)](logits, bias if bias is not None else logits, gate, gx, gw, weights, ids, E, H, gx.stride(0),
                          float(scale), K=top_k, SHARED=extra, GATED=shared_logit is not None or shared_gate is not None, GATE_DOT=shared_gate is not None,
                          BH=BH, KP=triton.next_power_of_2(top_k), BE=BE, G=G, TOPK_GROUP=topk_group, SIGMOID=sigmoid, RENORM=renormalize,
                          HAS_BIAS=bias is not None, num_warps=4 if BE <= 512 else 8, **pdl_launch(logits.device))
    return weights, ids


def supports(num_experts: int, top_k: int, num_group: int) -> bool:
    """The kernel's limits: E <= 1024, top_k <= 16, and groups (num_group > 1) only as a power
    of two dividing a power-of-two E."""
    if num_experts > 1024 or not 1 <= top_k <= 16:
        return False
    if num_group > 1:
        return num_experts & (num_experts - 1) == 0 and num_group & (num_group - 1) == 0 and num_group <= num_experts
    return True
