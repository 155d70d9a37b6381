"""Named model shapes: the released checkpoints' config.json values and small shapes of each
family, and models of them with random weights built straight on the device (benchmarks of the
released shapes; the engine's load_format="dummy" draws the same way, hyla.models.random_init).

    model = random_model("kimi-linear-48b-a3b", dtype=torch.bfloat16, device="cuda", layers=4)

Shapes (`RANDOM_CONFIGS`):
- `tiny`, `1b`: Kimi-Linear with dense SwiGLU MLPs (KDA : MLA 3:1), the CPU / first-GPU shapes;
- `kimi-linear-48b-a3b`: the released moonshotai/Kimi-Linear-48B-A3B-Instruct config.json
  (KIMI_LINEAR_48B, also checked in tests/models/test_kimi_config.py):
  27 layers, 20 KDA + 7 MLA at 1-based [4, 8, 12, 16, 20, 24, 27] (the released
  `linear_attn_config.full_attn_layers`; transformers 5.24's KimiLinearConfig default without that
  list would put MLA at 0-based 4, 8, ..., 24 only, 6 layers, so the list is passed explicitly),
  hidden 2304, KDA 32 heads x 128 with conv 4, NoPE MLA 32 heads, kv_lora_rank 512, qk 128 + 64,
  v 128, no q LoRA; 256 experts top-8 + 1 shared expert, moe_intermediate 1024, sigmoid noaux_tc
  routing with e_score_correction_bias, n_group = topk_group = 1, routed_scaling_factor 2.446,
  renormalised; first_k_dense_replace 1 with intermediate 9216; vocab 163840. Every value equals
  transformers 5.24's KimiLinearConfig default except the MLA schedule noted above.
- `qwen3-next-80b-a3b`: Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (as in
  tests/models/test_qwen3_next_config.py): 48 layers, full attention every 4th (36 GDN + 12),
  hidden 2048, GDN 16 key heads / 32 value heads x 128, conv 4; gated attention 16 q / 2 kv heads
  x 256, partial_rotary_factor 0.25, rope_theta 1e7; 512 experts top-10, moe_intermediate 512,
  shared expert 512 (sigmoid-gated), norm_topk_prob; every layer MoE; vocab 151936. All equal
  transformers 5.24's Qwen3NextConfig defaults except rope_theta (default 1e4) and
  intermediate_size (5120 vs 5632, unused: no dense layer).
- `qwen3-next-80b-a3b-fp8`: the same shape as Qwen's FP8 release holds it (QWEN3_NEXT_FP8_RELEASE:
  block-FP8 projections and experts; the output head, router, shared-expert gate and GDN's
  in_proj_ba in bf16). Its random weights are drawn by the loader, FP8 where the config says, as
  `load_format="dummy"` serves it; `quantization="fp8"` on `qwen3-next-80b-a3b` instead quantises
  every projection but the head (in_proj_ba then packs into the FP8 GEMM with in_proj_qkvz).
- `glm-5.3-flash`: GLM-5.3-Flash (`glm5_next`, GLM_5_3_FLASH:
  transformers 5.24's Glm5NextTextConfig defaults, the released sizes).
- `qwen3.5-35b-a3b`: Qwen/Qwen3.5-35B-A3B's text model in the causal-LM layout
  (`qwen3_5_moe_text`; transformers 5.24's Qwen3_5MoeTextConfig defaults, whose docstring names
  that checkpoint): 40 layers, full attention every 4th (30 GDN + 10), hidden 2048, GDN 16 key /
  32 value heads x 128 (separate in_proj_qkv / z / b / a), gated attention 16 q / 2 kv heads x
  256, partial_rotary_factor 0.25, mRoPE sections [11, 11, 10] (text positions: plain RoPE),
  rope_theta 1e7 (the released Qwen3.5 value; transformers' default is 1e4); 256 experts top-8,
  moe_intermediate 512, shared expert 512; every layer MoE; vocab 248320.
- `tiny-kimi-moe`, `tiny-qwen3-next-moe`: small MoE shapes of both families for CPU tests: 16
  experts top-4, both layer kinds, a dense first layer, a shared expert of the routed width (as
  in both released shapes), fp32.

`layers=N` keeps the first N layers of the schedule as they are in the full model (layer kinds,
dense / MoE MLPs). For the released shapes N >= 4 keeps at least one attention layer (Kimi:
MLA at 1-based 4; Qwen3-Next and Qwen3.5: attention at 1-based 4).

Weights: built on the meta device, cast, then materialised with `to_empty` on the target device
and filled in place (never written to disk, never zeros, never a full-size fp32 copy): every
matrix, embedding and stacked expert tensor ~ N(0, std) (std 0.02 for the released shapes), norm
weights 1 + N(0, 0.02) (zero-centred norms N(0, 0.02)), A_log and dt_bias ~ U(-1, 1), the router's
e_score_correction_bias ~ N(0, 0.02). dt_bias, A_log and the routers stay fp32, as the loader
keeps them (hyla.models.memory.FP32_TENSORS). `prepare_for_inference()` runs last.
"""

