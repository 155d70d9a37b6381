"""FP8 block-quantised weights (hyla.models.fp8, hyla.models.fp8_loading): released-layout FP8
checkpoints written here, online quantisation, the FP8 modules on the CPU, tensor-parallel cuts.

The checkpoints: tiny Kimi-Linear and Qwen3-Next models saved by transformers at hidden 200 (two
column blocks, the second partial) and expert width 160 (two row blocks, partial), weights
N(0, 0.02) (the released models' initializer range; the oracles' 0.1 makes every sub-layer
dominate the residual stream and multiplies quantisation noise layer after layer), then rewritten
in the released FP8 layout by `write_fp8` below, the format's independent oracle (a loop over
128 x 128 blocks: s = amax / 448, q = w / s cast to e4m3; `<m>.weight_scale_inv` [ceil(out/128),
ceil(in/128)], per-expert tensors each with their own scales), with one module per family named
in modules_to_not_convert and kept in the checkpoint's dtype. Next to each, the "dequantised"
checkpoint: the same model with every FP8 weight replaced by q x s in fp32, no
quantization_config.

Tolerances. CPU loads dequantise exactly as the dequantised checkpoint holds the weights, so
their logits agree to 1e-5 (fp32; in fact bit for bit). The FP8 modules run W8A8: every
activation entering an FP8 GEMM is rounded to e4m3 per token and 128 columns (relative error up
to 2^-4 per value, ~2^-4/sqrt(3) rms), at 16-24 GEMMs in series in these 4-layer models with
random weights; measured relative L2 error of the logits 0.09 (Kimi) and 0.11 (Qwen3-Next),
asserted < 0.25. With the
activation quantisation switched off (a monkeypatched identity) the FP8 modules compute with the
dequantised weights themselves and agree to 1e-5, which pins the weights, scales, packing and
expert layout exactly.
"""

import copy
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (the Triton decode test)
from safetensors import safe_open
from safetensors.torch import save_file

from hyla.layers.fp8_linear import Fp8Linear
from hyla.layers.fp8_moe import Fp8StackedExperts
from hyla.models import load_model
from hyla.models.fp8 import block_dequantize, block_quantize, check_quantization, parse_fp8_config, skipped
from hyla.parallel.plans import make_plan

FP8_MAX = 448.0
GOOD = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
IDS = torch.tensor([[1, 17, 42, 99, 3, 250, 7, 8, 64, 11, 200], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])


# -- the format's oracle ---------------------------------------------------------------------------

def oracle_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q e4m3 [N, K], s fp32 [ceil(N/128), ceil(K/128)]), block by block."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    s = torch.empty((N + 127) // 128, (K + 127) // 128)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = blk.abs().max()
            s[i, j] = amax / FP8_MAX if amax > 0 else 1.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).clamp(-FP8_MAX, FP8_MAX).to(q.dtype)
    return q, s


def oracle_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = q.float()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= s[i, j]
    return out


def _converted(name: str, t: torch.Tensor, skip) -> bool:
    """What a released FP8 checkpoint quantises: 2-D projection weights (not embeddings, norms,
    routers, convolutions, lm_head), minus modules_to_not_convert."""
    if not name.endswith(".weight") or t.ndim != 2:
        return False
    module = name[: -len(".weight")]
    last = module.rsplit(".", 1)[-1]
    if last in ("embed_tokens", "gate", "lm_head") or "norm" in last:
        return False
    return not skipped(module, skip)


def write_fp8(src: Path, dst: Path, deq: Path, skip) -> None:
    """src (a safetensors checkpoint) -> dst in the released FP8 layout and deq, its dequantised twin."""
    fp8, plain = {}, {}
    with safe_open(src / "model.safetensors", "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if _converted(name, t, skip):
                q, s = oracle_quantize(t)
                fp8[name], fp8[name + "_scale_inv"] = q, s
                plain[name] = oracle_dequantize(q, s)
            else:
                fp8[name] = plain[name] = t
    for d, tensors in ((dst, fp8), (deq, plain)):
        d.mkdir(parents=True)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (deq / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = dict(GOOD, modules_to_not_convert=list(skip))
    (dst / "config.json").write_text(json.dumps(config))


def _kimi(path: Path, **sizes) -> None:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from tests.oracles.kimi_checkpoint import TINY, VARIANTS, _randomise

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**{**TINY, **VARIANTS["moe"], **sizes})).eval()
    _randomise(model, torch.Generator().manual_seed(1))
    model.save_pretrained(path)


