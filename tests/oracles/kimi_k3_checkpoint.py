"""Tiny random Kimi K3 checkpoints (transformers has no K3 class: hyla's own model writes them,
with the official tensor names; the test oracle is tests.oracles.kimi_k3_oracle).

    path = build_kimi_k3_checkpoint(tmp_path)   # config.json + model.safetensors (+ tokenizer)

The model (hidden 64, vocab 256, fp32): 5 layers K K M K M (1-based kda_layers [1, 2, 4],
full_attn_layers [3, 5]), attention-residual blocks of 2 layers (3 snapshots: layers 0, 2, 4),
layer 0 dense, then latent MoE (8 experts in 2 groups, top-2, latent 32, shared expert, latent
norm); KDA 2 heads x 16 with the full-rank gate and the safe gate (-5), A_log stored [16]; MLA
2 heads, q_lora 24, kv_lora 32, nope 16 + "rope" 8, v 16, output gate. Weights are pushed away
from their init (A_log, dt_bias, norms, residual scorers, router bias) so a wrong formula shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TEXT = dict(
    model_type="kimi_linear", vocab_size=256, hidden_size=64, num_hidden_layers=5, intermediate_size=96,
    rms_norm_eps=1e-5, tie_word_embeddings=False, num_attention_heads=2, q_lora_rank=24, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True, mla_use_output_gate=True,
    moe_intermediate_size=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=2,
    topk_group=1, moe_renormalize=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
    routed_expert_hidden_size=32, latent_moe_use_norm=True, hidden_act="situ", activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0, attn_res_block_size=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    linear_attn_config=dict(kda_layers=[1, 2, 4], full_attn_layers=[3, 5], num_heads=2, head_dim=16,
                            short_conv_kernel_size=4, use_full_rank_gate=True, gate_lower_bound=-5.0),
)


def config_dict(**text_overrides) -> dict:
    """The kimi_k3 config.json contents (text_config updated with `text_overrides`)."""
    return {"model_type": "kimi_k3", "dtype": "float32", "text_config": {**TEXT, **text_overrides}}


def random_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under the official names for a kimi_k3 `config` (a config_dict)."""
    from hyla.models.kimi_k3 import KimiK3ForCausalLM
    from hyla.models.kimi_k3_config import KimiK3Config

    torch.manual_seed(seed)
    model = KimiK3ForCausalLM(KimiK3Config.from_hf_dict(config))
    gen = torch.Generator().manual_seed(seed + 1)
    state = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone().float()
        if name.endswith("A_log"):
            t = torch.empty_like(t).uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("dt_bias"):
            t = torch.randn(t.shape, generator=gen) - 1.0
        elif name.endswith(("norm.weight", "layernorm.weight")):
            t = 1.0 + 0.3 * torch.randn(t.shape, generator=gen)
        elif name.endswith("res_proj.weight"):
            t = 0.5 * torch.randn(t.shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            t = 0.1 * torch.randn(t.shape, generator=gen)
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            t = 0.3 * torch.randn(t.shape, generator=gen)
        state[name] = t.contiguous()
    return state


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stacked experts split into the released per-expert names experts.{e}.w1/w3/w2.weight."""
    out = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}{e}.w1.weight"], out[f"{base}{e}.w3.weight"] = gate.contiguous(), up.contiguous()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e, w in enumerate(t):
                out[f"{base}{e}.w2.weight"] = w.contiguous()
        else:
            out[name] = t
    return out


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor], with_tokenizer: bool = True) -> Path:
    from tests.oracles.kimi_checkpoint import write_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if with_tokenizer:
        write_tokenizer(path)
    return path


def build_kimi_k3_checkpoint(root, seed: int = 0) -> Path:
    """Write (or reuse) root/kimi-k3-<seed>: the released per-expert layout."""
    path = Path(root) / f"kimi-k3-{seed}"
    if not (path / "config.json").is_file():
        config = config_dict()
        write_checkpoint(path, config, per_expert(random_state(config, seed)))
    return path
