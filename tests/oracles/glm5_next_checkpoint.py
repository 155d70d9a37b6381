"""Tiny random GLM-5-Next checkpoints written by transformers' `save_pretrained` (test oracle).

    path = build_glm5_next_checkpoint(tmp_path, variant="hc2")   # config.json + model.safetensors
    ref = load_reference(path)          # transformers Glm5NextForConditionalGeneration, fp32, eval

Variants (hidden 64, vocab 256, fp32; a one-block vision tower so the skip is exercised):
    hc2       6 layers K I K I I K (K = KDA, I = indexed), indexers F . F S (the 5th shares the
              4th's selection), hc_mult 2, kpool 4, top-8 (2 pools) + tail, layers 0-1 dense
    hc4       4 layers K I K I, hc_mult 4, kpool 2, top-4, q_lora 32, no tail selection
    kpool1    4 layers K I K I, hc_mult 2, kpool 1 (pools are tokens), top-6
Weights are randomised away from their init (A_log, dt_bias, norms, hc base / scale, the
indexer's pooling parameters, the router bias) with std 0.1 projections, so a wrong formula
shows; index_n_heads is large enough that all-zero (tied) pool scores are rare.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=2,
    num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
    kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
    index_head_dim=16, index_n_heads=16, linear_head_dim=16, linear_num_heads=2, rms_norm_eps=1e-5,
    initializer_range=0.1, swiglu_limit=1.5, hc_sinkhorn_iters=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
K, I = "linear_attention", "indexed_attention"
VARIANTS = {
    "hc2": dict(num_hidden_layers=6, layer_types=[K, I, K, I, I, K], indexer_types=["full"] * 4 + ["shared", "full"],
                mlp_layer_types=["dense", "dense"] + ["sparse"] * 4, hc_mult=2, index_kpool=4, index_topk=8,
                index_kpool_always_select_tail=True),
    "hc4": dict(num_hidden_layers=4, layer_types=[K, I, K, I], mlp_layer_types=["dense"] + ["sparse"] * 3,
                hc_mult=4, index_kpool=2, index_topk=4, q_lora_rank=32, index_kpool_always_select_tail=False),
    "kpool1": dict(num_hidden_layers=4, layer_types=[K, I, K, I], mlp_layer_types=["sparse"] * 4, hc_mult=2,
                   index_kpool=1, index_topk=6, index_kpool_always_select_tail=True),
}
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)


def hf_config(variant: str):
    from transformers import Glm5NextConfig

    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
    return Glm5NextConfig(text_config={**TEXT, **VARIANTS[variant]}, vision_config=VISION)


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in name:
                continue
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) - 1.0)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("k_norm.bias", "hc.base", "compress_ape")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("hc.scale"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("hc.fn"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("compress_gate"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build_glm5_next_checkpoint(root, variant: str = "hc2", seed: int = 0, with_tokenizer: bool = False) -> Path:
    """Write a tiny random checkpoint under `root`/glm5-next-<variant>-<seed> (reused if present);
    with_tokenizer: also the word-level tokenizer of tests.oracles.kimi_checkpoint."""
    from transformers import Glm5NextForConditionalGeneration

    from tests.oracles.kimi_checkpoint import write_tokenizer

    path = Path(root) / f"glm5-next-{variant}-{seed}"
    if not (path / "config.json").is_file():
        torch.manual_seed(seed)
        model = Glm5NextForConditionalGeneration(hf_config(variant)).eval()
        _randomise(model, torch.Generator().manual_seed(seed + 1))
        model.save_pretrained(path)
    if with_tokenizer and not (path / "tokenizer.json").is_file():
        write_tokenizer(path)
    return path


def load_reference(path):
    """transformers' model of a checkpoint built here (fp32, eval, no grad)."""
    from transformers import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def glm5_next_checkpoint(tmp_path_factory):
    """Factory fixture: glm5_next_checkpoint(variant="hc2", seed=0) -> path, built once per session."""
    root = tmp_path_factory.mktemp("glm5_next")
    return lambda variant="hc2", seed=0: build_glm5_next_checkpoint(root, variant, seed)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one intra-op thread: on a loaded machine, waking a second thread
    for a [m, m] softmax costs milliseconds. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
