"""Routed experts (hyla.ops.moe): the sorted grouped-GEMM path and the Triton fused-MoE kernels
against the loop oracle.

fp64 vs the loop at 1e-12: the same sums in the same precision, only the order of a few adds
differs. The grouped-GEMM path in fp32 and the Triton kernels (fp32, IEEE dots; run in Triton's
interpreter without a GPU) at 1e-5 relative: fp32 accumulation over H = 40..72 terms. Awkward
sizes: experts that get no token, a token whose k slots repeat nothing, M = 1, blocks that
straddle experts, H and I not multiples of the block sizes.
"""

import functools

import pytest
import torch

from hyla.ops.gated_act import GatedActivation
from hyla.ops.moe import expert_counts, moe_experts_naive, moe_experts_torch, sort_pairs_by_expert
from tests.ops.triton_env import triton_module


def _inputs(M, H, I, E, k, dtype=torch.float64, seed=0, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=gen, dtype=dtype)
    w13 = torch.randn(E, 2 * I, H, generator=gen, dtype=dtype) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen, dtype=dtype) / I ** 0.5
    scores = torch.rand(M, E, generator=gen)
    if skew:  # most tokens pick the same few experts; the rest of the experts stay empty
        scores[:, : E // 2] -= 2.0
    ids = scores.topk(k, dim=-1).indices
    weights = torch.rand(M, k, generator=gen)
    return x, w13, w2, weights, ids


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("M,H,I,E,k,skew", [(1, 24, 40, 16, 2, False), (13, 40, 24, 16, 4, True),
                                            (64, 32, 48, 8, 8, False), (5, 24, 8, 32, 1, False)])
def test_grouped_path_matches_loop_fp64(M, H, I, E, k, skew):
    x, w13, w2, weights, ids = _inputs(M, H, I, E, k, seed=M, skew=skew)
    want = moe_experts_naive(x, w13, w2, weights, ids)
    got = moe_experts_torch(x, w13, w2, weights, ids)
    assert got.dtype == torch.float64 and _rel(got, want) < 1e-12


@pytest.mark.parametrize("M,k", [(1, 2), (17, 3), (50, 8)])
def test_grouped_path_fp32_uses_grouped_mm(M, k):
    x, w13, w2, weights, ids = _inputs(M, 40, 24, 16, k, dtype=torch.float32, seed=3 + M)
    want = moe_experts_naive(x.double(), w13.double(), w2.double(), weights, ids)
    assert _rel(moe_experts_torch(x, w13, w2, weights, ids), want) < 1e-5


def test_sorting_and_counts():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    order, ends = sort_pairs_by_expert(ids, 5)
    assert ids.reshape(-1)[order].tolist() == [0, 0, 1, 3, 3, 3]
    assert order.tolist() == [1, 4, 3, 0, 2, 5]  # stable: pairs of one expert keep their order
    assert ends.tolist() == [2, 3, 3, 6, 6] and ends.dtype == torch.int32
    assert expert_counts(ids.reshape(-1), 5).tolist() == [2, 1, 0, 3, 0]


def test_bad_shapes_are_named():
    x, w13, w2, weights, ids = _inputs(3, 24, 8, 4, 2)
    with pytest.raises(ValueError, match="inconsistent expert shapes"):
        moe_experts_torch(x[:, :20], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="weights and ids"):
        moe_experts_torch(x, w13, w2, weights[:, :1], ids)


# -- Triton (interpreter on the CPU) -------------------------------------------------------------

def _triton():
    return triton_module("fused_moe")


@pytest.mark.parametrize("M,H,I,E,k,skew", [(1, 24, 40, 16, 2, False), (9, 72, 24, 8, 3, True),
                                            (40, 40, 72, 4, 2, False)])
def test_triton_fused_moe_matches_loop(M, H, I, E, k, skew):
    mod, dev = _triton()
    x, w13, w2, weights, ids = _inputs(M, H, I, E, k, dtype=torch.float32, seed=10 + M, skew=skew)
    want = moe_experts_naive(x.double(), w13.double(), w2.double(), weights, ids)
    got = mod.fused_moe(*(t.to(dev) for t in (x, w13, w2, weights, ids)))
    assert got.shape == (M, H) and torch.isfinite(got).all()
    assert _rel(got.cpu(), want) < 1e-5


@pytest.mark.parametrize("gm", [1, 3])
def test_triton_fused_moe_grouped_launch_order(gm):
    """Several row and column blocks in GM-row groups (the last group short): every output
    tile is computed exactly once, whatever the launch order."""
    mod, dev = _triton()
    x, w13, w2, weights, ids = _inputs(37, 72, 40, 4, 2, dtype=torch.float32, seed=5, skew=True)
    want = moe_experts_naive(x.double(), w13.double(), w2.double(), weights, ids)
    cfg = dict(BM=16, BN=16, BK=32, GM=gm, num_warps=4, num_stages=1)
    got = mod.fused_moe(*(t.to(dev) for t in (x, w13, w2, weights, ids)), config=cfg)
    assert _rel(got.cpu(), want) < 1e-5


def test_triton_fused_moe_second_gemm_takes_its_own_blocks():
    """A "down" override (other column / depth blocks and launch order for the second GEMM,
    the row blocks shared) computes the same product."""
    mod, dev = _triton()
    x, w13, w2, weights, ids = _inputs(37, 72, 40, 4, 2, dtype=torch.float32, seed=6, skew=True)
    want = moe_experts_naive(x.double(), w13.double(), w2.double(), weights, ids)
    cfg = dict(BM=16, BN=16, BK=32, GM=2, num_warps=4, num_stages=1, down=dict(BN=32, BK=16, GM=1))
    got = mod.fused_moe(*(t.to(dev) for t in (x, w13, w2, weights, ids)), config=cfg)
    assert _rel(got.cpu(), want) < 1e-5


def test_triton_fused_moe_one_token_blocks_equal_the_aligned_rows():
    """One token takes one row block per pair (no align launch): its row equals, bit for bit,
    the same token's row computed in the aligned layout beside another token (same blocks and
    config), and a repeated expert (which routing never names) is still summed correctly."""
    mod, dev = _triton()
    x, w13, w2, weights, ids = _inputs(2, 72, 40, 8, 3, dtype=torch.float32, seed=12)
    cfg = dict(BM=16, BN=16, BK=32, GM=1, num_warps=4, num_stages=1)
    on = [t.to(dev) for t in (x, w13, w2, weights, ids)]
    assert mod.row_blocks(on[4][:1], 8, 16).one_pair and not mod.row_blocks(on[4], 8, 16).one_pair
    pair_rows = mod.fused_moe(on[0][:1], on[1], on[2], on[3][:1], on[4][:1], config=cfg).cpu()
    aligned = mod.fused_moe(*on, config=cfg).cpu()
    assert torch.equal(pair_rows[0], aligned[0])
    repeated = torch.tensor([[5, 2, 5]])
    want = moe_experts_naive(x[:1].double(), w13.double(), w2.double(), weights[:1], repeated)
    got = mod.fused_moe(on[0][:1], on[1], on[2], on[3][:1], repeated.to(dev), config=cfg)
    assert _rel(got.cpu(), want) < 1e-5


def test_split_config_gives_each_gemm_its_blocks_and_nothing_else():
    from hyla.ops.triton.fused_moe import split_config

    cfg = dict(BM=128, BN=128, BK=64, GM=4, num_warps=8, num_stages=3, down=dict(BN=256, GM=1))
    bm, first, second = split_config(cfg)
    assert bm == 128 and first == (128, 64, 4, {"num_warps": 8, "num_stages": 3})
    assert second == (256, 64, 1, {"num_warps": 8, "num_stages": 3})  # no "down" among the launch options
    assert "down" in cfg and cfg["BM"] == 128  # the caller's dict is left as it was
    with pytest.raises(ValueError, match="cannot set BM"):
        split_config(dict(BM=16, BN=16, BK=32, down=dict(BM=32)))


def test_tuned_table_is_used_near_its_token_counts(tmp_path, monkeypatch):
    """A tuned entry applies within a factor of two of its key, never to far-off sizes (a table
    tuned for prefill must not pick a decode step's blocks), and only on CUDA."""
    from hyla.ops.triton import kernel_tables as mc

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Fake GPU 1")
    mc._device_name.cache_clear()  # the name is cached per device: forget the fake one afterwards too
    monkeypatch.setattr(mc, "_device_name", functools.cache(mc._device_name.__wrapped__))
    path = tmp_path / mc.config_file_name(8, 16, 32, "Fake GPU 1")
    assert path.name == "E=8,N=16,H=32,device=Fake_GPU_1.json"
    mc.write_configs(path, {8192: dict(BM=128, BN=128, BK=64, GM=4, down=dict(BN=256))})
    mc.write_configs(path, {64: dict(BM=16, BN=64, BK=128)})  # merged, not replaced
    cuda = torch.device("cuda")
    assert mc.tuned_config(8192, 8, 16, 32, cuda, tmp_path)["down"] == {"BN": 256}
    assert mc.tuned_config(5000, 8, 16, 32, cuda, tmp_path)["GM"] == 4
    assert mc.tuned_config(100, 8, 16, 32, cuda, tmp_path)["BM"] == 16
    assert mc.tuned_config(1024, 8, 16, 32, cuda, tmp_path) is None  # 8x from both keys
    assert mc.tuned_config(8192, 8, 16, 64, cuda, tmp_path) is None  # another shape: no file
    assert mc.tuned_config(8192, 8, 16, 32, torch.device("cpu"), tmp_path) is None


@pytest.mark.parametrize("block_m,large", [(2, False), (4, False), (4, True)])
def test_align_pairs_blocks_hold_one_expert(block_m, large, monkeypatch):
    mod, dev = _triton()
    if large:  # the sort-based path taken for prefill-sized batches
        monkeypatch.setattr(mod, "ONE_PROGRAM_MAX_PAIRS", 8)
    _, _, _, _, ids = _inputs(11, 8, 8, 6, 3, seed=2, skew=True)
    sorted_pairs, block_expert = mod.align_pairs(ids.to(dev), 6, block_m)
    sorted_pairs, block_expert = sorted_pairs.cpu(), block_expert.cpu()
    P = ids.numel()
    assert sorted_pairs.numel() % block_m == 0 and sorted_pairs.numel() == block_expert.numel() * block_m
    flat = ids.reshape(-1)
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_pairs[b * block_m:(b + 1) * block_m].tolist()
        live = [r for r in rows if r < P]
        if e < 0:
            assert not live
            continue
        assert live and all(int(flat[r]) == e for r in live)
        seen += live
    assert sorted(seen) == list(range(P))  # every pair exactly once


@pytest.mark.parametrize("E,k,groups,topk_group,renorm", [(32, 3, 4, 2, True), (24, 5, 1, 1, True),
                                                          (64, 8, 8, 3, False), (40, 10, 1, 1, True)])
def test_triton_routing_matches_torch(E, k, groups, topk_group, renorm):
    _, dev = _triton()
    from hyla.ops import moe as ops_moe
    from hyla.ops.triton import moe_routing

    gen = torch.Generator().manual_seed(E + k)
    logits = torch.randn(37, E, generator=gen)
    bias = torch.randn(E, generator=gen) * 0.1

    def same(got, want):
        (gw, gi), (ww, wi) = got, want
        gi, go = gi.cpu().sort(-1)
        wi, wo = wi.sort(-1)
        assert torch.equal(gi, wi)
        torch.testing.assert_close(gw.cpu().gather(1, go), ww.gather(1, wo), rtol=1e-6, atol=1e-7)

    torch_sig = ops_moe.sigmoid_topk_route(logits, k, bias, groups, topk_group, renorm, 2.5)  # CPU: torch path
    same(moe_routing.route(logits.to(dev), k, sigmoid=True, bias=bias.to(dev), num_group=groups,
                           topk_group=topk_group, renormalize=renorm, scale=2.5), torch_sig)
    if groups == 1:
        same(moe_routing.route(logits.to(dev), k, sigmoid=False, renormalize=renorm),
             ops_moe.softmax_topk_route(logits, k, renorm))


def test_routing_kernel_limits_are_checked():
    _triton()
    from hyla.ops.triton import moe_routing

    assert moe_routing.supports(512, 10, 1) and moe_routing.supports(256, 8, 8)
    assert not moe_routing.supports(2048, 8, 1) and not moe_routing.supports(96, 4, 3)
    with pytest.raises(ValueError, match="unsupported"):
        moe_routing.route(torch.randn(2, 2048), 8, sigmoid=False)


def test_triton_routing_appends_the_shared_slot():
    _, dev = _triton()
    from hyla.ops import moe as ops_moe
    from hyla.ops.triton import moe_routing

    gen = torch.Generator().manual_seed(5)
    logits, gate = torch.randn(6, 32, generator=gen), torch.randn(6, generator=gen)
    w, ids = moe_routing.route(logits.to(dev), 4, sigmoid=False, shared_logit=gate.to(dev))
    ws, idss = ops_moe.softmax_topk_route(logits, 4, True, gate)
    assert ids.shape == (6, 5) and (ids[:, 4].cpu() == 32).all() and (idss[:, 4] == 32).all()
    torch.testing.assert_close(w[:, 4].cpu(), gate.sigmoid())
    torch.testing.assert_close(ws[:, 4], gate.sigmoid())
    w, ids = moe_routing.route(logits.to(dev), 4, sigmoid=True, bias=torch.zeros(32).to(dev), shared=True)
    assert (ids[:, 4].cpu() == 32).all() and (w[:, 4].cpu() == 1).all()


def test_triton_routing_computes_the_shared_gate_logit():
    """shared_gate (x, w): the routing kernel computes the gate's linear itself (x . w in fp32,
    rounded to x's dtype as the linear layer's output is): the slot's weight is sigmoid of that
    logit to within one rounding of it (the sum's order is the kernel's); the routed slots are
    untouched. Bad gate arguments are named."""
    _, dev = _triton()
    from hyla.ops import moe as ops_moe
    from hyla.ops.triton import moe_routing

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 40, generator=gen)
    x = torch.randn(3, 700, generator=gen).to(torch.float16)
    w = (torch.randn(1, 700, generator=gen) * 0.05).to(torch.float16)
    got_w, got_ids = moe_routing.route(logits.to(dev), 6, sigmoid=False, shared_gate=(x.to(dev), w.to(dev)))
    gate_logit = torch.nn.functional.linear(x, w)[:, 0]  # fp16, the linear layer's output
    want_w, want_ids = moe_routing.route(logits.to(dev), 6, sigmoid=False, shared_logit=gate_logit.to(dev))
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w[:, :6], want_w[:, :6])
    torch.testing.assert_close(got_w[:, 6].cpu(), gate_logit.float().sigmoid(), rtol=2 ** -10, atol=0)
    # the torch path: the same linear, then the same routing
    torch_w, torch_ids = ops_moe.softmax_topk_route(logits, 6, True, None, (x.float(), w.float()))
    torch.testing.assert_close(torch_w[:, 6], torch.nn.functional.linear(x.float(), w.float())[:, 0].sigmoid())
    with pytest.raises(ValueError, match="shared_gate"):
        moe_routing.route(logits.to(dev), 6, sigmoid=False, shared_gate=(x.to(dev), w.float().to(dev)))
    with pytest.raises(ValueError, match="shared_gate"):
        moe_routing.route(logits.to(dev), 6, sigmoid=False, shared_gate=(x[:2].to(dev), w.to(dev)))


