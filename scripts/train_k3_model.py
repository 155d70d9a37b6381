"""Train a small Kimi K3-shaped model with hyla: the seed's "lightweight K3" made real, on Python.

What it is: a `kimi_k3` checkpoint with K3's layer mix at the bundled Kimi-Linear model's size:
KDA with the full-rank output gate and the safe gate (lower bound -5), NoPE MLA with q LoRA and
the output gate (3 KDA : 1 MLA), block Attention Residuals (blocks of 2 layers: 4 snapshots),
a dense SiTU first layer, then latent MoE with SiTU experts (sigmoid router with
e_score_correction_bias, top-2 of 8 experts in a 128-wide latent space, one shared expert on the
full hidden state, the latent norm). Same corpus, tokenizer, schedule and loop as the bundled
model (scripts/train_default_model.py, whose `train` takes this script's recipe), so the two
training_info.json loss logs (steps 100 ... 800) compare directly.

Model (`model_config`): hidden 256, 8 layers (MLA at 1-based 4 and 8), KDA 4 heads x 64, MLA 4
heads (q_lora 128, kv_lora 128, qk 64 + 32, v 64), dense MLP 384 (layer 0), routed experts 8 x
(latent 128 -> 48), a shared expert of width 48, vocab 4096, untied embeddings: 6,998,400
parameters (the bundled model: 6,994,328), 6.22M of them active per token (2 of 8 experts).
Weights are bf16 in the checkpoint (the loader keeps the KDA convs in fp32, as K3's); the
experts are plain stacked tensors (experts.gate_up_proj / down_proj), not MXFP4.

Training forward (`TrainableSituExperts`): hyla's latent MoE as it is, except the routed experts,
whose inference path (sorted grouped GEMMs, or a gathered [pairs, 2I, L] bmm for fp32 on CUDA:
gigabytes at 32K tokens) is replaced by every expert on every token weighted by the routing
weights scattered to a dense [tokens, experts] matrix (plain differentiable einsums, no host
sync; the same function, the same tensor names). The router's weights get their gradient
through the routing weights; its `e_score_correction_bias` (a buffer, used only to choose
experts) is trained as DeepSeek-V3's auxiliary-loss-free balancing does: after each step every
layer's bias moves by BIAS_RATE towards equal load (+ for underloaded experts, - for overloaded).

    python scripts/train_k3_model.py --data .default_model_data --device cuda \\
        --steps 800 --time-budget 200 --out OUT/k3_model
    python scripts/train_k3_model.py --smoke --out /tmp/smoke_k3      # CI size, CPU, seconds
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_default_model as base  # noqa: E402  (the shared corpus, loop and checkpoint writer)

from hyla.layers.latent_moe import LatentMoE  # noqa: E402
from hyla.layers.situ import SituExperts, situ_mul  # noqa: E402
from hyla.models.kimi_k3 import KimiK3ForCausalLM  # noqa: E402
from hyla.models.kimi_k3_config import KimiK3Config  # noqa: E402

DEFAULT_OUT = base.ROOT / "out" / "k3_model"  # not bundled (git-ignored): the comparison's checkpoint
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed (gamma)
# The K3 parts beyond the shared preset (base.PRESETS): expert count, top-k, latent width, the
# routed / shared expert width, the attention-residual block size.
K3 = {"default": dict(experts=8, top_k=2, latent=128, expert_mlp=48, q_lora=128, block=2),
      "smoke": dict(experts=4, top_k=2, latent=32, expert_mlp=32, q_lora=32, block=2)}


def model_config(preset: dict, k3: dict, vocab_size: int, eot_id: int) -> dict:
    """config.json for hyla's Kimi K3 (official key names; the model under `text_config`)."""
    n = 4 * preset["blocks"]
    full = [4 * b + 4 for b in range(preset["blocks"])]  # 1-based: every 4th layer is MLA
    kda = [i for i in range(1, n + 1) if i not in full]
    heads, head_dim = preset["heads"], preset["head_dim"]
    text = {
        "model_type": "kimi_linear", "vocab_size": vocab_size, "hidden_size": preset["hidden"],
        "num_hidden_layers": n, "intermediate_size": preset["mlp"], "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id,
        "layer_types": ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)],
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full, "num_heads": heads, "head_dim": head_dim,
                               "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        "num_attention_heads": heads, "q_lora_rank": k3["q_lora"], "kv_lora_rank": preset["kv_lora"],
        "qk_nope_head_dim": head_dim, "qk_rope_head_dim": preset["rope"], "v_head_dim": head_dim,
        "mla_use_nope": True, "mla_use_output_gate": True, "attention_bias": False,
        "first_k_dense_replace": 1, "num_experts": k3["experts"], "num_experts_per_token": k3["top_k"],
        "moe_intermediate_size": k3["expert_mlp"], "num_shared_experts": 1, "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "routed_expert_hidden_size": k3["latent"],
        "latent_moe_use_norm": True, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": k3["block"],
    }
    return ConfigJson(architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3", dtype="bfloat16",
                      text_config=text)


