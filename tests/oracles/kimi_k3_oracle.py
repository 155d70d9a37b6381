"""A loop oracle for Kimi K3, written from the math alone (no hyla module is used): token by
token, head by head, expert by expert, in fp64. It reads the checkpoint's tensors by their
official names, so it checks hyla's model and its loader together.

    logits = k3_oracle_logits(tensors, text_config, ids)     # ids: list[int] -> [T, V] fp64
"""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _situ(g, u, beta, lbeta):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (u if lbeta is None else lbeta * torch.tanh(u / lbeta))


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).sum() + 1e-6)


class _K3:
    def __init__(self, tensors: dict, text: dict):
        self.t, self.c = tensors, text
        self.eps = text["rms_norm_eps"]

    def w(self, name: str) -> torch.Tensor:
        return self.t[name].double()

    def kda(self, p: str, x: torch.Tensor) -> torch.Tensor:
        lac = self.c["linear_attn_config"]
        H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
        T = x.shape[0]

        def conv(name, y):  # causal depthwise conv then SiLU: out[t] = sum_j w[j] y[t - (W-1) + j]
            k = self.w(f"{p}{name}.weight")[:, 0, :]  # [D, W]
            out = torch.zeros_like(y)
            for t in range(T):
                for j in range(W):
                    s = t - (W - 1) + j
                    if s >= 0:
                        out[t] += k[:, j] * y[s]
            return torch.nn.functional.silu(out)

        q = conv("q_conv1d", x @ self.w(f"{p}q_proj.weight").T).view(T, H, K)
        k = conv("k_conv1d", x @ self.w(f"{p}k_proj.weight").T).view(T, H, K)
        v = conv("v_conv1d", x @ self.w(f"{p}v_proj.weight").T).view(T, H, K)
        f = (x @ self.w(f"{p}f_a_proj.weight").T @ self.w(f"{p}f_b_proj.weight").T).view(T, H, K)
        a_log = self.w(f"{p}A_log").reshape(-1)[:H]  # stored [K]: one value per head, the first H
        f = f + self.w(f"{p}dt_bias").view(H, K)
        g = lac["gate_lower_bound"] * torch.sigmoid(a_log.exp()[None, :, None] * f)  # [T, H, K] log-decay
        beta = torch.sigmoid(x @ self.w(f"{p}b_proj.weight").T)  # [T, H]
        o = torch.zeros(T, H, K, dtype=x.dtype)
        for h in range(H):
            S = torch.zeros(K, K, dtype=x.dtype)
            for t in range(T):
                kt, qt = _l2(k[t, h]), _l2(q[t, h])
                S = g[t, h].exp()[:, None] * S  # decay each key row
                S = S + beta[t, h] * torch.outer(kt, v[t, h] - S.T @ kt)  # write the prediction error
                o[t, h] = (S.T @ qt) * K ** -0.5
        gate = torch.sigmoid(x @ self.w(f"{p}g_proj.weight").T).view(T, H, K)
        y = _rms(o, self.w(f"{p}o_norm.weight"), self.eps) * gate
        return y.reshape(T, H * K) @ self.w(f"{p}o_proj.weight").T

    def mla(self, p: str, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        H, nope, rope, vd, r = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                c["v_head_dim"], c["kv_lora_rank"])
        T = x.shape[0]
        q = _rms(x @ self.w(f"{p}q_a_proj.weight").T, self.w(f"{p}q_a_layernorm.weight"), self.eps)
        q = (q @ self.w(f"{p}q_b_proj.weight").T).view(T, H, nope + rope)
        kv = x @ self.w(f"{p}kv_a_proj_with_mqa.weight").T
        lat = _rms(kv[:, :r], self.w(f"{p}kv_a_layernorm.weight"), self.eps)
        kpe = kv[:, r:]  # NoPE: never rotated
        kvb = (lat @ self.w(f"{p}kv_b_proj.weight").T).view(T, H, nope + vd)
        out = torch.zeros(T, H, vd, dtype=x.dtype)
        scale = (nope + rope) ** -0.5
        for h in range(H):
            keys = torch.cat([kvb[:, h, :nope], kpe], dim=-1)  # [T, nope + rope]
            for t in range(T):
                s = torch.stack([q[t, h] @ keys[j] * scale for j in range(t + 1)])
                out[t, h] = torch.softmax(s, 0) @ kvb[: t + 1, h, nope:]
        gate = torch.sigmoid(x @ self.w(f"{p}g_proj.weight").T)
        return (out.reshape(T, H * vd) * gate) @ self.w(f"{p}o_proj.weight").T

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        g, u = x @ self.w(f"{p}gate_proj.weight").T, x @ self.w(f"{p}up_proj.weight").T
        return _situ(g, u, c["activation_situ_beta"], c["activation_situ_linear_beta"]) @ self.w(f"{p}down_proj.weight").T

    def moe(self, p: str, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        E, k, G, TG = c["num_experts"], c["num_experts_per_token"], c["num_expert_group"], c["topk_group"]
        I = c["moe_intermediate_size"]
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            s = torch.sigmoid(x[t] @ self.w(f"{p}gate.weight").T)
            choice = s + self.w(f"{p}gate.e_score_correction_bias")
            groups = choice.view(G, E // G)
            group_score = groups.topk(2, dim=-1).values.sum(-1)
            allowed = torch.zeros(G, dtype=torch.bool)
            allowed[group_score.topk(TG).indices] = True
            masked = torch.where(allowed[:, None].expand(G, E // G).reshape(E), choice, torch.tensor(-math.inf))
            ids = masked.topk(k).indices
            weights = s[ids] / s[ids].sum() * c["routed_scaling_factor"]
            z = x[t] @ self.w(f"{p}routed_expert_down_proj.weight").T
            y = torch.zeros_like(z)
            for wt, e in zip(weights, ids.tolist()):
                w13, w2 = self.w(f"{p}experts.gate_up_proj")[e], self.w(f"{p}experts.down_proj")[e]
                h = _situ(w13[:I] @ z, w13[I:] @ z, c["activation_situ_beta"], c["activation_situ_linear_beta"])
                y = y + wt * (w2 @ h)
            y = _rms(y, self.w(f"{p}routed_expert_norm.weight"), self.eps)
            out[t] = y @ self.w(f"{p}routed_expert_up_proj.weight").T
        return out + self.mlp(f"{p}shared_experts.", x)


def k3_oracle_logits(tensors: dict, text: dict, ids: list[int]) -> torch.Tensor:
    """tensors: official names (stacked experts: experts.gate_up_proj [E, 2I, L] / down_proj);
    text: the text_config dict -> logits [T, V] fp64."""
    m = _K3(tensors, text)
    eps, bs, pre = text["rms_norm_eps"], text["attn_res_block_size"], "language_model.model."
    kda = {i - 1 for i in text["linear_attn_config"]["kda_layers"]}  # 1-based in the config
    bank, run = [], m.w(pre + "embed_tokens.weight")[ids]

    def mix(scorer: str) -> torch.Tensor:
        rows = bank + [run]
        direction = m.w(scorer + "_res_norm.weight") * m.w(scorer + "_res_proj.weight")[0]
        scores = torch.stack([_rms(v, None, eps) @ direction for v in rows])  # [R, T]
        p = torch.softmax(scores, dim=0)
        return sum(p[j][:, None] * rows[j] for j in range(len(rows)))

    for i in range(text["num_hidden_layers"]):
        p = f"{pre}layers.{i}."
        x = mix(p + "self_attention")
        if i % bs == 0:  # a block starts: bank the running sum, restart it
            bank, run = bank + [run], None
        x = _rms(x, m.w(p + "input_layernorm.weight"), eps)
        a = m.kda(p + "self_attn.", x) if i in kda else m.mla(p + "self_attn.", x)
        run = a if run is None else run + a
        x = _rms(mix(p + "mlp"), m.w(p + "post_attention_layernorm.weight"), eps)
        run = run + (m.mlp(p + "mlp.", x) if i < text["first_k_dense_replace"] else m.moe(p + "block_sparse_moe.", x))
    h = _rms(mix(pre + "output_attn"), m.w(pre + "norm.weight"), eps)
    return h @ m.w("language_model.lm_head.weight").T