def test_qwen_block_with_a_plain_shared_gate_routes_it_in_the_kernel(monkeypatch):
    """With the shared expert stacked, Qwen3-Next's plain linear gate reaches the routing as (x,
    weight) and, at a decode step's rows, the Triton routing computes its logit (no linear layer
    call); a prefill's rows (past dispatch.LOWRANK_GATE_MAX_ROWS) hand the kernel the linear's
    output instead. Both equal the torch path's output, where the gate runs as a linear layer
    (fp32: the same products in another order)."""
    _, dev = _triton()
    from hyla.layers import Qwen3NextSparseMoE
    from hyla.ops import dispatch

    torch.manual_seed(9)
    block = Qwen3NextSparseMoE(32, 16, 12, 3, 16).to(dev)
    torch.nn.init.normal_(block.gate.weight, std=0.3)  # distinct logits (zeros tie every expert)
    block.prepare_for_inference()
    assert block.experts.shared_is_stacked()
    from hyla.ops.triton import moe_routing

    route = moe_routing.route
    gates = []  # per routing call: whether the kernel got the gate's weights (True) or its logits
    monkeypatch.setattr(moe_routing, "route", lambda *a, **k: gates.append(k["shared_gate"] is not None) or route(*a, **k))
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, t: pytest.fail("the gate ran as a linear layer"))
    for rows in (2, dispatch.LOWRANK_GATE_MAX_ROWS + 1):
        x = torch.randn(rows, 32, device=dev)
        with torch.no_grad():
            previous = dispatch.set_backend("torch")
            try:
                want = block(x)
                dispatch.set_backend("triton")
                got = block(x)
            finally:
                dispatch.set_backend(previous)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert gates == [True, False]  # the kernel's dot at a decode step's rows, the linear's logits past them


