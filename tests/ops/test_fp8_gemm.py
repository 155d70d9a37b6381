"""Block-FP8 kernels (hyla.ops.triton.fp8_gemm, hyla.ops.triton.fused_moe_fp8; Triton's interpreter
without a GPU) against the torch definitions (hyla.ops.fp8), and the FP8 modules
(hyla.layers.fp8_linear, hyla.layers.fp8_moe).

Shapes are awkward on purpose: K = 200 and 130 (a partial last group / block), N = 72 and 300
(partial row blocks, tiles crossing block boundaries), M not a multiple of the row tile, experts
that get no pair, I = 160 (two activation groups of h, the second partial).

Tolerances. Activation quantisation is compared bit for bit (the kernel rounds in fp32 arithmetic
exactly as torch's cast does). The GEMM: the e4m3 products are exact in fp32 and the per-group
scaling is the same two fp32 multiplies, so kernel and reference differ only in the fp32
summation order: 1e-5 relative to the output's scale. The fused MoE adds one discontinuity: h is
re-quantised to e4m3 after the first GEMM, and a gate/up sum that lands within fp32 rounding of an
e4m3 rounding boundary can round the other way, one code one ulp (1/8 relative) apart, which
moves an output by that h value times one w2 weight: 1e-4 of the output scale covers it (seen
up to 4e-5). On Hopper GPUs the FP8 tensor cores (wgmma, the kernels' row tiles of >= 64) add a
K step's products in an accumulator of about 14 significant bits before the kernel moves the
128-deep block's sum into fp32 with its scales (DeepSeek-V3 technical report, section 3.3.2, on
the same hardware), so there a block's sum may be off by 2^-13 of the sum of its products'
magnitudes: the GEMM bound adds that per output (`assert_gemm_close`), the fused MoE adds 16 times
it of the output scale (the magnitude sum of I = 160 random-sign products is ~sqrt(pi I / 2) = 16
times their sum, and more e4m3 ties of h flip). The W8A8 reference itself is checked against the exact product: each activation
moves by at most 2^-4 of itself (3 mantissa bits) or 2^-10 of its group scale (subnormals).
"""

import functools

import pytest
import torch

from hyla.layers.delta_rule import PackedLinears
from hyla.layers.fp8_linear import PackedFp8Linears, quantized_like
from hyla.layers.fp8_moe import Fp8StackedExperts
from hyla.layers.mlp import MLP
from hyla.ops.fp8 import (block_dequantize, block_quantize, fp8_scale, fp8_linear_torch, fp8_moe_experts_torch,
                          per_token_group_quant, quantize_gate_up)
from hyla.ops.gated_act import GatedActivation
from tests.ops.helpers import use_backend
from tests.ops.triton_env import triton_module


def mma_rel(dev) -> float:
    """Summation error of dev's FP8 matrix units relative to the products' magnitudes (docstring)."""
    if torch.device(dev).type == "cuda" and torch.cuda.get_device_capability(dev)[0] == 9:
        return 2.0 ** -13
    return 0.0


def assert_gemm_close(out, ref, x, w, s, dev, msg=None):
    """|out - ref| within fp32 summation order (1e-5 of the output scale) plus the device's FP8
    accumulator error over |x| @ |W|^T (x quantised moves by <= 2^-4 of itself: 1.07)."""
    bound = 1e-5 * ref.abs().max() + mma_rel(dev) * 1.07 * (x.abs() @ block_dequantize(w, s).abs().T)
    err = (out - ref).abs()
    assert bool((err <= bound).all()), f"{msg or ''} max error {err.max().item():.3g}, over the bound by " \
        f"{(err - bound).max().item():.3g}"


