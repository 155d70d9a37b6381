"""The MXFP4 fused-MoE kernels (hyla.ops.triton.fused_moe_mxfp4; Triton's interpreter without a
GPU) against the dequantise-then-loop reference, and the packed expert holder
(hyla.models.mxfp4.Mxfp4Experts).

Weights are random bytes (every code 0..15, scales 2^-3..2^0 around 1/sqrt(K)), so every nibble
position, sign and group boundary takes part; the reference dequantises them with
hyla.models.mxfp4.dequantize_mxfp4 (the format's one definition) and runs the fp64 loop oracle.
Tolerances: fp32 activations with exact fp32 (IEEE) dots: the decoded weights are exact, so the
kernel computes the same sums in fp32 as the fp64 loop: 1e-5 relative (fp32 accumulation over
K = 64..96 terms, two GEMMs). fp16 activations (the interpreter's dots are wrong for bf16; the
GPU test checks bf16): x, h and the per-pair outputs are each rounded to fp16 (2^-11
relative) and the decoded weights are exact in fp16, so a few roundings: 5e-3. Sizes: M not a
multiple of the block, experts that get no pair, K = 96 (three scale groups, not a multiple of
BK = 64), I = 32 (one group).
"""

import pytest
import torch

from hyla.models.mxfp4 import Mxfp4Experts, dequantize_mxfp4, random_mxfp4, row_bytes
from hyla.ops.gated_act import GatedActivation
from hyla.ops.moe import moe_experts_torch
from tests.ops.helpers import use_backend
from tests.ops.triton_env import triton_module

SITU = GatedActivation("situ", beta=4.0, linear_beta=25.0)  # Kimi K3's experts
SMALL = dict(BM=16, BN=16, BK=64, GM=1, num_warps=4, num_stages=1)  # several column and K tiles


