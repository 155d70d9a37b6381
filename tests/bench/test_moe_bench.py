"""The MoE benchmark's arithmetic and shapes, and its decode / prefill / MoE-block tables on the CPU."""

import math

import pytest
import torch

from hyla.bench import floor
from hyla.bench.random_models import model_config, random_config_dict, random_model
from hyla.bench.throughput import main


def test_expected_distinct_experts():
    assert floor.expected_distinct_experts(256, 8, 0) == 0
    assert floor.expected_distinct_experts(256, 8, 1) == pytest.approx(8)  # one token: its k experts
    assert floor.expected_distinct_experts(256, 8, 2) == pytest.approx(8 + 8 * (1 - 8 / 256))
    assert floor.expected_distinct_experts(256, 8, 256) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 256))
    assert floor.expected_distinct_experts(512, 10, 10_000) == pytest.approx(512)
    # Monte Carlo: uniform top-k (k distinct of E per token)
    gen = torch.Generator().manual_seed(0)
    E, k, b = 64, 4, 16
    touched = [torch.rand(b, E, generator=gen).topk(k).indices.unique().numel() for _ in range(2000)]
    assert sum(touched) / len(touched) == pytest.approx(floor.expected_distinct_experts(E, k, b), rel=0.01)
    with pytest.raises(ValueError):
        floor.expected_distinct_experts(8, 9, 1)


@pytest.mark.parametrize("name", ["tiny-kimi-moe", "tiny-qwen3-next-moe"])
def test_step_bytes_of_a_moe_model(name):
    model = random_model(name)
    c = model.config
    H, inter, E = c.hidden_size, c.moe_intermediate_size, c.num_experts
    layers = floor.moe_layers(model)
    assert len(layers) == c.mlp_layer_types.count("sparse")
    assert all(layer["expert_bytes"] == 3 * H * inter * 4 for layer in layers)  # fp32 gate, up, down
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    routed = len(layers) * E * 3 * H * inter * 4
    emb = c.vocab_size * H * 4
    for b, ctx in ((1, 0), (4, 100)):
        got = floor.step_bytes(model, b, ctx)
        assert got["weights"] == total - routed - emb + b * H * 4
        want = len(layers) * floor.expected_distinct_experts(E, floor.top_k_of(c), b) * 3 * H * inter * 4
        assert got["experts"] == pytest.approx(want)
        assert got["state"] == 2 * b * model.state_bytes_per_slot()
        assert got["kv"] == b * (ctx + 2) * model.kv_bytes_per_token()
        assert got["logits"] == b * c.vocab_size * 4
    shared = layers[0]["other_bytes"]
    assert floor.moe_block_bytes(model, layers[0], 1) == pytest.approx(
        floor.top_k_of(c) * layers[0]["expert_bytes"] + shared + 2 * H * 4)


def test_released_shapes_and_cuts():
    kimi = model_config("kimi-linear-48b-a3b")
    assert kimi.num_hidden_layers == 27 and kimi.mla_layers == [3, 7, 11, 15, 19, 23, 26]
    assert (kimi.hidden_size, kimi.linear_num_heads, kimi.linear_head_dim, kimi.num_attention_heads) == (
        2304, 32, 128, 32)
    assert (kimi.num_experts, kimi.num_experts_per_token, kimi.num_shared_experts, kimi.moe_intermediate_size) == (
        256, 8, 1, 1024)
    assert kimi.routed_scaling_factor == 2.446 and kimi.mlp_layer_types[:2] == ["dense", "sparse"]
    assert kimi.intermediate_size == 9216 and kimi.vocab_size == 163840 and kimi.kv_lora_rank == 512
    cut = model_config("kimi-linear-48b-a3b", layers=4)
    assert cut.layer_types == kimi.layer_types[:4] and cut.mla_layers == [3]
    assert cut.mlp_layer_types == kimi.mlp_layer_types[:4]
    qwen = model_config("qwen3-next-80b-a3b")
    assert len(qwen.linear_layers) == 36 and qwen.attention_layers == list(range(3, 48, 4))
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size,
            qwen.shared_expert_intermediate_size) == (512, 10, 512, 512)
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads, qwen.num_attention_heads,
            qwen.num_key_value_heads, qwen.head_dim, qwen.partial_rotary_factor) == (16, 32, 16, 2, 256, 0.25)
    cut = model_config("qwen3-next-80b-a3b", layers=8)
    assert cut.layer_types == qwen.layer_types[:8] and cut.attention_layers == [3, 7]
    with pytest.raises(ValueError):
        random_config_dict("kimi-linear-48b-a3b", layers=28)


def test_transformers_configs_of_the_released_shapes_agree():
    """transformers 5.24's config classes read the same dicts into the same shapes (on meta: free)."""
    from transformers import AutoConfig

    for name in ("kimi-linear-48b-a3b", "qwen3-next-80b-a3b"):
        d = random_config_dict(name)
        ours = model_config(name)
        skip = ("architectures", "model_type", "dtype", "head_dim") if name.startswith("kimi") else (
            "architectures", "model_type", "dtype")
        theirs = AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k not in skip})
        assert theirs.layer_types == ours.layer_types
        if name.startswith("kimi"):
            assert theirs.mlp_layer_types == ours.mlp_layer_types
        for attr in ("hidden_size", "vocab_size", "num_experts", "moe_intermediate_size", "num_attention_heads"):
            assert getattr(theirs, attr) == getattr(ours, attr), attr