class ConfigJson(dict):
    """config.json contents. base.train reads `layer_types`, `hidden_size` and
    `intermediate_size` at the top level, where a kimi_k3 config has only `text_config`: a
    missing key is looked up there (json.dumps writes only the real contents)."""

    def __missing__(self, key: str):
        return self["text_config"][key]


class TrainableSituExperts(SituExperts):
    """SituExperts (same tensors, same function) with a forward for training: every expert on
    every row, combined with the routing weights scattered into a dense [M, E] matrix (zero for
    the experts a row did not choose, so they get no gradient from it). At 8 experts of this
    size the E / k = 4x extra FLOPs are cheap, and it is plain differentiable einsums with no
    gather, sort or host sync. Keeps the pairs per expert of the last call (`load`, on the
    device) for the router's bias update. forward(x [M, L], weights [M, k], ids [M, k]) -> [M, L]."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, shared: bool = False) -> torch.Tensor:
        I = self.down_proj.shape[2]
        gu = torch.einsum("ml,enl->men", x, self.gate_up_proj)  # [M, E, 2I]
        h = situ_mul(gu[..., :I], gu[..., I:], self.beta, self.linear_beta)  # [M, E, I]
        y = torch.einsum("mei,eli->mel", h, self.down_proj)  # [M, E, L]
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, ids, weights)  # [M, E] routing weights, 0 where not chosen
        with torch.no_grad():  # pairs per expert, on the device (bincount would read back its size)
            flat = ids.reshape(-1)
            ones = torch.ones_like(flat, dtype=torch.float32)
            self.load = torch.zeros(self.num_experts, device=x.device).scatter_add_(0, flat, ones)
        return (y * dense[..., None].to(y.dtype)).sum(1)


class K3Trainable(KimiK3ForCausalLM):
    """The K3 model with TrainableSituExperts in every latent MoE block (state_dict unchanged)."""

    def __init__(self, config: KimiK3Config):
        super().__init__(config, packed_experts=False)
        for module in self.modules():
            if isinstance(module, LatentMoE):
                e = module.experts
                width, inter = e.gate_up_proj.shape[2], e.down_proj.shape[2]
                module.experts = TrainableSituExperts(e.num_experts, width, inter, e.beta, e.linear_beta)

    @torch.no_grad()
    def balance_routers(self, rate: float = BIAS_RATE) -> None:
        """Auxiliary-loss-free balancing: bias_e += rate * sign(mean load - load_e), per layer."""
        for module in self.modules():
            if isinstance(module, LatentMoE) and getattr(module.experts, "load", None) is not None:
                load = module.experts.load.float()
                module.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def init_weights(model: K3Trainable, seed: int) -> None:
    """base.init_weights's rules (normal 0.02, output projections / sqrt(2L), FLA's A_log and
    dt_bias); the stacked experts per expert matrix (o_proj-like down_proj scaled the same way);
    the attention-residual scorers' projections at zero (a uniform mix at the start, as K3's
    pseudo-queries begin)."""
    base.init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.zero_()
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif name.endswith("experts.down_proj"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02 / (2 * n_layers) ** 0.5)


class K3Recipe:
    """base.train's recipe for the small K3 model (see the module docstring)."""

    def __init__(self, smoke: bool = False):
        self.k3 = K3["smoke" if smoke else "default"]

    def config(self, preset: dict, vocab_size: int, eot_id: int) -> dict:
        return model_config(preset, self.k3, vocab_size, eot_id)

    def build(self, config: dict) -> K3Trainable:
        return K3Trainable(KimiK3Config.from_hf_dict(config))

    def init(self, model: K3Trainable, seed: int) -> None:
        init_weights(model, seed)

    def loss(self, model: K3Trainable, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss, parts = base.next_token_loss(model, w)
        if model.training:  # the routing of this batch is decided; the bias only steers the next
            model.balance_routers()
        return loss, parts


def main(argv: list[str] | None = None) -> dict | None:
    smoke = "--smoke" in (sys.argv[1:] if argv is None else argv)
    return base.main(argv, recipe=K3Recipe(smoke), default_out=DEFAULT_OUT)


if __name__ == "__main__":
    main()
