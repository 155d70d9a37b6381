"""Tiny random Kimi-Linear checkpoints written by transformers' `save_pretrained` (test oracle).

    path = build_kimi_checkpoint(tmp_path, variant="moe")      # config.json + model.safetensors
    ref = load_reference(path)                                 # transformers KimiLinearForCausalLM

Variants (all: hidden 64, 4 layers, vocab 256, fp32):
    dense       every MLP dense; 1 MLA layer (the 4th); q_lora_rank None; KDA head dim 16
    moe         layer 0 dense, MoE after (16 experts, 4 groups (2 kept), top-4, shared expert);
                2 MLA layers; q_lora_rank 24; KDA head dim 32, MLA head dims 32 / 16
    wide        MoE, 1 group; KDA head dim 64; MLA nope 64 / rope 16 / v 48
    safe_gate   "moe" with linear_attn_config.gate_lower_bound = -5 (transformers' Kimi-Linear
                ignores it, so only hyla's own references can check this one)
    full_rank_gate  "moe" with the output gate stored as one g_proj = g_b_proj @ g_a_proj (same
                function as the low-rank "moe" checkpoint, which `load_reference(..., variant)`
                therefore loads for transformers)
Gate and norm parameters are randomised away from their init (A_log, dt_bias, norm weights,
e_score_correction_bias), and weights use std 0.1 so that logits are O(1).

`with_tokenizer=True` also writes a small word-level tokenizer.json + tokenizer_config.json
(with a chat template), so engine / server tests can start from the same directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)

VARIANTS = {
    "dense": dict(
        first_k_dense_replace=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
                                full_attn_layers=[4]),
    ),
    "moe": dict(
        first_k_dense_replace=1, num_local_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.446, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24,
        kv_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        linear_attn_config=dict(head_dim=32, num_heads=2, short_conv_kernel_size=4, kda_layers=[1, 3],
                                full_attn_layers=[2, 4]),
    ),
    "wide": dict(
        first_k_dense_replace=1, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=2, n_group=1,
        topk_group=1, routed_scaling_factor=1.5, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
        kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=16, v_head_dim=48,
        linear_attn_config=dict(head_dim=64, num_heads=2, short_conv_kernel_size=4, kda_layers=[1, 2, 3],
                                full_attn_layers=[4]),
    ),
}
VARIANTS["safe_gate"] = dict(VARIANTS["moe"], linear_attn_config=dict(
    VARIANTS["moe"]["linear_attn_config"], gate_lower_bound=-5.0))
DERIVED = {"full_rank_gate": "moe"}  # variant -> the transformers-loadable variant it derives from


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Move gate / norm / router parameters away from their init so a wrong formula shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 1.0 - 1.0)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def _config(variant: str):
    from transformers import KimiLinearConfig

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(VARIANTS) + sorted(DERIVED)}")
    return KimiLinearConfig(**TINY, **VARIANTS[variant])


def build_kimi_checkpoint(root, variant: str = "moe", seed: int = 0, with_tokenizer: bool = False) -> Path:
    """Write a tiny random checkpoint under `root`/kimi-<variant>-<seed> and return its path
    (reused if it already exists)."""
    from transformers import KimiLinearForCausalLM

    path = Path(root) / f"kimi-{variant}-{seed}"
    if not (path / "config.json").is_file():
        if variant in DERIVED:
            _to_full_rank_gate(build_kimi_checkpoint(root, DERIVED[variant], seed), path)
        else:
            torch.manual_seed(seed)
            model = KimiLinearForCausalLM(_config(variant)).eval()
            _randomise(model, torch.Generator().manual_seed(seed + 1))
            model.save_pretrained(path)
    if with_tokenizer and not (path / "tokenizer.json").is_file():
        write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def kimi_checkpoint(tmp_path_factory):
    """Factory fixture: kimi_checkpoint(variant="moe", seed=0, with_tokenizer=False) -> path,
    built once per session."""
    root = tmp_path_factory.mktemp("kimi")

    def make(variant: str = "moe", seed: int = 0, with_tokenizer: bool = False) -> Path:
        return build_kimi_checkpoint(root, variant, seed, with_tokenizer)

    return make


def load_reference(path, variant: str | None = None):
    """transformers' model for a checkpoint built here (the low-rank twin for full_rank_gate)."""
    from transformers import KimiLinearForCausalLM

    path = Path(path)
    if variant in DERIVED:
        path = path.parent / path.name.replace(f"kimi-{variant}-", f"kimi-{DERIVED[variant]}-")
    return KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _to_full_rank_gate(src: Path, dst: Path) -> None:
    """Copy `src` replacing every g_a_proj / g_b_proj pair by g_proj = W_b @ W_a ([H*K, hidden])."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith("g_a_proj.weight")]:
        prefix = name[: -len("g_a_proj.weight")]
        w_a, w_b = tensors.pop(name), tensors.pop(prefix + "g_b_proj.weight")
        tensors[prefix + "g_proj.weight"] = (w_b.double() @ w_a.double()).float().contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["linear_attn_config"]["use_full_rank_gate"] = True
    (dst / "config.json").write_text(json.dumps(config, indent=2))


WORDS = "the a cat dog sat on mat and ran to big small red blue house tree sun moon is was".split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(path) -> None:
    """A word-level tokenizer.json (ids < 256) with <s> / </s> and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>",
              "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    Path(path, "tokenizer_config.json").write_text(json.dumps(config, indent=2))