def inputs(M, H, I, E, k, seed, used=None):
    """x [M, H] fp32, MXFP4 w13 / w2 pairs, weights [M, k] fp32, ids [M, k]; `used`: only the
    first `used` experts are routed to (the rest get no pair)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=gen)
    w13, w2 = random_mxfp4(E, 2 * I, H, gen), random_mxfp4(E, H, I, gen)
    scores = torch.rand(M, used or E, generator=gen)
    ids = scores.topk(k, dim=-1).indices
    weights = torch.rand(M, k, generator=gen)
    return x, w13, w2, weights, ids


def reference(x, w13, w2, weights, ids, act):
    """The dequantise-then-loop oracle in fp64: every pair through its expert, slot order."""
    W13, W2 = dequantize_mxfp4(*w13, torch.float64), dequantize_mxfp4(*w2, torch.float64)
    I = W13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for m in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[m, j])
            gu = W13[e] @ x[m].double()
            out[m] += weights[m, j].double() * (W2[e] @ act(gu[:I], gu[I:]))
    return out


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _run(mod, dev, x, w13, w2, weights, ids, **kw):
    moved = [t.to(dev) for t in (x, *w13, *w2, weights, ids)]
    return mod.fused_moe_mxfp4(*moved, **kw).cpu()


@pytest.mark.parametrize("M,H,I,E,k,used", [(1, 64, 32, 8, 2, None), (19, 96, 64, 8, 3, 5), (40, 64, 96, 4, 2, None)])
def test_mxfp4_kernel_matches_the_dequantised_loop(M, H, I, E, k, used):
    mod, dev = triton_module("fused_moe_mxfp4")
    x, w13, w2, weights, ids = inputs(M, H, I, E, k, seed=M, used=used)
    want = reference(x, w13, w2, weights, ids, SITU)
    got = _run(mod, dev, x, w13, w2, weights, ids, config=SMALL, activation=SITU)
    assert got.shape == (M, H) and got.dtype == torch.float32
    assert rel(got, want) < 1e-5


def test_mxfp4_kernel_second_gemm_blocks_of_its_own():
    """A "down" override (fused_moe's config format): the second GEMM with other column and K
    tiles (BK = 32: one scale group a tile) computes the same."""
    mod, dev = triton_module("fused_moe_mxfp4")
    x, w13, w2, weights, ids = inputs(11, 64, 64, 4, 2, seed=9)
    want = reference(x, w13, w2, weights, ids, SITU)
    cfg = dict(SMALL, down=dict(BN=32, BK=32, GM=2))
    assert rel(_run(mod, dev, x, w13, w2, weights, ids, config=cfg, activation=SITU), want) < 1e-5


def test_mxfp4_kernel_default_config_and_swiglu():
    """The decode-size default blocks (BK = 128 > K: one masked K tile) and plain SwiGLU."""
    mod, dev = triton_module("fused_moe_mxfp4")
    x, w13, w2, weights, ids = inputs(5, 64, 32, 6, 2, seed=7)
    silu = GatedActivation()
    want = reference(x, w13, w2, weights, ids, lambda g, u: torch.nn.functional.silu(g) * u)
    assert rel(_run(mod, dev, x, w13, w2, weights, ids, activation=silu), want) < 1e-5


def test_mxfp4_kernel_fp16_within_rounding():
    mod, dev = triton_module("fused_moe_mxfp4")
    x, w13, w2, weights, ids = inputs(21, 64, 32, 4, 3, seed=3)
    x = x.half()
    want = reference(x, w13, w2, weights, ids, SITU)
    got = _run(mod, dev, x, w13, w2, weights, ids, config=SMALL, activation=SITU)
    assert got.dtype == torch.float16 and rel(got, want) < 5e-3


def test_mxfp4_kernel_nibble_order_is_the_loaders():
    """One expert whose weights are a single nonzero code: the kernel must put the low nibble
    on the even column, as dequantize_mxfp4 (and compressed-tensors / OCP MX) do."""
    mod, dev = triton_module("fused_moe_mxfp4")
    H, I = 32, 32
    packed13 = torch.zeros(1, 2 * I, H // 2, dtype=torch.uint8)
    packed13[0, :, 0] = 0x02  # column 0 = 1.0 (low nibble), column 1 = 0 (high nibble)
    scale13 = torch.full((1, 2 * I, 1), 127, dtype=torch.uint8)
    packed2 = torch.full((1, H, I // 2), 0x22, dtype=torch.uint8)
    scale2 = torch.full((1, H, 1), 127, dtype=torch.uint8)
    x = torch.zeros(1, H)
    x[0, 1] = 3.0  # only column 1 is nonzero: gate = up = 0 if the order is right
    route = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long)  # the token's one slot: expert 0
    got = _run(mod, dev, x, (packed13, scale13), (packed2, scale2), *route)
    assert torch.equal(got, torch.zeros(1, H))
    x[0, 0], x[0, 1] = 1.0, 0.0  # column 0 only: gate = up = 1, h = silu(1) * 1 per row
    got = _run(mod, dev, x, (packed13, scale13), (packed2, scale2), *route)
    torch.testing.assert_close(got, torch.full((1, H), I * float(torch.nn.functional.silu(torch.tensor(1.0)))))


def test_mxfp4_kernel_checks_its_arguments():
    mod, dev = triton_module("fused_moe_mxfp4")
    x, w13, w2, weights, ids = inputs(3, 64, 32, 2, 1, seed=1)
    with pytest.raises(ValueError, match="multiple of 32"):
        _run(mod, dev, x, w13, w2, weights, ids, config=dict(SMALL, BK=48))
    with pytest.raises(ValueError, match="gate_up"):
        _run(mod, dev, x, (w13[0], w13[1][..., :1]), w2, weights, ids)


def test_holder_runs_the_kernel_and_the_torch_path_alike(monkeypatch):
    """Mxfp4Experts: its uint8 rows hold codes then scales; forward under the kernel (HYLA_BACKEND
    =triton: the interpreter on the CPU) equals the dequantised torch grouped path."""
    _, dev = triton_module("fused_moe_mxfp4")
    x, w13, w2, weights, ids = inputs(13, 64, 32, 8, 2, seed=5, used=6)
    holder = Mxfp4Experts(8, 64, 32, SITU)
    holder.load_packed(w13, w2)
    assert holder.gate_up_proj.shape == (8, 64, row_bytes(64)) and holder.gate_up_proj.dtype == torch.uint8
    assert torch.equal(holder.w13()[1], w13[1]) and torch.equal(holder.w2()[0], w2[0])
    use_backend(monkeypatch, "torch")
    torch_out = holder(x, weights, ids)
    W13, W2 = (dequantize_mxfp4(*w, torch.float32) for w in (w13, w2))
    assert torch.equal(torch_out, moe_experts_torch(x, W13, W2, weights, ids, SITU))
    use_backend(monkeypatch, "triton" if dev == "cpu" else "auto")
    holder.to(dev)
    kernel_out = holder(x.to(dev), weights.to(dev), ids.to(dev)).cpu()
    assert rel(kernel_out, torch_out) < 1e-5


def test_holder_memory_is_about_a_quarter_of_bf16():
    """4 bits a weight + one scale byte per 32 weights = 4.25 bits: 17/64 of bf16's 16 bits."""
    E, H, I = 8, 256, 128
    holder = Mxfp4Experts(E, H, I, SITU)
    packed = sum(b.numel() * b.element_size() for b in holder.buffers())
    bf16 = 2 * (E * 2 * I * H + E * H * I)
    assert packed == bf16 * 17 // 64
    assert 0.25 < packed / bf16 < 0.27


def write_k3_checkpoints(root) -> tuple:
    """(a tiny K3 checkpoint with MXFP4 experts, the same with the dequantised experts as .weight)
    under `root` (also used by tests/gpu/test_triton_kernels.py)."""
    from tests.models.test_kimi_k3_mxfp4 import pack_experts
    from tests.oracles.kimi_k3_checkpoint import config_dict, per_expert, random_state, write_checkpoint

    config = config_dict()
    packed, plain = pack_experts(per_expert(random_state(config, 4)))
    quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    mx = write_checkpoint(root / "mxfp4", {**config, "quantization_config": quant}, packed, with_tokenizer=False)
    return mx, write_checkpoint(root / "plain", config, plain, with_tokenizer=False)


@pytest.fixture(scope="module")
def k3_checkpoints(tmp_path_factory):
    return write_k3_checkpoints(tmp_path_factory.mktemp("k3-packed"))


def test_k3_loads_mxfp4_experts_packed(k3_checkpoints, monkeypatch):
    """mxfp4_experts="packed": the loader fills Mxfp4Experts straight from the checkpoint's
    bytes (no dequantised copy), kept packed on the CPU; the model equals the dequantised one
    (the torch path dequantises exactly, so bit for bit in fp32)."""
    from hyla.models import load_model

    mx, plain = k3_checkpoints
    model = load_model(mx, dtype=torch.float32, mxfp4_experts="packed")
    experts = model.model.layers[1].block_sparse_moe.experts
    assert isinstance(experts, Mxfp4Experts) and experts.gate_up_proj.dtype == torch.uint8
    assert experts.gate_up_proj.shape == (8, 64, row_bytes(32)) and experts.down_proj.shape == (8, 32, row_bytes(32))
    ref = load_model(plain, dtype=torch.float32)
    w13 = ref.model.layers[1].block_sparse_moe.experts.gate_up_proj
    assert torch.equal(experts.dequantized(torch.float32)[0], w13)
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))


