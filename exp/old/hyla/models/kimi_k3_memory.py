"""Kimi K3's parameter and memory report, for the released config: parameter counts taken from a
meta-device model (no memory), checked against the config's own count, and per-GPU weights / KV /
state when attention runs tensor-parallel and the routed experts expert-parallel over d GPUs.

Released config (K3_RELEASED): the published `moonshotai/Kimi-K3` config.json's text_config (the
fields hyla reads). Seed 001 derives its KDA layer: 96 heads x 128, full-rank output gate, safe
gate -5, 443,740,416 parameters per layer, 30,618,088,704 over its 69 KDA layers.

Per GPU at degree d (TP = EP = d), bf16 weights (the fp32 ones at 4 bytes: KDA convs, dt_bias,
A_log, the router), MXFP4 routed experts, fp32 recurrent state:
- split by TP: KDA / MLA heads (q/k/v/g/o, convs, f_b, b, dt_bias, A_log's heads, the MLA
  projections after the latents), the dense MLP and the shared experts (by width), the vocabulary
  of embed_tokens and lm_head;
- replicated: norms, the attention-residual scorers, f_a_proj, A_log and the MLA down projections
  (q_a, kv_a: their outputs are shared by all heads), the router and the latent projections;
- split by EP: the routed experts, num_experts / d per GPU, each weight 4 bits + one E8M0 byte
  per 32 (MXFP4: 4.25 bits); the shared experts stay bf16 (the checkpoint does not quantise them);
- KV per token: every MLA layer's latent (kv_lora_rank + rope dims), bf16; TP does not split it;
- state per request: every KDA layer's (H / d) x K x K fp32 state + 3 conv windows (H*K / d) x 3;
- the attention-residual bank is activation memory of one step: up to ceil(layers / block)
  snapshots of the hidden state per token in flight, never cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.models.kimi_k3_config import LINEAR, KimiK3Config

_KDA = list(range(1, 94))
K3_RELEASED = {"model_type": "kimi_k3", "dtype": "bfloat16", "text_config": {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
    "intermediate_size": 33792, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "num_attention_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
    "num_experts": 896, "num_experts_per_token": 16, "moe_intermediate_size": 3072, "num_shared_experts": 2,
    "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "attn_res_block_size": 12,
    "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                           "gate_lower_bound": -5.0,
                           "full_attn_layers": [i for i in _KDA if i % 4 == 0] + [93],
                           "kda_layers": [i for i in _KDA if i % 4 and i != 93]},
    "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}}

MXFP4_BYTES_PER_WEIGHT = (4 + 8 / 32) / 8  # a nibble + one E8M0 scale byte per 32 weights
DEGREES = (8, 16, 32)


def released_config() -> KimiK3Config:
    return KimiK3Config.from_hf_dict(K3_RELEASED)


def meta_model(config: KimiK3Config | None = None):
    """The K3 model on the meta device (shapes only), experts as the checkpoint's logical weights
    (never Mxfp4Experts' packed rows, whose element count is bytes, not parameters)."""
    from hyla.models.kimi_k3 import KimiK3ForCausalLM

    with torch.device("meta"):
        return KimiK3ForCausalLM(released_config() if config is None else config, packed_experts=False)


@dataclass
class ParameterCounts:
    """Parameters by component, counted from a model's tensors (state_dict: buffers included)."""

    kda_per_layer: list[int]  # self_attn of each KDA layer
    mla_per_layer: list[int]
    routed_experts: int  # every MoE layer's experts.gate_up_proj + experts.down_proj
    total: int

    @property
    def kda(self) -> int:
        return sum(self.kda_per_layer)


def count_parameters(model) -> ParameterCounts:
    c = model.config
    kda, mla, routed, total = [], [], 0, 0
    for i, layer in enumerate(model.model.layers):
        n = sum(t.numel() for t in layer.self_attn.state_dict().values())
        (kda if c.layer_types[i] == LINEAR else mla).append(n)
        if layer.is_sparse:
            routed += sum(t.numel() for t in layer.block_sparse_moe.experts.state_dict().values())
    total = sum(t.numel() for t in model.state_dict().values())
    return ParameterCounts(kda, mla, routed, total)


@dataclass
class PerGpu:
    """One GPU of a d-GPU deployment (TP = EP = d); bytes."""

    degree: int
    experts_per_gpu: int
    dense_weight_bytes: int  # everything but the routed experts (bf16; fp32 tensors at 4 bytes)
    expert_weight_bytes: int  # this GPU's routed experts, MXFP4
    kv_bytes_per_token: int
    state_bytes_per_request: int

    @property
    def weight_bytes(self) -> int:
        return self.dense_weight_bytes + self.expert_weight_bytes


def per_gpu(config: KimiK3Config, d: int) -> PerGpu:
    """Per-GPU figures at degree d (see the module docstring for what is split and how)."""
    c, hid = config, config.hidden_size
    h, k, w = c.linear_num_heads, c.linear_head_dim, c.conv_kernel_size
    for name, n in (("linear_num_heads", h), ("num_attention_heads", c.num_attention_heads),
                    ("num_experts", c.num_experts), ("vocab_size", c.vocab_size)):
        if n % d:
            raise ValueError(f"config field `{name}` ({n}) is not divisible by the degree {d}")
    dd = h * k // d
    n_kda = sum(t == LINEAR for t in c.layer_types)
    n_mla = c.num_hidden_layers - n_kda
    # KDA: q/k/v/g/o, f_b, b split by head; f_a, o_norm replicated; fp32: the convs and dt_bias
    # split, the stored A_log [K] replicated (512 bytes)
    kda = 2 * (5 * hid * dd + k * dd + hid * h // d + hid * k + k) + 4 * (3 * dd * w + dd + k)
    hm, qk, r, ql = c.num_attention_heads // d, c.qk_head_dim, c.kv_lora_rank, c.q_lora_rank
    mla = 2 * (hid * ql + ql + ql * hm * qk + hid * (r + c.qk_rope_head_dim) + r + r * hm * (c.qk_nope_head_dim + c.v_head_dim)
               + 2 * hm * c.v_head_dim * hid)  # q_a, kv_a replicated; q_b, kv_b, o_proj, g_proj split
    lat, im = c.routed_expert_hidden_size or hid, c.moe_intermediate_size
    n_moe = sum(t == "sparse" for t in c.mlp_layer_types)
    moe = 2 * (3 * hid * im * c.num_shared_experts // d + (2 * hid * lat + lat if c.routed_expert_hidden_size else 0)) \
        + 4 * (c.num_experts * hid + c.num_experts)
    dense_mlp = 2 * 3 * hid * c.intermediate_size // d
    per_layer_common = 2 * 6 * hid  # two norms, two residual scorers (norm + proj)
    dense = (n_kda * kda + n_mla * mla + n_moe * moe + (c.num_hidden_layers - n_moe) * dense_mlp
             + c.num_hidden_layers * per_layer_common + 2 * (2 * c.vocab_size * hid // d + 3 * hid))
    experts = c.num_experts // d
    expert_bytes = round(n_moe * experts * 3 * lat * im * MXFP4_BYTES_PER_WEIGHT)
    kv = n_mla * (r + c.qk_rope_head_dim) * 2
    state = n_kda * ((h // d) * k * k * 4 + 3 * dd * (w - 1) * 2)
    return PerGpu(d, experts, dense, expert_bytes, kv, state)


@dataclass
class KimiK3MemoryReport:
    counts: ParameterCounts
    config_counts: tuple[int, int]  # KimiK3Config.parameter_counts(): (model dtype, fp32)
    gpus: list[PerGpu]
    bank_bytes_per_token: int  # activation memory of the residual bank at its fullest (bf16)

    def __str__(self) -> str:
        c, gib = self.counts, 2 ** 30
        lines = [
            f"parameters        {c.total:,} (meta-device model; config count {sum(self.config_counts):,})",
            f"KDA               {c.kda_per_layer[0]:,} per layer x {len(c.kda_per_layer)} = {c.kda:,}",
            f"MLA               {c.mla_per_layer[0]:,} per layer x {len(c.mla_per_layer)}",
            f"routed experts    {c.routed_experts:,} ({100 * c.routed_experts / c.total:.1f}%)",
            f"residual bank     {self.bank_bytes_per_token:,} B per token in flight (activations, not cache)",
            "per GPU (TP = EP = d; bf16, MXFP4 experts, fp32 state):",
        ]
        for g in self.gpus:
            lines.append(f"  d={g.degree:<3} weights {g.weight_bytes / gib:,.1f} GiB (dense {g.dense_weight_bytes / gib:,.1f} + "
                         f"{g.experts_per_gpu} experts/layer {g.expert_weight_bytes / gib:,.1f}), KV "
                         f"{g.kv_bytes_per_token:,} B/token, state {g.state_bytes_per_request / 2**20:,.2f} MiB/request")
        return "\n".join(lines)


def kimi_k3_memory_report(config: KimiK3Config | None = None, degrees: tuple[int, ...] = DEGREES) -> KimiK3MemoryReport:
    config = released_config() if config is None else config
    return KimiK3MemoryReport(
        counts=count_parameters(meta_model(config)), config_counts=config.parameter_counts(),
        gpus=[per_gpu(config, d) for d in degrees],
        bank_bytes_per_token=config.num_attn_res_blocks * config.hidden_size * 2,
    )


if __name__ == "__main__":
    print(kimi_k3_memory_report())