from __future__ import annotations

import copy

import torch

from hyla.models.memory import FP32_TENSORS
from hyla.models.random_init import init_random_

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (sizes and schedules).
KIMI_LINEAR_48B = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "tie_word_embeddings": False, "first_k_dense_replace": 1, "moe_renormalize": True,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "num_expert_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.446, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
    },
}

# GLM-5.3-Flash: transformers 5.24's Glm5NextTextConfig defaults are the released sizes; the
# indexer pools 4 tokens per key in the released model (seed 000: vLLM's indexer spec has
# tokens_per_state = 4, its kernels need index_kpool x 32 = 128), not the class default of 16.
GLM_5_3_FLASH = {"model_type": "glm5_next", "dtype": "bfloat16", "text_config": {
    "vocab_size": 154880, "hidden_size": 4096, "num_hidden_layers": 45, "index_kpool": 4}}

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json (sizes and schedules).
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "dtype": "bfloat16",
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
    "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
    "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_theta": 10000000, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "vocab_size": 151936,
}

# The quantization_config of Qwen's FP8 release of that model (Qwen3-Next-80B-A3B-Instruct-FP8):
# fine-grained e4m3 in 128 x 128 blocks with dynamic activation scales, every projection and
# expert FP8 except the output head, the router, the shared expert's one-row sigmoid gate and
# GDN's in_proj_ba (b and a, 2 x 32 rows), which the release keeps in bf16 (serving stacks build
# the last two as unquantised linears and split in_proj_ba from the FP8 in_proj_qkvz). Names as
# suffixes (hyla.models.fp8.skipped), the release lists them per layer.
QWEN3_NEXT_FP8_RELEASE = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba"],
}
QWEN3_NEXT_80B_FP8 = {**QWEN3_NEXT_80B, "quantization_config": QWEN3_NEXT_FP8_RELEASE}

# Qwen/Qwen3.5-35B-A3B's text_config, in the causal-LM layout (see the module docstring).
QWEN3_5_35B = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "dtype": "bfloat16",
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "attention_bias": False,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}

# Kimi-Linear shapes with dense SwiGLU MLPs: KDA : MLA 3:1 (MLA every 4th layer), NoPE MLA.
_KIMI_DENSE = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32, linear_heads=4, linear_head_dim=32),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, linear_heads=16, linear_head_dim=128),
}

_TINY_KIMI_MOE = dict(
    KIMI_LINEAR_48B, vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, num_experts=16, num_experts_per_token=4, num_shared_experts=1,
    routed_scaling_factor=2.446, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32",
    linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4, kda_layers=[1, 2, 3, 5],
                            full_attn_layers=[4]))
_TINY_KIMI_MOE.pop("head_dim")

_TINY_QWEN_MOE = dict(
    QWEN3_NEXT_80B, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, mlp_only_layers=[0], rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=4096, dtype="float32")

_K, _I = "linear_attention", "indexed_attention"
_TINY_GLM5_NEXT = {"model_type": "glm5_next", "dtype": "float32", "text_config": dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=2,
    num_key_value_heads=2, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=2,
    topk_group=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
    index_head_dim=16, index_n_heads=4, linear_head_dim=16, linear_num_heads=2, swiglu_limit=1.5,
    num_hidden_layers=5, layer_types=[_K, _K, _I, _K, _I], mlp_layer_types=["dense"] + ["sparse"] * 4,
    hc_mult=2, index_kpool=4, index_topk=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)}