def test_k3_packed_at_load_is_dequantised_off_cuda(k3_checkpoints, monkeypatch):
    """auto on a machine with CUDA, model loaded to the CPU: packed while loading, dequantised
    once by prepare_for_inference into SituExperts equal to the plain checkpoint's."""
    from hyla.layers.situ import SituExperts
    from hyla.models import load_model

    mx, plain = k3_checkpoints
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = load_model(mx, dtype=torch.float32, device="cpu")
    experts = model.model.layers[1].block_sparse_moe.experts
    assert type(experts) is SituExperts
    ref = load_model(plain, dtype=torch.float32).model.layers[1].block_sparse_moe.experts
    assert torch.equal(experts.gate_up_proj, ref.gate_up_proj) and torch.equal(experts.down_proj, ref.down_proj)
    with pytest.raises(ValueError, match="mxfp4_experts"):
        load_model(mx, mxfp4_experts="sometimes")


def test_k3_mxfp4_experts_converted_to_fp8(k3_checkpoints, monkeypatch):
    """mxfp4_experts="fp8": packed at load, then block FP8 (Fp8StackedExperts, SiTU) whose
    weights are the MXFP4 ones exactly (power-of-two block scales; these exponents span 3
    binades). With the activation quantisation an identity the model equals the dequantised one
    to fp32 rounding; with it, W8A8 noise (tests/models/test_fp8.py's docstring)."""
    import hyla.ops.fp8 as ops
    from hyla.layers.fp8_moe import Fp8StackedExperts
    from hyla.models import load_model

    mx, plain = k3_checkpoints
    model = load_model(mx, dtype=torch.float32, mxfp4_experts="fp8")
    ref = load_model(plain, dtype=torch.float32)
    experts = model.model.layers[1].block_sparse_moe.experts
    assert isinstance(experts, Fp8StackedExperts) and experts.activation.kind == "situ"
    want = ref.model.layers[1].block_sparse_moe.experts
    w13, w2 = experts.dequantized(torch.float32)
    assert torch.equal(w13, want.gate_up_proj) and torch.equal(w2, want.down_proj)
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids)
        assert rel(model(ids), expected) < 0.25
        monkeypatch.setattr(ops, "per_token_group_quant",
                            lambda x, group=128: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))))
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)