def _qwen(path: Path, **sizes) -> None:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from tests.oracles.qwen3_next_checkpoint import TINY, VARIANTS, _randomise

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(**{**TINY, **VARIANTS["moe"], **sizes})
    model = Qwen3NextForCausalLM(cfg).eval()
    _randomise(model, torch.Generator().manual_seed(1))
    model.save_pretrained(path)


FAMILIES = {
    # hidden 200 and expert width 160: partial row and column blocks everywhere
    "kimi": (lambda p: _kimi(p, hidden_size=200, initializer_range=0.02, intermediate_size=256, moe_intermediate_size=160,
                             num_local_experts=8), ("lm_head", r"model\.layers\.\d+\.self_attn\.b_proj")),
    "qwen3_next": (lambda p: _qwen(p, hidden_size=200, initializer_range=0.02, intermediate_size=256, moe_intermediate_size=160,
                                   shared_expert_intermediate_size=160, num_experts=8),
                   ("lm_head", "linear_attn.in_proj_ba")),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (bf16-layout source, FP8 checkpoint, dequantised twin), built once per module."""
    root = tmp_path_factory.mktemp("fp8")
    made = {}

    def get(family: str):
        if family not in made:
            build, skip = FAMILIES[family]
            src, dst, deq = root / f"{family}-src", root / f"{family}-fp8", root / f"{family}-deq"
            build(src)
            write_fp8(src, dst, deq, skip)
            made[family] = (src, dst, deq)
        return made[family]

    return get


FP8 = {"fp8_weights": "fp8"}  # FP8 weights into FP8 modules on the CPU too (the GPU path, run by the torch ops)


def _fp8_module_names(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp8StackedExperts))}


# -- format ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("quant_method", "gptq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                                          ("weight_block_size", [64, 64]), ("weight_block_size", None),
                                          ("modules_to_not_convert", "lm_head")])
def test_bad_quantization_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        parse_fp8_config(dict(GOOD, **{field: value}))


def test_quantization_values():
    assert check_quantization(None, None) is None
    assert check_quantization("fp8", None).modules_to_not_convert == ("lm_head",)
    assert check_quantization(None, GOOD) == check_quantization("fp8", GOOD)
    with pytest.raises(ValueError, match="quantization"):
        check_quantization("int4", None)
    with pytest.raises(ValueError, match="compressed-tensors"):
        check_quantization("fp8", {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"})


def test_modules_to_not_convert_matching():
    assert skipped("model.layers.1.mlp", ["model.layers.1"]) and not skipped("model.layers.11.mlp", ["model.layers.1"])
    assert skipped("model.layers.3.mlp.gate", [r"model.layers.*.mlp.gate"])
    assert not skipped("model.layers.3.mlp.gate_proj", [r"model.layers.*.mlp.gate"])
    assert skipped("model.layers.3.linear_attn.in_proj_ba", ["in_proj_ba"]) and skipped("lm_head", ["lm_head"])


def test_block_quantize_matches_the_oracle_on_partial_blocks():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen) * torch.logspace(-3, 1, 300)  # blocks of very different ranges
    w[:128, 128:256] = 0.0  # an all-zero block: scale 1
    q, s = block_quantize(w)
    oq, os_ = oracle_quantize(w)
    assert s.shape == (2, 3) and torch.equal(s, os_) and torch.equal(q.float(), oq.float())
    assert s[0, 1] == 1.0
    back = block_dequantize(q, s)
    assert torch.equal(back, oracle_dequantize(q, s))
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; subnormals (below 2^-6 s) 2^-10 s absolute
    bound = torch.maximum(w.abs() * 2.0 ** -4, s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
                          * 2.0 ** -10)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()


# -- released FP8 checkpoints ----------------------------------------------------------------------

@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
def test_fp8_checkpoint_on_cpu_equals_the_dequantised_model(checkpoints, family):
    src, dst, deq = checkpoints(family)
    model, ref = load_model(dst), load_model(deq)
    assert not _fp8_module_names(model)  # dequantised while loading
    torch.testing.assert_close(model(IDS), ref(IDS), rtol=0, atol=1e-5)
    # the module in modules_to_not_convert is the checkpoint's tensor as it is
    skip = FAMILIES[family][1][1]
    with safe_open(dst / "model.safetensors", "pt") as f:
        kept = [n for n in f.keys() if skipped(n[: -len(".weight")], [skip]) and n.endswith(".weight")]
        assert kept and not any(n + "_scale_inv" in f.keys() for n in kept)
        sd = model.state_dict()
        for n in kept:
            assert torch.equal(sd[n.replace("block_sparse_moe", "mlp") if n not in sd else n], f.get_tensor(n))


@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
def test_fp8_modules_on_cpu(checkpoints, family, monkeypatch):
    src, dst, deq = checkpoints(family)
    model, ref = load_model(dst, **FP8), load_model(deq)
    names = _fp8_module_names(model)
    assert any(n.endswith("experts") for n in names) and any(n.endswith("down_proj") for n in names)
    assert not any(n.endswith(("kv_b_proj", "in_proj_ba", ".b_proj", "lm_head")) for n in names)
    assert model.weight_bytes() < 0.5 * ref.weight_bytes()  # 1 byte a weight + scales vs fp32
    logits, want = model(IDS), ref(IDS)
    import hyla.ops.fp8 as ops

    with monkeypatch.context() as m:
        m.setattr(ops, "per_token_group_quant",
                  lambda x, group=128: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))))
        torch.testing.assert_close(model(IDS), want, rtol=0, atol=1e-5)
    assert ((logits - want).norm() / want.norm()) < 0.25  # W8A8 noise, see the module docstring


def test_fp8_checkpoint_validated_from_headers(checkpoints, tmp_path):
    src, dst, deq = checkpoints("qwen3_next")
    config = json.loads((dst / "config.json").read_text())
    with safe_open(dst / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    scale = next(n for n in tensors if n.endswith("shared_expert.down_proj.weight_scale_inv"))

    def variant(name, change):
        d = tmp_path / name
        d.mkdir()
        t = dict(tensors)
        change(t)
        save_file(t, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(config))
        return d

    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        load_model(variant("shape", lambda t: t.__setitem__(scale, torch.ones(1, 1))))
    with pytest.raises(ValueError, match="has no .*weight_scale_inv"):
        load_model(variant("missing", lambda t: t.pop(scale)))
    weight = scale[: -len("_scale_inv")]
    with pytest.raises(ValueError, match="stored as F32"):
        load_model(variant("dtype", lambda t: t.__setitem__(weight, t[weight].float())))
    bad = dict(config, quantization_config=dict(GOOD, activation_scheme="static"))
    (dst.parent / "static").mkdir()
    (dst.parent / "static" / "config.json").write_text(json.dumps(bad))
    os.symlink(dst / "model.safetensors", dst.parent / "static" / "model.safetensors")
    with pytest.raises(ValueError, match="activation_scheme"):
        load_model(dst.parent / "static")
    with pytest.raises(ValueError, match="quantization"):
        load_model(dst, quantization="int8")


# -- online quantisation ---------------------------------------------------------------------------

def test_online_quantisation_round_trip(checkpoints):
    src, _, _ = checkpoints("qwen3_next")
    plain = load_model(src).state_dict()
    cpu = load_model(src, quantization="fp8").state_dict()  # quantised then dequantised as it loads
    model = load_model(src, quantization="fp8", **FP8)
    sd = model.state_dict()
    names = _fp8_module_names(model)
    assert "lm_head" not in names and any(n.endswith("in_proj_ba") for n in names)  # only lm_head is skipped
    for name in names:
        m = model.get_submodule(name)
        if isinstance(m, Fp8Linear):
            q, s = oracle_quantize(plain[name + ".weight"])
            assert torch.equal(sd[name + ".weight_scale_inv"], s) and torch.equal(sd[name + ".weight"].float(), q.float())
            assert torch.equal(cpu[name + ".weight"], oracle_dequantize(q, s))
        else:
            w13, w2 = m.dequantized()
            assert torch.equal(w13, cpu[name + ".gate_up_proj"]) and torch.equal(w2, cpu[name + ".down_proj"])
            q, s = oracle_quantize(plain[name + ".down_proj"][3])
            assert torch.equal(sd[name + ".down_proj_scale_inv"][3], s)
    assert torch.equal(cpu["lm_head.weight"], plain["lm_head.weight"])
    assert torch.isfinite(model(IDS)).all()


def test_dummy_fp8_weights(checkpoints):
    _, dst, _ = checkpoints("kimi")
    model = load_model(dst, random_weights=True, **FP8)
    layer = next(m for m in model.modules() if isinstance(m, Fp8StackedExperts))
    assert isinstance(layer, Fp8StackedExperts) and layer.gate_up_proj.dtype == torch.float8_e4m3fn
    w13, _ = layer.dequantized()
    assert 0.015 < w13.std() < 0.025  # N(0, 0.02) drawn in bf16, then quantised
    assert torch.isfinite(model(IDS)).all()


def _release_layout_model(family: str, tmp_path: Path, monkeypatch, device: str = "cpu"):
    """A tiny model in the FP8 layout of Qwen's releases, b and a of every GDN kept in the model
    dtype (fp32 here) beside its FP8 projections: Qwen3-Next's tiny MoE shape under
    QWEN3_NEXT_FP8_RELEASE (in_proj_ba), or a Qwen3.5 checkpoint written with in_proj_b / in_proj_a
    in modules_to_not_convert."""
    from hyla.models import presets
    from tests.oracles.qwen3_5_checkpoint import build_qwen3_5_checkpoint

    if family == "qwen3_next":
        tiny = {**presets.RANDOM_CONFIGS["tiny-qwen3-next-moe"][0],
                "quantization_config": presets.QWEN3_NEXT_FP8_RELEASE}
        monkeypatch.setitem(presets.RANDOM_CONFIGS, "tiny-release-fp8", (tiny, 0.1))
        return presets.random_model("tiny-release-fp8", device=device, **FP8)
    src, dst = build_qwen3_5_checkpoint(tmp_path / "src", "dense"), tmp_path / "fp8"
    write_fp8(Path(src), dst, tmp_path / "deq", ("lm_head", "linear_attn.in_proj_b", "linear_attn.in_proj_a"))
    return load_model(dst, device=device, **FP8)


def test_release_layout_preset_draws_qwens_fp8_layout(tmp_path, monkeypatch):
    """`qwen3-next-80b-a3b-fp8` is the 80B shape as Qwen's FP8 release holds it: random_model draws
    it through the loader, FP8 where QWEN3_NEXT_FP8_RELEASE says (checked on the tiny MoE shape
    with the same quantization_config: the 80B is too big for a CPU test)."""
    from hyla.layers.gdn import GatedDeltaNet
    from hyla.models import presets

    assert presets.random_config_dict("qwen3-next-80b-a3b-fp8") == {
        **presets.random_config_dict("qwen3-next-80b-a3b"), "quantization_config": presets.QWEN3_NEXT_FP8_RELEASE}
    assert presets.random_config_dict("qwen3-next-80b-a3b-fp8", layers=4)["quantization_config"] \
        == presets.QWEN3_NEXT_FP8_RELEASE
    model = _release_layout_model("qwen3_next", tmp_path, monkeypatch)
    names = _fp8_module_names(model)
    gdn = [n for n, m in model.named_modules() if isinstance(m, GatedDeltaNet)]
    assert gdn and all(f"{n}.in_proj_qkvz" in names and f"{n}.out_proj" in names for n in gdn)
    assert not any(n.endswith(("in_proj_ba", "shared_expert_gate", "lm_head")) for n in names)
    assert type(model.get_submodule(f"{gdn[0]}.in_proj_ba")) is torch.nn.Linear
    assert any(isinstance(m, Fp8StackedExperts) for m in model.modules())
    assert torch.isfinite(model(IDS)).all()
    plain = presets.random_model("tiny-qwen3-next-moe")  # no quantization_config: no loader, no FP8
    assert not _fp8_module_names(plain)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_release_layout_decode_projects_b_and_a_in_the_gate_kernel(family, tmp_path, monkeypatch):
    """Qwen's FP8 releases keep GDN's b and a projections in bf16 beside the FP8 ones. Under the
    Triton ops (the interpreter on the CPU) a decode step computes b and a inside the gate kernel,
    one launch a GDN layer and no GEMM over their weights; its greedy tokens and logits are those
    of the same steps with b and a from their own GEMM (dispatch.gdn_projected_gate_in_kernel
    switched off), within the fused decode tolerance of tests/layers/test_fused_layers.py."""
    from hyla.layers.gdn import GatedDeltaNet
    from hyla.ops import dispatch
    from hyla.ops import triton as hyla_triton
    from tests.oracles.paged import ToyPool
    from tests.ops.helpers import use_backend

    if not (torch.cuda.is_available() or hyla_triton.interpreting()):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 set before triton is imported")
    model = _release_layout_model(family, tmp_path, monkeypatch, "cuda" if torch.cuda.is_available() else "cpu")
    gdn = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert gdn and all(m.ba_weights() is not None for m in gdn)
    ba_storages = {m.ba_weights()[0].untyped_storage().data_ptr() for m in gdn}
    calls = {"b/a GEMM": 0, "gate kernel": 0}
    linear, kernel = torch.nn.functional.linear, hyla_triton.gdn_projected_gate_beta

    def spy_linear(x, weight, *args):
        calls["b/a GEMM"] += weight.untyped_storage().data_ptr() in ba_storages
        return linear(x, weight, *args)

    def spy_kernel(*args):
        calls["gate kernel"] += 1
        return kernel(*args)

    monkeypatch.setattr(torch.nn.functional, "linear", spy_linear)
    monkeypatch.setattr(hyla_triton, "gdn_projected_gate_beta", spy_kernel, raising=False)
    prompts = [[5, 17, 42, 99, 3], [7, 8, 9]]
    pool = ToyPool(model, num_slots=3, num_pages=16, page_size=4)
    rids = [pool.add() for _ in prompts]
    logits = pool.step(model, list(zip(rids, prompts)))  # the prefill (b and a from their GEMM)
    first = [int(logits[len(prompts[0]) - 1].argmax()), int(logits[-1].argmax())]
    use_backend(monkeypatch, "triton" if not torch.cuda.is_available() else "auto")
    steps = 1  # one decode step: the interpreter runs every layer's kernels (seconds a step)

    def decode(pool: ToyPool) -> tuple[list[list[int]], list[torch.Tensor]]:
        tokens, out = [first], []
        for _ in range(steps):
            out.append(pool.step(model, list(zip(rids, [[t] for t in tokens[-1]]))))
            tokens.append(out[-1].argmax(-1).tolist())
        return tokens, out

    calls.update({"b/a GEMM": 0, "gate kernel": 0})
    fused_tokens, fused_logits = decode(copy.deepcopy(pool))
    assert calls == {"b/a GEMM": 0, "gate kernel": steps * len(gdn)}
    monkeypatch.setattr(dispatch, "gdn_projected_gate_in_kernel", lambda *args: False)
    calls.update({"b/a GEMM": 0, "gate kernel": 0})
    tokens, want = decode(pool)
    assert calls == {"b/a GEMM": steps * len(gdn), "gate kernel": 0}
    assert fused_tokens == tokens
    for got, ref in zip(fused_logits, want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


# -- tensor parallel -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """A Qwen3-Next FP8 checkpoint whose TP=2 cuts fall on 128-row / column blocks (hidden 200:
    never cut; every split dimension 256 or 768)."""
    root = tmp_path_factory.mktemp("fp8tp")
    _qwen(root / "src", hidden_size=200, intermediate_size=256, moe_intermediate_size=256,
          shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2, linear_key_head_dim=64,
          linear_value_head_dim=64, linear_num_value_heads=4, num_attention_heads=2, num_key_value_heads=2,
          head_dim=128)
    write_fp8(root / "src", root / "fp8", root / "deq", ("lm_head", "linear_attn.in_proj_ba"))
    return root / "fp8"


@pytest.mark.parametrize("ep", [False, True], ids=["tensor", "expert"])
def test_tensor_parallel_cuts_scales_with_their_blocks(aligned, ep):
    for rank in range(2):
        ref = load_model(aligned, shard=make_plan("qwen3_next", rank, 2, None, ep), fp8_weights="dequantized").state_dict()
        model = load_model(aligned, shard=make_plan("qwen3_next", rank, 2, None, ep), **FP8)
        names = _fp8_module_names(model)
        assert any(n.endswith("o_proj") for n in names) and any(n.endswith("experts") for n in names)
        for name in names:
            m = model.get_submodule(name)
            if isinstance(m, Fp8Linear):
                assert torch.equal(m.dequantized_weight(), ref[name + ".weight"]), name
            else:
                w13, w2 = m.dequantized()
                assert torch.equal(w13, ref[name + ".gate_up_proj"]) and torch.equal(w2, ref[name + ".down_proj"])


def test_tensor_parallel_refuses_cuts_inside_a_block(checkpoints):
    _, dst, _ = checkpoints("qwen3_next")  # expert width 160: rank 1's rows start at 80
    with pytest.raises(ValueError, match="weight_block_size"):
        load_model(dst, shard=make_plan("qwen3_next", 1, 2), **FP8)


def test_weight_bytes_from_the_config(checkpoints):
    from hyla.models import load_config
    from hyla.models.fp8 import parse_fp8_config
    from hyla.models.fp8_memory import fp8_weight_bytes

    for family in ("kimi", "qwen3_next"):
        _, dst, _ = checkpoints(family)
        q = json.loads((dst / "config.json").read_text())["quantization_config"]
        model = load_model(dst, dtype=torch.bfloat16, **FP8)
        assert fp8_weight_bytes(load_config(dst), parse_fp8_config(q), torch.bfloat16) == model.weight_bytes()


def test_engine_serves_fp8_checkpoints(checkpoints):
    from hyla import LLM, SamplingParams
    from hyla.engine.config import EngineConfig

    src, dst, deq = checkpoints("qwen3_next")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [[1, 17, 42, 99, 3]]
    runs = [LLM(model=str(p), dtype="float32", quantization=q).generate(prompt, params, use_tqdm=False)
            for p, q in ((dst, None), (deq, None), (dst, "fp8"))]
    assert runs[0][0].outputs[0].token_ids == runs[1][0].outputs[0].token_ids == runs[2][0].outputs[0].token_ids
    assert LLM(model=str(src), dtype="float32", quantization="fp8").generate(prompt, params, use_tqdm=False)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=str(src), quantization="awq")


@pytest.mark.parametrize("family", ["qwen3_5", "glm5_next"])
def test_fp8_checkpoints_of_the_other_released_families(tmp_path, family, monkeypatch):
    """Qwen3.5 and GLM-5-Next release FP8 block checkpoints too: the oracles' tiny checkpoints
    rewritten in the released layout load dequantised (equal to the dequantised twin) and into
    FP8 modules, which with the activation quantisation an identity compute with exactly the
    dequantised weights (fp32 rounding; the W8A8 noise itself is measured on the Kimi and
    Qwen3-Next checkpoints above: these oracles' 0.1 init range multiplies it)."""
    import hyla.ops.fp8 as ops

    if family == "qwen3_5":
        from tests.oracles.qwen3_5_checkpoint import build_qwen3_5_checkpoint as build
        src = build(tmp_path / "src", "moe")
    else:
        from tests.oracles.glm5_next_checkpoint import build_glm5_next_checkpoint as build
        src = build(tmp_path / "src")
    dst, deq = tmp_path / "fp8", tmp_path / "deq"
    write_fp8(Path(src), dst, deq, ("lm_head",))
    ref = load_model(deq)
    ids = IDS.clamp(max=ref.config.vocab_size - 1)
    want = ref(ids)
    torch.testing.assert_close(load_model(dst)(ids), want, rtol=0, atol=1e-5)
    model = load_model(dst, **FP8)
    assert any(n.endswith("experts") for n in _fp8_module_names(model))
    monkeypatch.setattr(ops, "per_token_group_quant",
                        lambda x, group=128: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))))
    torch.testing.assert_close(model(ids), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_engine_log_states_the_weights_format(checkpoints, caplog):
    """The startup log says how the weights are held: FP8 modules counted, or the dequantised
    fallback of quantization="fp8" where the FP8 modules are off."""
    import logging

    from hyla import LLM

    src, dst, deq = checkpoints("qwen3_next")
    with caplog.at_level(logging.INFO, logger="hyla.engine"):
        LLM(model=str(dst), dtype="float32", **FP8)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert "block FP8 in" in line and "modules" in line, line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hyla.engine"):
        LLM(model=str(src), dtype="float32", quantization="fp8", fp8_weights="dequantized")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert "quantization=fp8 dequantised on this device" in line, line


def test_weight_formats_are_engine_config_fields(checkpoints):
    """fp8_weights / mxfp4_experts are EngineConfig fields and CLI flags (no environment
    switch): a bad value is a ValueError naming the field before anything loads, and the engine
    passes fp8_weights to the loader (FP8 modules on the CPU with "fp8")."""
    import argparse

    from hyla import LLM
    from hyla.cli import _add_engine_args, _engine_config
    from hyla.engine import EngineConfig

    _, dst, _ = checkpoints("qwen3_next")
    for field, value in (("fp8_weights", "half"), ("mxfp4_experts", "sometimes")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model=str(dst), **{field: value})
    with pytest.raises(ValueError, match="packed.*one device"):
        EngineConfig(model=str(dst), mxfp4_experts="packed", tensor_parallel_size=2)
    assert _fp8_module_names(LLM(model=str(dst), dtype="float32", **FP8).engine.model)
    assert not _fp8_module_names(LLM(model=str(dst), dtype="float32").engine.model)  # auto: dequantised on the CPU
    p = argparse.ArgumentParser()
    _add_engine_args(p, prefix_cache_default=True)
    c = _engine_config(p.parse_args(["--model", str(dst), "--fp8-weights", "fp8", "--mxfp4-experts", "packed"]))
    assert (c.fp8_weights, c.mxfp4_experts) == ("fp8", "packed")
    with pytest.raises(SystemExit):
        p.parse_args(["--model", str(dst), "--fp8-weights", "half"])


@pytest.mark.parametrize("family", ["kimi", "qwen3_next", "qwen3_5", "glm5_next", "kimi_k3"])
def test_every_projection_group_packs_under_online_fp8(tmp_path, family):
    """Online FP8 (`quantization="fp8"`) on every family: each group of projections over one
    input that packs in the model dtype packs in FP8 too (one GEMM, not one per part), and the
    model's logits stay those of its FP8 parts run one by one. A group the block rule silently
    left unpacked (KDA's b before g_a; Qwen3.5's 32-row b and a) cost two launches a part.
    In fp64: the packed GEMM and its parts sum in different orders, and in fp32 such a last-bit
    difference moved an activation across an e4m3 rounding boundary now and then (0.007 on 8.5%
    of Qwen3-Next's logits in one parallel run); in fp64 that needs a value within ~1e-16 of one."""
    from hyla.layers.fp8_linear import PackedFp8Linears
    from tests.oracles import (glm5_next_checkpoint, kimi_checkpoint, kimi_k3_checkpoint, qwen3_5_checkpoint,
                               qwen3_next_checkpoint)

    build = {"kimi": kimi_checkpoint.build_kimi_checkpoint, "qwen3_next": qwen3_next_checkpoint.build_qwen3_next_checkpoint,
             "qwen3_5": qwen3_5_checkpoint.build_qwen3_5_checkpoint,
             "glm5_next": glm5_next_checkpoint.build_glm5_next_checkpoint,
             "kimi_k3": kimi_k3_checkpoint.build_kimi_k3_checkpoint}[family]
    model = load_model(build(tmp_path), quantization="fp8", dtype=torch.float64, **FP8)
    groups = [m._packed for m in model.modules() if isinstance(getattr(m, "_packed", None), PackedFp8Linears)]
    assert groups and all(g.weight() is not None for g in groups), [g.sizes for g in groups if g.weight() is None]
    ids = IDS.clamp(max=model.config.vocab_size - 1)
    packed = model(ids)
    for g in groups:
        g.packed = None  # the parts one by one (what weight() None means)
    torch.testing.assert_close(packed, model(ids), rtol=0, atol=1e-5 * packed.abs().max().item())


def test_a_checkpoint_keeping_gdn_b_and_a_in_bf16_packs_each_kind(tmp_path, monkeypatch):
    """A Qwen3.5 FP8 checkpoint whose modules_to_not_convert keeps the GDN's b and a projections
    in bf16 (as released exports keep their odd-sized projections): qkv and z pack into one FP8
    GEMM, b and a into one model-dtype GEMM, and the logits stay the dequantised model's."""
    import hyla.ops.fp8 as ops
    from hyla.layers.delta_rule import MixedPackedLinears
    from tests.oracles.qwen3_5_checkpoint import build_qwen3_5_checkpoint

    src = build_qwen3_5_checkpoint(tmp_path / "src", "moe")
    dst, deq = tmp_path / "fp8", tmp_path / "deq"
    write_fp8(Path(src), dst, deq, ("lm_head", "linear_attn.in_proj_b", "linear_attn.in_proj_a"))
    model = load_model(dst, **FP8)
    packs = [m._packed for m in model.modules() if isinstance(getattr(m, "_packed", None), MixedPackedLinears)]
    assert packs and all(p.weight() is not None for p in packs)
    assert all([len(idx) for idx, _ in p.groups] == [2, 2] for p in packs)
    want = load_model(deq)(IDS.clamp(max=model.config.vocab_size - 1))
    monkeypatch.setattr(ops, "per_token_group_quant",
                        lambda x, group=128: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))))
    got = model(IDS.clamp(max=model.config.vocab_size - 1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


# Python source, the bundled model's training domain (its weights are trained, not random).
TRAINED_TEXT = '''def merge(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result


class Counter(dict):
    def __init__(self, iterable=None, **kwargs):
        super().__init__()
        self.update(iterable, **kwargs)

    def most_common(self, n=None):
        items = sorted(self.items(), key=lambda kv: kv[1], reverse=True)
        return items if n is None else items[:n]

    def update(self, iterable=None, **kwargs):
        if iterable is not None:
            for key in iterable:
                self[key] = self.get(key, 0) + 1
        for key, count in kwargs.items():
            self[key] = self.get(key, 0) + count
'''


def trained_ids() -> torch.Tensor:
    """TRAINED_TEXT through the bundled model's tokenizer: [2, 96] token ids."""
    from tokenizers import Tokenizer

    from hyla.models.default import default_model_path

    ids = Tokenizer.from_file(os.path.join(default_model_path(), "tokenizer.json")).encode(TRAINED_TEXT).ids
    assert len(ids) >= 192
    return torch.tensor([ids[:96], ids[96:192]])


def test_w8a8_error_of_the_trained_bundled_model():
    """The accuracy the quantisation issue asks for (3e-2 relative on the logits) is about trained
    weights: on the bundled model (trained on Python source), quantised online, the W8A8
    definition (fp32, every GEMM's activations rounded to e4m3 per 128 columns) against the model
    holding the same FP8 weights dequantised. Measured 2.4e-2 over 4 x 200 tokens of stdlib
    source and 2.2e-2 here, against 6e-2 to 9e-2 on the random 4-layer models above; greedy
    next tokens mostly equal (printed)."""
    from hyla.models.default import default_model_path

    path, ids = default_model_path(), trained_ids()
    w8a8 = load_model(path, dtype=torch.float32, quantization="fp8", fp8_weights="fp8")
    deq = load_model(path, dtype=torch.float32, quantization="fp8", fp8_weights="dequantized")
    with torch.no_grad():
        got, want = w8a8(ids).double(), deq(ids).double()
    err = ((got - want).norm() / want.norm()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
    print(f"  bundled model, W8A8 vs dequantised FP8 weights (fp32): rel err {err:.2e}; next tokens equal {agree:.1%}")
    assert err <= 3e-2