# name -> (config.json dict, weight std)
RANDOM_CONFIGS = {
    "tiny": (None, 0.05),
    "1b": (None, 0.02),
    "kimi-linear-48b-a3b": (KIMI_LINEAR_48B, 0.02),
    "qwen3-next-80b-a3b": (QWEN3_NEXT_80B, 0.02),
    "qwen3-next-80b-a3b-fp8": (QWEN3_NEXT_80B_FP8, 0.02),
    "qwen3.5-35b-a3b": (QWEN3_5_35B, 0.02),
    "glm-5.3-flash": (GLM_5_3_FLASH, 0.02),
    "tiny-kimi-moe": (_TINY_KIMI_MOE, 0.1),
    "tiny-qwen3-next-moe": (_TINY_QWEN_MOE, 0.1),
    "tiny-glm5-next": (_TINY_GLM5_NEXT, 0.1),
}


def _kimi_dense_dict(name: str) -> dict:
    c = dict(_KIMI_DENSE[name])
    n = c["num_hidden_layers"]
    heads, head_dim = c.pop("linear_heads"), c.pop("linear_head_dim")
    full = [i for i in range(1, n + 1) if i % 4 == 0]  # 1-based
    return dict(c, model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], rms_norm_eps=1e-5,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, q_lora_rank=None,
                num_key_value_heads=c["num_attention_heads"], first_k_dense_replace=n,
                linear_attn_config=dict(head_dim=head_dim, num_heads=heads, short_conv_kernel_size=4,
                                        kda_layers=[i for i in range(1, n + 1) if i not in full],
                                        full_attn_layers=full))


def random_config_dict(name: str, layers: int | None = None) -> dict:
    """config.json contents of shape `name` (the keys transformers' config classes and hyla both
    read), cut to its first `layers` layers when given."""
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random config {name!r}; choose from {sorted(RANDOM_CONFIGS)}")
    base = RANDOM_CONFIGS[name][0]
    d = _kimi_dense_dict(name) if base is None else copy.deepcopy(base)
    if layers is None:
        return d
    from hyla.models.loader import family_classes

    config_cls = family_classes(d["model_type"])[0]
    n = config_cls.from_hf_dict(d).num_hidden_layers  # nested text configs and defaults included
    if not 1 <= layers <= n:
        raise ValueError(f"--layers must be in 1..{n} for {name}, got {layers}")
    return config_cls.first_layers_hf_dict(d, layers)  # each family cuts its own keys


def model_config(name: str, layers: int | None = None):
    """hyla's config object (KimiLinearConfig or Qwen3NextConfig) for shape `name`."""
    from hyla.models.loader import family_classes

    d = random_config_dict(name, layers)
    return family_classes(d["model_type"])[0].from_hf_dict(d)


def random_model(name: str, dtype=torch.float32, device="cpu", seed: int = 0, layers: int | None = None,
                 quantization: str | None = None, fp8_weights: str = "auto"):
    """Shape `name` (cut to `layers`) with random weights, built on `device` in `dtype` except the
    tensors the loader keeps in fp32. Eval mode, no gradients, prepare_for_inference() done.
    quantization "fp8", or a shape whose config carries a quantization_config (a release's FP8
    layout): block-FP8 weights drawn on the device by the loader (load_format "dummy"'s path;
    `seed` is not used there), fp8_weights as load_model's."""
    from hyla.models.loader import family_classes, load_model

    d = random_config_dict(name, layers)
    if quantization is not None or "quantization_config" in d:
        import json
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(d))
            return load_model(tmp, dtype=dtype, device=device, random_weights=True, quantization=quantization,
                              fp8_weights=fp8_weights)
    config_cls, model_cls = family_classes(d["model_type"])
    config = config_cls.from_hf_dict(d)
    with torch.device("meta"):
        model = model_cls(config)
    model.to(dtype)
    for pname, t in model.state_dict(keep_vars=True).items():
        if pname.endswith(FP32_TENSORS):
            t.data = t.data.float()
    model.to_empty(device=torch.device(device))
    if config.tie_word_embeddings:  # to_empty re-creates parameters: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    init_random_(model, RANDOM_CONFIGS[name][1], seed)
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return model
