"""Train hyla's second bundled model: a small Qwen3.5 with a multi-token-prediction head, on Python.

What it is: a `qwen3_5_text` checkpoint (Gated DeltaNet : gated attention 3:1, dense SwiGLU
MLPs, zero-centred RMSNorms, partial RoPE) whose `mtp.*` head (fc over the normed next-token
embedding and hidden state, one full-attention decoder layer, norm; hyla.models.qwen3_5_mtp) is
trained jointly, so that `speculative_config={"method": "mtp", ...}` drafts with a head that has
learnt the model's own next-next tokens. Same corpus, tokenizer, schedule and loop as the bundled
Kimi-Linear model (scripts/train_default_model.py, whose `train` takes this script's recipe).

Objective: L = CE(next token) + MTP_WEIGHT * CE(token after next), the second from the head at
position t fed the model's final-norm hidden state h_t and the embedding of token t + 1 (the
gradient flows into the model through h_t, as in DeepSeek-V3's and Qwen's MTP training). The
validation loss (checkpoint choice) is the plain next-token loss, as for the Kimi model.

Model (`model_config`): hidden 256, 8 layers = (3 GDN + 1 attention) x 2, GDN 4 key / 4 value
heads x 64, attention 4 query / 2 KV heads x 64 (rotary on a quarter of each head), dense MLP
640 (the GDN layers have fewer parameters than KDA's: this keeps the size near the Kimi model's),
vocab 4096, untied embeddings; the MTP layer a full-attention decoder layer of the same shape.

    python scripts/train_default_model.py --data .default_model_data --prepare-only   # corpus + tokenizer
    python scripts/train_mtp_model.py --data .default_model_data --device cuda --steps 519
        # the shipped hyla/assets/mtp_model ("qwen3.5-mtp"): 103 s on one H200, val loss 3.436
    python scripts/train_mtp_model.py --smoke --out /tmp/smoke_mtp      # CI size, CPU, seconds
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_default_model as base  # noqa: E402  (the shared corpus, loop and checkpoint writer)

from hyla.layers.norm import ZeroCentredRMSNorm  # noqa: E402
from hyla.models.qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForCausalLM  # noqa: E402
from hyla.models.qwen3_5_config import Qwen3_5Config  # noqa: E402
from hyla.models.qwen3_5_mtp import MTPHead  # noqa: E402

MTP_WEIGHT = 0.3
DEFAULT_OUT = base.ROOT / "hyla" / "assets" / "mtp_model"


class Qwen3_5WithMTP(Qwen3_5ForCausalLM):
    """The trainable pair: the model and its `mtp` head, so that `state_dict()` holds exactly the
    checkpoint's tensor names (model.*, lm_head.*, mtp.*). forward = the model's logits."""

    def __init__(self, config: Qwen3_5Config):
        super().__init__(config)
        self.mtp = MTPHead(config, Qwen3_5DecoderLayer, num_layers=1, moe=False)

    def losses(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w: [B, T + 1] windows -> (next-token CE, token-after-next CE from the head)."""
        ids = w[:, :-1]
        hidden = self.model.forward_layers(self.model.embed_tokens(ids))  # [B, T, hidden] final-norm
        main = F.cross_entropy(self.compute_logits(hidden).flatten(0, 1), w[:, 1:].flatten())
        head = self.mtp(hidden[:, :-1], w[:, 1:-1], self)  # position t: h_t and token t + 1 -> token t + 2
        mtp = F.cross_entropy(self.compute_logits(head).flatten(0, 1), w[:, 2:].flatten())
        return main, mtp


def _mrope_sections(pairs: int) -> list[int]:
    """mRoPE's (time, height, width) split of the rotary frequency pairs, Qwen3.5's 2:1:1 shape
    (text positions use one stream for all three, so only the sum matters for this model)."""
    return [pairs - 2 * (pairs // 4), pairs // 4, pairs // 4]


def model_config(preset: dict, vocab_size: int, eot_id: int) -> dict:
    """config.json for transformers' Qwen3_5TextConfig and hyla (official key names)."""
    n = 4 * preset["blocks"]
    heads, head_dim = preset["heads"], preset["head_dim"]
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": preset["hidden"], "intermediate_size": int(preset["mlp"] * 5 / 3),
        "num_hidden_layers": n, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "initializer_range": 0.02, "bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id,
        "max_position_embeddings": 32768,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        "linear_num_key_heads": heads, "linear_num_value_heads": heads, "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim, "linear_conv_kernel_dim": 4,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": head_dim,
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": _mrope_sections(head_dim // 8), "mrope_interleaved": True},
        "mtp_num_hidden_layers": 1,
    }


def init_weights(model: Qwen3_5WithMTP, seed: int) -> None:
    """base.init_weights's rules (normal 0.02, output projections / sqrt(2L), FLA's A_log and
    dt_bias), with the zero-centred norms (applied as 1 + w) at w = 0."""
    base.init_weights(model, seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ZeroCentredRMSNorm):
                module.weight.zero_()


class MTPRecipe:
    """base.train's recipe for the Qwen3.5 + MTP model (see the module docstring)."""

    def config(self, preset: dict, vocab_size: int, eot_id: int) -> dict:
        return model_config(preset, vocab_size, eot_id)

    def build(self, config: dict) -> Qwen3_5WithMTP:
        return Qwen3_5WithMTP(Qwen3_5Config.from_hf_dict(config))

    def init(self, model: Qwen3_5WithMTP, seed: int) -> None:
        init_weights(model, seed)

    def loss(self, model: Qwen3_5WithMTP, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        main, mtp = model.losses(w)
        return main + MTP_WEIGHT * mtp, {"next": main.item(), "mtp": mtp.item()}


def main(argv: list[str] | None = None) -> dict | None:
    return base.main(argv, recipe=MTPRecipe(), default_out=DEFAULT_OUT)


if __name__ == "__main__":
    main()