def _x(M, K, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * torch.logspace(-2, 1, K)  # groups of different ranges
    x[0, :3] = torch.tensor([1.0625, 17.0, 2.0 ** -12])  # ties and a subnormal after scaling
    if M > 2:
        x[2] = 0.0  # an all-zero row: tiny scale, zero codes
    return x.to(dtype)


def _w(N, K, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return block_quantize(torch.randn(N, K, generator=gen) / K ** 0.5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_scales_are_amax_over_448_correctly_rounded(device):
    """fp8_scale on any device equals amax / 448 rounded once from fp64 (no double-rounding risk:
    a quotient by 7 * 2^6 never lands on an fp32 midpoint unless exact), so the torch definitions
    and the Triton kernels (div_rn) quantise alike on CUDA too; the amaxes include bf16 values
    whose quotient is exact (3.0625 / 448 = 7 / 1024), where a reciprocal product is an ulp off."""
    gen = torch.Generator().manual_seed(0)
    amax = torch.cat([torch.rand(4096, generator=gen) * 8, torch.randn(4096, generator=gen).abs().bfloat16().float(),
                      torch.tensor([3.0625, 448.0, 1e-10])])
    want = (amax.double() / 448).float()
    assert torch.equal(fp8_scale(amax.to(device)).cpu(), want)
    _, s = per_token_group_quant(amax.view(1, -1).to(device))
    assert s.device.type == device


@pytest.mark.parametrize("M, K", [(1, 64), (5, 200), (33, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_quant_kernel_is_bitwise_torch(M, K, dtype):
    mod, dev = triton_module("fp8_gemm")
    x = _x(M, K, dtype=dtype)
    q, s = mod.per_token_group_quant(x.to(dev))
    rq, rs = per_token_group_quant(x)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().float(), rq.float())  # -0.0 == 0.0: the sign of zero may differ


@pytest.mark.parametrize("M, N, K, bias", [(3, 72, 200, False), (17, 300, 130, True), (70, 128, 256, True)])
def test_gemm_kernel_matches_the_reference(M, N, K, bias):
    mod, dev = triton_module("fp8_gemm")
    x = _x(M, K)
    w, s = _w(N, K)
    b = torch.randn(N) if bias else None
    ref = fp8_linear_torch(x, w, s, b)
    for config in (None, dict(BM=16, BN=32, GM=2, num_warps=4, num_stages=1)):  # tiles inside a block
        out = mod.fp8_linear(x.to(dev), w.to(dev), s.to(dev), None if b is None else b.to(dev), config=config).cpu()
        assert_gemm_close(out, ref, x, w, s, dev, str(config))


def test_reference_is_within_activation_rounding_of_the_exact_product():
    x = _x(9, 200)
    w, s = _w(72, 200)
    W = block_dequantize(w, s, torch.float64)
    exact = x.double() @ W.T
    got = fp8_linear_torch(x.double(), w, s)
    _, xs = per_token_group_quant(x)
    err_bound = (x.double().abs() * 2.0 ** -4 + xs.double().repeat_interleave(128, 1)[:, :200] * 2.0 ** -10) @ W.abs().T
    assert ((got - exact).abs() <= err_bound * (1 + 1e-9)).all()
    assert (got - exact).abs().max() > 0  # activations are quantised: not the plain product


def _experts(E, H, I, seed=2):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    return (*quantize_gate_up(w13), *block_quantize(w2))


@pytest.mark.parametrize("M, H, I, E, k, used", [(1, 200, 160, 6, 3, None), (5, 200, 160, 6, 2, 4), (33, 130, 72, 4, 3, None)])
@pytest.mark.parametrize("act", [GatedActivation(), GatedActivation("clamped_silu", limit=0.7),
                                 GatedActivation("situ", beta=4.0, linear_beta=25.0)], ids=["silu", "clamped", "situ"])
def test_fused_moe_kernel_matches_the_reference(M, H, I, E, k, used, act):
    mod, dev = triton_module("fused_moe_fp8")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(M, H, generator=gen)
    w13, s13, w2, s2 = _experts(E, H, I)
    ids = torch.rand(M, used or E, generator=gen).topk(k, dim=-1).indices  # experts past `used` get no pair
    weights = torch.rand(M, k, generator=gen)
    ref = fp8_moe_experts_torch(x, w13, s13, w2, s2, weights, ids, act)
    on = [t.to(dev) for t in (x, w13, s13, w2, s2, weights, ids)]
    out = mod.fused_moe_fp8(*on, activation=act).cpu()
    torch.testing.assert_close(out, ref, rtol=0, atol=(1e-4 + 16 * mma_rel(dev)) * ref.abs().max().item())


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's keyword arguments, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


# A decode-sized block configuration without KSPLIT: the single-pass gate/up GEMM as before split-K.
_DECODE_BLOCKS = dict(BM=16, BN=128, BK=128, GM=1, num_warps=4, num_stages=3, down=dict(BN=64))


@pytest.mark.parametrize("M, k, E", [(1, 3, 6), (3, 2, 5), (17, 4, 6)])
@pytest.mark.parametrize("act", [GatedActivation(), GatedActivation("situ", beta=4.0, linear_beta=25.0)],
                         ids=["silu", "situ"])
def test_split_k_gate_up_matches_the_reference_and_the_single_pass(monkeypatch, M, k, E, act):
    """KSPLIT = s > 1: s programs per tile each sum a share of H's K groups, `_split_k_finish_kernel`
    adds the shares and quantises h. H = 520 (5 groups, the last partial), I = 200 (two groups of
    h, the second partial); s = 2, 3 (uneven shares) and 5 (one group each).

    Each is within the reference's tolerance of the definition. Against KSPLIT = 1 the gate / up
    sums are the same fp32 products (the same tiles, the same dots) added in another association,
    so they differ by a few fp32 ulps; an e4m3 code of h moves only when such a sum lies that close
    to a rounding boundary, by one step, which moves an output by that h value times a w2 weight:
    the file's 1e-4 of the output scale (the same flip the reference tolerance covers); a group's
    scale (amax / 448) moving an ulp with its amax moves outputs by ~1e-7 of their scale. With one
    group per share the finish kernel adds the group sums in the single pass's order, from 0.0: in
    the interpreter (no fused multiply-adds, which a GPU's single pass may use) bit for bit.
    KSPLIT = 1 is bit for bit the configuration without the key and launches no finish kernel."""
    mod, dev = triton_module("fused_moe_fp8")
    H, I = 520, 200
    gen = torch.Generator().manual_seed(7 + M)
    x = torch.randn(M, H, generator=gen)
    w13, s13, w2, s2 = _experts(E, H, I, seed=M)
    ids = torch.rand(M, E, generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(M, k, generator=gen)
    ref = fp8_moe_experts_torch(x, w13, s13, w2, s2, weights, ids, act)
    on = [t.to(dev) for t in (x, w13, s13, w2, s2, weights, ids)]
    finish = _LaunchSpy(mod._split_k_finish_kernel)
    monkeypatch.setattr(mod, "_split_k_finish_kernel", finish)

    def run(**split):
        return mod.fused_moe_fp8(*on, config=dict(_DECODE_BLOCKS, **split), activation=act).cpu()

    single = run()
    assert torch.equal(run(KSPLIT=1), single) and finish.launches == []
    ref_tol = (1e-4 + 16 * mma_rel(dev)) * ref.abs().max().item()
    for s in (2, 3, 5):
        out = run(KSPLIT=s)
        assert [launch["KSPLIT"] for launch in finish.launches] == [s]  # the split path ran, s shares
        finish.launches.clear()
        torch.testing.assert_close(out, ref, rtol=0, atol=ref_tol, msg=lambda m: f"KSPLIT={s}: {m}")
        torch.testing.assert_close(out, single, rtol=0, atol=1e-4 * single.abs().max().item(),
                                   msg=lambda m: f"KSPLIT={s} vs 1: {m}")
        if s == 5 and dev == "cpu":
            assert torch.equal(out, single)


def test_split_k_is_checked():
    """KSPLIT is an int from 1 to ceil(H / 128) (each share holds a K group), and only the gate/up
    GEMM's: the "down" overrides may not set it."""
    mod, dev = triton_module("fused_moe_fp8")
    gen = torch.Generator().manual_seed(8)
    M, H, I, E, k = 2, 300, 72, 4, 2  # 3 K groups
    x = torch.randn(M, H, generator=gen)
    ids = torch.rand(M, E, generator=gen).topk(k, dim=-1).indices
    on = [t.to(dev) for t in (x, *_experts(E, H, I), torch.rand(M, k, generator=gen), ids)]
    for bad in (0, 4, -1, 2.0, "2", True):
        with pytest.raises(ValueError, match="KSPLIT must be an int from 1 to the 3 K groups"):
            mod.fused_moe_fp8(*on, config=dict(_DECODE_BLOCKS, KSPLIT=bad))
    with pytest.raises(ValueError, match="\"down\" blocks cannot set KSPLIT"):
        mod.fused_moe_fp8(*on, config=dict(_DECODE_BLOCKS, KSPLIT=2, down=dict(BN=64, KSPLIT=2)))
    assert mod.split_k(dict(_DECODE_BLOCKS, KSPLIT=3), 3) == (3, _DECODE_BLOCKS)  # no KSPLIT left to launch with
    assert mod.split_k(_DECODE_BLOCKS, 3) == (1, _DECODE_BLOCKS)


def test_the_heuristic_splits_k_at_decode_sizes_only():
    """Up to one pair per expert the untuned configuration splits the gate/up GEMM's K (4 shares,
    fewer when H has fewer groups); from there on it keeps the single pass."""
    mod, _ = triton_module("fused_moe_fp8")
    assert mod._config(10, 512, 16)["KSPLIT"] == 4  # the 80B at one token
    assert mod._config(512, 512, 16)["KSPLIT"] == 4
    assert mod._config(3, 6, 2)["KSPLIT"] == 2  # H of two groups
    for pairs in (513, 8192, 65536):
        assert "KSPLIT" not in mod._config(pairs, 512, 16)


def test_fp8_linear_module():
    lin = torch.nn.Linear(200, 300, bias=True)
    f = quantized_like(lin)
    f.to(torch.bfloat16)  # a cast moves nothing: the codes and scales are the stored format
    assert f.weight.dtype == torch.float8_e4m3fn and f.weight_scale_inv.dtype == torch.float32
    assert f.bias.dtype == torch.bfloat16
    x = _x(4, 200, dtype=torch.bfloat16)
    torch.testing.assert_close(f(x), fp8_linear_torch(x, f.weight, f.weight_scale_inv, f.bias), rtol=0, atol=0)
    assert set(f.state_dict()) == {"weight", "weight_scale_inv", "bias"}


def test_packed_fp8_linears():
    lins = [quantized_like(torch.nn.Linear(200, n, bias=False)) for n in (256, 128, 72)]
    before = {i: (lin.weight.clone(), lin.weight_scale_inv.clone()) for i, lin in enumerate(lins)}
    packed = PackedLinears(lins)
    assert isinstance(packed, PackedFp8Linears) and packed.weight() is not None
    for i, lin in enumerate(lins):  # the parts are views of the packed tensors, values unchanged
        assert torch.equal(lin.weight.float(), before[i][0].float()) and torch.equal(lin.weight_scale_inv, before[i][1])
    x = _x(5, 200)
    for got, lin in zip(packed(x), lins):
        torch.testing.assert_close(got, lin(x), rtol=0, atol=1e-5)


def test_fp8_and_model_dtype_projections_pack_by_kind():
    """Qwen3.5's GDN in a checkpoint that keeps b and a in bf16 (modules_to_not_convert): qkv and
    z pack into one FP8 GEMM, b and a into one bf16 GEMM; outputs in the parts' order, equal to
    each part's own; a replaced part sends the calls back to the parts."""
    from hyla.layers.delta_rule import MixedPackedLinears

    gen = torch.Generator().manual_seed(6)
    lins = [quantized_like(torch.nn.Linear(200, n, bias=False)) for n in (256, 128)]
    lins += [torch.nn.Linear(200, 32, bias=False), torch.nn.Linear(200, 32, bias=False)]
    lins.insert(1, lins.pop(2))  # kinds interleaved: fp8, bf16, fp8, bf16
    for lin in lins[1::2]:
        lin.weight.requires_grad_(False)  # as a loaded model's (a weight that wants gradients is not packed)
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) * 0.05)
    x = _x(5, 200)
    want = [lin(x) for lin in lins]
    mixed = PackedLinears(lins)
    assert isinstance(mixed, MixedPackedLinears) and mixed.weight() is not None and not mixed.contiguous
    for got, w in zip(mixed(x), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-5)
    lins[3].weight = torch.nn.Parameter(lins[3].weight.clone(), requires_grad=False)
    assert mixed.weight() is None
    for got, w in zip(mixed(x), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_fp8_linears_pad_parts_to_whole_blocks(bias):
    """Parts whose rows do not fill their last 128-row block (Qwen3.5's 32-row b and a, 72 rows
    here) still pack into one GEMM: each part starts on a block, the rows between are zeros. The
    parts' tensors are views with unchanged values; every output equals the part's own."""
    gen = torch.Generator().manual_seed(5)
    lins = []
    for n in (72, 256, 32, 32):
        lin = torch.nn.Linear(200, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, 200, generator=gen) * 0.05)
        lins.append(quantized_like(lin))
    before = [(lin.weight.float().clone(), lin.weight_scale_inv.clone()) for lin in lins]
    x = _x(5, 200)
    want = [lin(x) for lin in lins]
    packed = PackedLinears(lins)
    assert packed.weight() is not None and packed.offsets == [0, 128, 384, 512]
    assert packed.packed.weight.shape[0] == 544 and packed.packed.weight_scale_inv.shape[0] == 5
    for lin, (w, sc) in zip(lins, before):
        assert torch.equal(lin.weight.float(), w) and torch.equal(lin.weight_scale_inv, sc)
    for got, w in zip(packed(x), want):
        torch.testing.assert_close(got, w, rtol=0, atol=1e-5)
    lins[2].weight = torch.nn.Parameter(lins[2].weight.clone(), requires_grad=False)  # a part replaced
    assert packed.weight() is None and all(torch.equal(g, lin(x)) for g, lin in zip(packed(x), lins))


def test_fp8_experts_stack_their_shared_expert():
    E, H, I = 4, 200, 128
    experts = Fp8StackedExperts(E, H, I)
    gen = torch.Generator().manual_seed(4)
    experts.quantize_(torch.randn(E, 2 * I, H, generator=gen) * 0.05, torch.randn(E, H, I, generator=gen) * 0.05)
    shared = MLP(H, I)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(shared, name, quantized_like(getattr(shared, name)))
    x = _x(6, H)
    ids = torch.randint(0, E, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    want = experts(x, weights, ids) + shared(x)
    assert experts.stack_shared(shared) and experts.shared_is_stacked()
    shared.prepare_for_inference()  # gate / up pack in place: adjacent rows of the stacked experts
    assert shared._packed.weight() is not None
    ids_s = torch.cat([ids, torch.full((6, 1), E)], 1)
    got = experts(x, torch.cat([weights, torch.ones(6, 1)], 1), ids_s, shared=True)
    # the shared expert's output now goes through the per-pair rounding and slot sum: fp32 order only
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(shared(x), MLP.forward(shared, x), rtol=0, atol=0)
    assert experts.to(torch.bfloat16).gate_up_proj.dtype == torch.float8_e4m3fn


def test_modules_dispatch_to_the_kernels(monkeypatch):
    _, dev = triton_module("fp8_gemm")
    if dev == "cpu":
        use_backend(monkeypatch, "triton")
    lin = quantized_like(torch.nn.Linear(200, 72)).to(dev)
    x = _x(3, 200).to(dev)
    ref = fp8_linear_torch(x.cpu(), lin.weight.cpu(), lin.weight_scale_inv.cpu(), lin.bias.cpu())
    assert_gemm_close(lin(x).cpu(), ref, x.cpu(), lin.weight.cpu(), lin.weight_scale_inv.cpu(), dev)


def test_power_of_two_scales_carry_mxfp4_values_exactly():
    """MXFP4 weights (E2M1 codes x 2^e per 32 columns) block-quantised with power-of-two scales
    land on e4m3 codes exactly when a block's group exponents span <= 13 binades (the bound
    block_quantize states), in every 128 x 128 block including partial edge ones; at a wider span
    only the values below the e4m3 grid move, by at most half its step. amax / 448 scales (the
    released recipe) are not exact for the same weights."""
    from hyla.models.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(3)
    N, K = 200, 320  # partial row and column blocks
    packed = torch.randint(0, 256, (N, K // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    for span in (0, 5, 13):
        scale = (120 - torch.randint(0, span + 1, (N, K // 32), generator=gen)).to(torch.uint8)
        w = dequantize_mxfp4(packed, scale)
        q, s = block_quantize(w, power_of_two=True)
        assert torch.equal(torch.log2(s), torch.log2(s).round())
        assert torch.equal(block_dequantize(q, s), w), span
    q, s = block_quantize(w)
    assert not torch.equal(block_dequantize(q, s), w)
    scale = (120 - torch.randint(0, 20, (N, K // 32), generator=gen)).to(torch.uint8)
    w = dequantize_mxfp4(packed, scale)
    q, s = block_quantize(w, power_of_two=True)
    back = block_dequantize(q, s)
    step = torch.repeat_interleave(torch.repeat_interleave(s, 128, 0), 128, 1)[:N, :K] * 2.0 ** -9
    assert not torch.equal(back, w) and bool(((back - w).abs() <= step / 2).all())


def test_every_fp8_sweep_configuration_runs_and_agrees():
    """hyla bench moe --fp8 --sweep's configurations (hyla.bench.moe.fp8_sweep: FP8_SWEEP, and at
    decode sizes its small-row ones split-K with the KSPLITs H's K groups allow) are ones the FP8
    fused MoE takes (BK and the gate/up BN at the 128 block) and each computes the reference (H =
    130: KSPLIT 1 and 2; the released shapes' 16 and 18 groups take 4 and 8 as well)."""
    from hyla.bench.moe import FP8_KSPLITS, FP8_SWEEP, fp8_sweep

    mod, dev = triton_module("fused_moe_fp8")
    gen = torch.Generator().manual_seed(5)
    M, H, I, E, k = 7, 130, 72, 4, 2
    sweep = fp8_sweep(M, H)
    assert {cfg.get("KSPLIT", 1) for cfg in sweep} == {1, 2}  # 2 K groups: no share without one
    assert fp8_sweep(4096, H) == FP8_SWEEP  # prefill sizes: the single pass only
    for hidden in (2048, 2304):
        assert {cfg.get("KSPLIT", 1) for cfg in fp8_sweep(1, hidden)} == set(FP8_KSPLITS)
        for cfg in fp8_sweep(64, hidden):
            mod.split_k(cfg, -(-hidden // 128))  # valid there
    x = torch.randn(M, H, generator=gen)
    w13, s13, w2, s2 = _experts(E, H, I)
    ids = torch.rand(M, E, generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(M, k, generator=gen)
    ref = fp8_moe_experts_torch(x, w13, s13, w2, s2, weights, ids)
    on = [t.to(dev) for t in (x, w13, s13, w2, s2, weights, ids)]
    for config in sweep:
        out = mod.fused_moe_fp8(*on, config=config).cpu()
        torch.testing.assert_close(out, ref, rtol=0, atol=(1e-4 + 16 * mma_rel(dev)) * ref.abs().max().item(),
                                   msg=lambda m: f"{config}: {m}")


def test_a_split_k_table_entry_round_trips(tmp_path, monkeypatch):
    """A split-K configuration of the sweep written into an "fp8_w8a8" table (kernel_tables.
    write_configs, as hyla bench moe --fp8 --sweep --write-configs does) comes back from the FP8
    kernel's tuned_config as written, and fused_moe_fp8 splits the gate/up GEMM by its KSPLIT (the
    down GEMM never sees it) to the reference."""
    from hyla.bench.moe import fp8_sweep
    from hyla.ops.triton import kernel_tables as kt

    mod, dev = triton_module("fused_moe_fp8")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU 3")
    monkeypatch.setattr(kt, "_device_name", functools.cache(kt._device_name.__wrapped__))
    M, H, I, E, k = 3, 300, 72, 4, 2
    entry = next(cfg for cfg in fp8_sweep(M, H) if cfg.get("KSPLIT") == 2)
    kt.write_configs(tmp_path / kt.config_file_name(E, I, H, "Fake GPU 3", "fp8_w8a8"), {M: entry})
    tuned = mod.tuned_config(M, E, I, H, torch.device("cuda"), tmp_path)
    assert tuned == entry

    monkeypatch.setattr(mod, "tuned_config", lambda *_: dict(tuned))  # on the CPU no table applies
    finish, down = _LaunchSpy(mod._split_k_finish_kernel), _LaunchSpy(mod._down_kernel)
    monkeypatch.setattr(mod, "_split_k_finish_kernel", finish)
    monkeypatch.setattr(mod, "_down_kernel", down)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(M, H, generator=gen)
    w13, s13, w2, s2 = _experts(E, H, I)
    ids = torch.rand(M, E, generator=gen).topk(k, dim=-1).indices
    weights = torch.rand(M, k, generator=gen)
    ref = fp8_moe_experts_torch(x, w13, s13, w2, s2, weights, ids)
    out = mod.fused_moe_fp8(*[t.to(dev) for t in (x, w13, s13, w2, s2, weights, ids)]).cpu()
    assert [launch["KSPLIT"] for launch in finish.launches] == [2]
    assert "KSPLIT" not in down.launches[0]  # the interpreter would take an unknown launch option silently
    torch.testing.assert_close(out, ref, rtol=0, atol=(1e-4 + 16 * mma_rel(dev)) * ref.abs().max().item())


def test_untuned_tiles_up_to_64_rows_accumulate_in_fp32():
    """Without a tuned table, up to 64 rows run tiles of at most 32 rows: Triton runs FP8 tiles of
    64 rows and more as Hopper's wgmma, whose FP8 accumulator keeps fewer bits than fp32 within a
    128-deep block. With 64-row tiles from 17 rows (7451dfa) the tiny FP8 checkpoints on an H100 left
    the CPU's W8A8 definition by 5e-2 instead of 5e-7 (docs/perf-log/2026-12-06-h100-pool-scan.md)."""
    mod, _ = triton_module("fp8_gemm")
    for m in range(1, 65):
        assert mod.gemm_config(m, 2048)["BM"] <= 32, m


def test_every_gemm_sweep_configuration_computes_the_reference():
    """hyla bench fp8-gemm's configurations (hyla.bench.fp8_gemm.GEMM_SWEEP) each run the block-FP8
    GEMM to the reference (partial row, column and K blocks)."""
    from hyla.bench.fp8_gemm import GEMM_SWEEP

    mod, dev = triton_module("fp8_gemm")
    x = _x(19, 200)
    w, s = _w(150, 200)
    ref = fp8_linear_torch(x, w, s)
    xq, xs = mod.per_token_group_quant(x.to(dev))
    for config in GEMM_SWEEP:
        out = mod.fp8_gemm(xq, xs, w.to(dev), s.to(dev), torch.float32, config=config).cpu()
        assert_gemm_close(out, ref, x, w, s, dev, str(config))


def test_the_gemm_reads_its_tuned_table(tmp_path, monkeypatch):
    """A tuned entry (hyla.ops.triton.kernel_tables) applies within a factor of two of its row
    count, for its weight shape and device kind only, and fp8_gemm launches with it."""
    from hyla.ops.triton import kernel_tables as kt

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU 2")
    monkeypatch.setattr(kt, "_device_name", functools.cache(kt._device_name.__wrapped__))
    path = tmp_path / kt.gemm_file_name(150, 200, "Fake GPU 2")
    assert path.name == "N=150,K=200,device=Fake_GPU_2,dtype=fp8_w8a8,block_shape=[128,128].json"
    kt.write_configs(path, {16: dict(BM=16, BN=32, GM=1, num_warps=4, num_stages=2)})
    cuda = torch.device("cuda")
    assert kt.tuned_gemm_config(20, 150, 200, cuda, tmp_path)["BN"] == 32
    assert kt.tuned_gemm_config(64, 150, 200, cuda, tmp_path) is None  # 4x away
    assert kt.tuned_gemm_config(16, 150, 256, cuda, tmp_path) is None  # another shape
    assert kt.tuned_gemm_config(16, 150, 200, torch.device("cpu"), tmp_path) is None

    mod, dev = triton_module("fp8_gemm")
    asked = []

    def tuned(rows, n, k, device):
        asked.append((rows, n, k))
        return dict(BM=16, BN=32, GM=1, num_warps=4, num_stages=2)
    monkeypatch.setattr(mod, "tuned_gemm_config", tuned)
    x = _x(5, 200)
    w, s = _w(150, 200)
    out = mod.fp8_linear(x.to(dev), w.to(dev), s.to(dev)).cpu()
    ref = fp8_linear_torch(x, w, s)
    assert_gemm_close(out, ref, x, w, s, dev)
    assert asked == [(5, 150, 200)]


def test_a_cublas_refusal_keeps_to_its_row_alignment(monkeypatch):
    """fp8_linear's routing from SCALED_MM_MIN_ROWS rows: cuBLAS refusing a row count that is not a
    multiple of 16 sends such counts to the Triton GEMM from then on, but not aligned ones (an
    H100 image refused one row and took 16); an aligned refusal sends aligned counts to Triton."""
    from types import SimpleNamespace

    from hyla.ops.triton import fp8_gemm as g

    calls = []

    def scaled_mm(x, w, s, bias=None):
        calls.append(("cublas", x.shape[0]))
        if x.shape[0] % 16 or refuse_aligned:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED")
        return "cublas"

    monkeypatch.setattr(g, "fp8_linear_scaled_mm", scaled_mm)
    monkeypatch.setattr(g, "activation_fp8", lambda x: (x, None))
    monkeypatch.setattr(g, "fp8_gemm", lambda xq, xs, w, s, dtype, bias, config: calls.append(("triton", xq.shape[0]))
                        or "triton")
    monkeypatch.setattr(g, "_scaled_mm_refused", set())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no CUDA build here
    w = SimpleNamespace(shape=(2304, 4096))

    def rows(m):
        return SimpleNamespace(is_cuda=True, shape=(m, 4096), dtype=torch.bfloat16)

    refuse_aligned = False
    n = g.SCALED_MM_MIN_ROWS
    assert g.fp8_linear(rows(n + 1), w, None) == "triton"  # refused, then Triton
    assert g.fp8_linear(rows(n + 3), w, None) == "triton"  # unaligned: straight to Triton
    assert g.fp8_linear(rows(2 * n), w, None) == "cublas"  # aligned: still cuBLAS
    assert g.fp8_linear(rows(n - 16), w, None) == "triton"  # below SCALED_MM_MIN_ROWS
    assert calls == [("cublas", n + 1), ("triton", n + 1), ("triton", n + 3), ("cublas", 2 * n), ("triton", n - 16)]
    refuse_aligned = True
    calls.clear()
    assert g.fp8_linear(rows(2 * n + 16), w, None) == "triton"
    assert g.fp8_linear(rows(2 * n), w, None) == "triton"
    assert calls == [("cublas", 2 * n + 16), ("triton", 2 * n + 16), ("triton", 2 * n)]