def test_random_weights_are_never_zero_and_keep_fp32_tensors():
    model = random_model("tiny-kimi-moe", dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        assert t.float().abs().sum() > 0, name
        fp32 = name.endswith(("A_log", "dt_bias", ".gate.weight", "e_score_correction_bias"))
        assert t.dtype == (torch.float32 if fp32 else torch.bfloat16), name


def test_decode_prefill_and_moe_block_tables_on_cpu(capsys):
    res = main(["--random-config", "tiny-kimi-moe", "--device", "cpu", "--mode", "decode", "--vs", "transformers",
                "--batch-sizes", "2", "--context-lens", "5", "9", "--steps", "1", "--hf-repeat", "1",
                "--prefill-tokens", "24", "--prefill-chunk", "16", "--prefill-repeat", "1", "--moe-layer",
                "--moe-tokens", "4", "--moe-repeat", "1"])
    rows = res["decode"]
    assert [(r["batch"], r["context"]) for r in rows] == [(2, 5), (2, 9)]
    for r in rows:
        assert math.isnan(r["graph_ms"])  # no CUDA graphs on the CPU
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("eager_ms", "floor_ms", "hf_ms", "hf_over_hyla"))
    (pre,) = res["prefill"]
    assert pre["tokens"] == 24 and pre["chunk"] == 16 and pre["hf_ms"] > 0
    assert pre["floor_ms"] > 0 and pre["x_floor"] == pre["hyla_ms"] / pre["floor_ms"]
    (moe,) = res["moe_layer"]
    assert 1 <= moe["experts_touched"] <= 16 and moe["floor_ms"] > 0 and moe["hf_ms"] > 0
    out = capsys.readouterr().out
    assert "transf./hyla" in out and "hyla/transf." in out and "MoE block model.layers.1.block_sparse_moe" in out


def test_decode_table_with_fp8_weights(capsys, monkeypatch):
    """--quantization fp8 draws the random shape's weights in block FP8 (the FP8 modules, as on
    CUDA): the floor then counts about half the bf16 weight bytes."""
    monkeypatch.setattr(floor, "copy_bandwidth", lambda *a, **k: 1e10)  # the two floors over one bandwidth
    args = ["--random-config", "tiny-qwen3-next-moe", "--device", "cpu", "--mode", "decode", "--dtype", "bfloat16",
            "--batch-sizes", "1", "--context-lens", "5", "--steps", "1"]
    fp8, bf16 = main(args + ["--quantization", "fp8"])["decode"], main(args)["decode"]
    assert math.isfinite(fp8[0]["eager_ms"]) and 0.4 < fp8[0]["floor_ms"] / bf16[0]["floor_ms"] < 0.75
    with pytest.raises(SystemExit):
        main(["--random-config", "tiny", "--mode", "offline", "--quantization", "fp8"])


def test_step_bytes_of_the_released_kimi_shape_on_meta():
    """The full 48B shape's floor accounting, for free on the meta device: 26 MoE layers x 8
    experts at batch 1, x E(1 - (1 - 8/256)^256) at batch 256; bf16 experts of 3 x 2304 x 1024."""
    from hyla.models.kimi_linear import KimiLinearForCausalLM

    with torch.device("meta"):
        model = KimiLinearForCausalLM(model_config("kimi-linear-48b-a3b")).to(torch.bfloat16)
    expert = 3 * 2304 * 1024 * 2
    layers = floor.moe_layers(model)
    assert len(layers) == 26 and all(layer["expert_bytes"] == expert for layer in layers)
    one = floor.step_bytes(model, 1, 512)
    assert one["experts"] == pytest.approx(26 * 8 * expert)
    full = floor.step_bytes(model, 256, 512)
    assert full["experts"] == pytest.approx(26 * 256 * (1 - (1 - 8 / 256) ** 256) * expert)
    assert full["weights"] - one["weights"] == 255 * 2304 * 2  # only the embedding rows grow
    assert full["kv"] == 256 * 514 * 7 * 576 * 2


def test_prefill_flops_count_a_tokens_weights_and_attention():
    """tiny-kimi-moe by hand: every projection, norm-free weight and shared expert once, the routed
    experts at top_k / E, 2 FLOPs a weight a token; MLA's causal attention T^2 x heads x (key +
    value width); the embedding and lm_head not at all."""
    from hyla.layers.mla import MLAAttention

    model = random_model("tiny-kimi-moe", dtype=torch.float32, device="cpu")
    c = model.config
    share = floor.top_k_of(c) / c.num_experts
    want = 0.0
    for name, t in model.state_dict().items():
        if t.dim() >= 2 and "embed_tokens" not in name and not name.startswith("lm_head"):
            want += t.numel() * (share if floor.is_routed_expert(name) else 1.0)
    mla = [m for m in model.modules() if isinstance(m, MLAAttention)]
    f = floor.prefill_flops(model, 10)
    assert f["per_token_params"] == want and f["matmul"] == 2 * want * 10
    assert f["attention"] == sum(100 * m.num_heads * (m.nope + m.rope + m.v_dim) for m in mla) > 0
    assert floor.prefill_flops(model, 20)["attention"] == 4 * f["attention"]