def test_triton_fused_moe_half_precision_within_rounding():
    """fp16 in, fp16 out (the interpreter's dots are wrong for bf16; tests/gpu checks bf16): h
    and the per-pair outputs are rounded to x's dtype once each (relative 2^-11 per rounding), the
    slot sum runs in fp32; vs the fp64 loop on the same fp16 values the error stays at a few
    roundings (< 5e-3)."""
    mod, dev = _triton()
    x, w13, w2, weights, ids = _inputs(21, 40, 24, 4, 3, dtype=torch.float32, seed=8, skew=True)
    x, w13, w2 = (t.to(torch.float16) for t in (x, w13, w2))
    want = moe_experts_naive(x.double(), w13.double(), w2.double(), weights, ids)
    got = mod.fused_moe(*(t.to(dev) for t in (x, w13, w2, weights, ids)))
    assert got.dtype == torch.float16
    assert _rel(got.cpu().double(), want) < 5e-3


ACTIVATIONS = [GatedActivation("clamped_silu", limit=0.5), GatedActivation("situ", beta=4.0, linear_beta=0.7),
               GatedActivation("situ", beta=0.3)]


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: f"{a.kind}-{a.limit or a.beta}-{a.linear_beta}")
def test_triton_fused_moe_gated_activations_match_the_torch_experts(act):
    """GLM-5-Next's clamped SwiGLU and Kimi K3's SiTU in the first GEMM's epilogue (scales small
    enough that the clamp / tanh bite on these activations) vs the fp64 grouped path with the same
    activation."""
    mod, dev = _triton()
    x, w13, w2, weights, ids = _inputs(23, 40, 24, 4, 3, dtype=torch.float32, seed=12, skew=True)
    want = moe_experts_torch(x.double(), w13.double(), w2.double(), weights, ids, act)
    got = mod.fused_moe(*(t.to(dev) for t in (x, w13, w2, weights, ids)), activation=act)
    assert _rel(got.cpu(), want) < 1e-5
    plain = moe_experts_torch(x.double(), w13.double(), w2.double(), weights, ids)
    assert _rel(plain, want) > 1e-2  # the activation really differs from SwiGLU here


def test_gated_activation_specs_are_checked():
    with pytest.raises(ValueError, match="unknown gated activation"):
        GatedActivation("gelu")
    with pytest.raises(ValueError, match="positive limit"):
        GatedActivation("clamped_silu")
    with pytest.raises(ValueError, match="positive beta"):
        GatedActivation("situ", beta=0.0)
