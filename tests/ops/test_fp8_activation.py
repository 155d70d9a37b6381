"""Producer-side FP8 activation quantisation (hyla.ops.fp8_activation): the Triton producers (the
RMSNorm kernel in all its styles, KDA's low-rank gated output norm, the SwiGLU activation) asked for
fp8_output write codes and scales bit for bit per_token_group_quant of their own output, and leave
that output unchanged; the lookup serves exactly the carried tensor and its contiguous aligned
views, and misses after an in-place change; the FP8 GEMM and the fused MoE compute the same bits
from a carried form without launching the quantiser, and a consumer that quantised keeps nothing on
its input.

Fresh random bf16 inputs at awkward sizes (rows 1, 3, 17, 33; D = 128, 256, 2304 = 18 x 128: every
row count and every D, not the product), with an all-zero group (the scale's 1e-10 floor) and the
kernels' outputs pre-filled with NaN (an unwritten code or scale shows). Triton's interpreter
without a GPU; compiled on one, where the rows of 2,048 are added.
"""

import pytest
import torch

from hyla.ops import dispatch, fp8_activation
from hyla.ops.fp8 import block_quantize, per_token_group_quant, quantize_gate_up
from tests.ops.helpers import use_backend
from tests.ops.test_fused_decode import fill_empties_with_nan
from tests.ops.triton_env import triton_module

SIZES = [(1, 2304), (3, 128), (17, 256), (33, 2304)]  # (rows, D)


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the Triton kernels' (triton_env)
if DEVICE.type == "cuda":  # a compiled kernel's layout depends on the row width: also the Qwen3-Next hidden size
    SIZES.append((64, 2048))


def _randn(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16().to(DEVICE)


def _norm_input(R, D, seed):
    x = _randn(R, D, seed=seed, scale=3.0)
    x[0, :128] = 0.0  # a zero group in every producer's output: the scale takes the amax floor
    return x


def _producers(R, D, seed):
    """name -> f(fp8_output) -> the producer's output, for rows of D elements."""
    norm = triton_module("norm")[0]
    gated_act = triton_module("gated_act")[0]
    x, res, w = _norm_input(R, D, seed), _randn(R, D, seed=seed + 1), _randn(D, seed=seed + 2)
    res[0, :128] = 0.0
    gate = _randn(R, 2 * D, seed=seed + 3, scale=2.0)[:, D:]  # a column view of a wider projection
    gu = _randn(R, 2 * D, seed=seed + 4, scale=3.0)
    gu[0, :128] = 0.0
    H, r = 2, 24
    xh = torch.stack([x, _norm_input(R, D, seed + 5)], dim=1)[:, None]  # [R, 1, H, D]
    g_in, w_up = _randn(R, 1, r, seed=seed + 6), _randn(H * D, r, seed=seed + 7, scale=r ** -0.5)
    return {
        "rounded": lambda f: norm.rms_norm_rounded(x, w, 1e-5, f),
        "rounded_fp32_weight": lambda f: norm.rms_norm_rounded(x, w.float(), 1e-5, f),  # an fp32 output
        "zero_centred": lambda f: norm.rms_norm_zero_centred(x, w, 1e-6, f),
        "add_rounded": lambda f: norm.add_rms_norm(x, res, w, 1e-6, False, f)[0],
        "add_zero_centred": lambda f: norm.add_rms_norm(x, res, w, 1e-6, True, f)[0],
        "gated_sigmoid": lambda f: norm.gated_rms_norm(x, gate, w, 1e-5, "sigmoid", f),
        "gated_silu": lambda f: norm.gated_rms_norm(x, gate, None, 1e-5, "silu", f),
        "silu_gated": lambda f: norm.silu_gated_rms_norm(x, gate, w, 1e-6, f),
        "lowrank_gated": lambda f: norm.lowrank_gated_rms_norm(xh, g_in, w_up, w, 1e-5, "sigmoid", f),
        "silu_mul": lambda f: gated_act.silu_mul(gu[:, :D], gu[:, D:], f),
    }


HEAD_WISE = {"gated_sigmoid", "gated_silu", "silu_gated", "lowrank_gated"}  # emit up to GATED_FP8_MAX_D
PRODUCERS = [
    "rounded", "rounded_fp32_weight", "zero_centred", "add_rounded", "add_zero_centred", "gated_sigmoid",
    "gated_silu", "silu_gated", "lowrank_gated", "silu_mul"]


def assert_is_group_quant(y: torch.Tensor, carried) -> None:
    """carried: (q, s) bit for bit per_token_group_quant of y's rows (up to the sign of zero)."""
    assert carried is not None, "no FP8 form carried"
    q, s = carried
    rq, rs = per_token_group_quant(y.reshape(-1, y.shape[-1]))
    assert torch.equal(s, rs), f"scales differ: {int((s != rs).sum())} of {s.numel()}"
    assert torch.equal(q.float(), rq.float()), f"codes differ: {int((q.float() != rq.float()).sum())}"


@pytest.mark.parametrize("R, D", SIZES)
@pytest.mark.parametrize("producer", PRODUCERS)
def test_producers_write_the_quantisers_bits(monkeypatch, producer, R, D):
    run = _producers(R, D, seed=R * 10 + D)[producer]
    plain = run(False)
    assert fp8_activation.lookup(plain) is None
    fill_empties_with_nan(monkeypatch)
    y = run(True)
    assert torch.equal(y, plain)  # the output itself unchanged
    if producer in HEAD_WISE and D > triton_module("norm")[0].GATED_FP8_MAX_D:
        assert fp8_activation.lookup(y.reshape(-1, D)) is None  # wide head-wise rows leave it to the consumer
        return
    assert_is_group_quant(y, fp8_activation.lookup(y.reshape(-1, D)))


def test_rows_of_partial_groups_carry_nothing():
    """D = 200 (not whole groups of 128): fp8_output is ignored, the output is the plain one."""
    run = _producers(3, 200, seed=1)
    for name in ("rounded", "gated_silu", "silu_mul"):
        y = run[name](True)
        assert torch.equal(y, run[name](False)) and fp8_activation.lookup(y) is None, name


def test_only_the_triton_path_emits(monkeypatch):
    """hyla.ops.dispatch passes fp8_output to the kernels; the torch path ignores it."""
    triton_module("norm")
    x, w = _norm_input(3, 256, seed=2), _randn(256, seed=3)
    g, u = _randn(3, 256, seed=4), _randn(3, 256, seed=5)
    use_backend(monkeypatch, "torch")
    assert fp8_activation.lookup(dispatch.rms_norm_rounded(x, w, 1e-6, fp8_output=True)) is None
    assert fp8_activation.lookup(dispatch.silu_mul(g, u, fp8_output=True)) is None
    use_backend(monkeypatch, "triton")
    y = dispatch.rms_norm_rounded(x, w, 1e-6, fp8_output=True)
    assert_is_group_quant(y, fp8_activation.lookup(y))
    y = dispatch.silu_mul(g, u, fp8_output=True)
    assert_is_group_quant(y, fp8_activation.lookup(y))
    assert fp8_activation.lookup(dispatch.rms_norm_rounded(x, w, 1e-6)) is None  # off by default
    w_up = _randn(256, 8, seed=6, scale=8 ** -0.5)
    for tokens in (3, dispatch.LOWRANK_GATE_MAX_ROWS + 1):  # the one kernel; the up-projection's GEMM, then the norm
        o, g_in = _randn(1, tokens, 2, 128, seed=7), _randn(1, tokens, 8, seed=8)
        y = dispatch.lowrank_gated_rms_norm(o, g_in, w_up, w[:128], 1e-6, fp8_output=True).flatten(-2)
        assert_is_group_quant(y, fp8_activation.lookup(y))


def _carrier(shape, seed=0):
    """A tensor of `shape` (rows of whole groups) carrying its FP8 form as a producer's output does."""
    cols = shape[-1]
    rows = torch.Size(shape).numel() // cols
    y, q, s = fp8_activation.producer_buffers(rows, cols, torch.bfloat16, DEVICE, fp8=True)
    y.copy_(_randn(rows, cols, seed=seed))
    rq, rs = per_token_group_quant(y)
    q.copy_(rq)
    s.copy_(rs)
    return fp8_activation.carry_produced(y.view(shape), q, s)


def test_lookup_serves_aligned_contiguous_views():
    """A gated norm's [T, H, 128] output serves o_proj's y.flatten(-2) [T, H * 128] (another Python
    object, a view of it) and any other contiguous view whose rows are whole groups."""
    y = _carrier((3, 4, 128))
    for view in (y, y.flatten(-2), y.view(12, 128), y.view(6, 256), y.view(-1)):
        assert_is_group_quant(view, fp8_activation.lookup(view))
    assert fp8_activation.lookup(y.flatten(-2))[0].shape == (3, 512)


def test_lookup_misses_changed_or_misaligned_views():
    y = _carrier((3, 4, 128))
    flat = y.flatten(-2)
    for view in (y[:, 1:],  # not contiguous
                 y[1:],  # contiguous, another start: not the carried tensor
                 y.view(24, 64),  # rows of half a group
                 flat[:, 128:384],  # a column slice
                 y.view(torch.int16)):  # another dtype over the same bytes
        assert fp8_activation.lookup(view) is None, tuple(view.shape)
    assert fp8_activation.lookup(y.transpose(0, 1)) is None
    flat[0, 0] += 1.0  # an in-place change through a view
    assert fp8_activation.lookup(y) is None and fp8_activation.lookup(flat) is None
    z = _carrier((2, 256))
    z.mul_(1.0)  # even one that keeps every value
    assert fp8_activation.lookup(z) is None


def test_inference_mode_outputs_carry():
    """Inference tensors keep no version counter: a producer's output is a normal tensor also
    under inference_mode, and carries its form."""
    with torch.inference_mode():
        y = _carrier((2, 256))
        assert not y.is_inference() and fp8_activation.lookup(y) is not None


@pytest.fixture
def quantiser_calls(monkeypatch):
    """The activation quantiser launches of the Triton FP8 consumers, counted."""
    gemm, _ = triton_module("fp8_gemm")
    calls = []
    inner = gemm.per_token_group_quant

    def counted(x):
        calls.append(tuple(x.shape))
        return inner(x)

    monkeypatch.setattr(gemm, "per_token_group_quant", counted)
    return calls


def _experts(E, H, I, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return tuple(t.to(DEVICE) for t in (*quantize_gate_up(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5),
                                        *block_quantize(torch.randn(E, H, I, generator=gen) / I ** 0.5)))


def test_consumers_compute_the_same_bits_from_a_carried_form(quantiser_calls):
    """fp8_gemm.fp8_linear and fused_moe_fp8 on a producer's output: bit for bit the result on a
    copy of it (quantised by the launch), without that launch."""
    gemm, _ = triton_module("fp8_gemm")
    moe, _ = triton_module("fused_moe_fp8")
    norm, _ = triton_module("norm")
    R, H, I, E, k = 5, 256, 128, 4, 2
    y = norm.rms_norm_rounded(_norm_input(R, H, seed=3), _randn(H, seed=4), 1e-6, fp8_output=True)
    gen = torch.Generator().manual_seed(5)
    w, s = (t.to(DEVICE) for t in block_quantize(torch.randn(200, H, generator=gen) / H ** 0.5))
    experts = _experts(E, H, I)
    gen = torch.Generator().manual_seed(6)
    ids, weights = (t.to(DEVICE) for t in (torch.rand(R, E, generator=gen).topk(k, dim=-1).indices,
                                           torch.rand(R, k, generator=gen)))
    assert torch.equal(gemm.fp8_linear(y, w, s), gemm.fp8_linear(y.clone(), w, s))
    assert torch.equal(moe.fused_moe_fp8(y, *experts, weights, ids),
                       moe.fused_moe_fp8(y.clone(), *experts, weights, ids))
    assert quantiser_calls == [(R, H), (R, H)]  # the copies only


def test_a_consumer_keeps_its_own_quantisation_to_itself(monkeypatch, quantiser_calls):
    """A tensor no producer quantised (an unmarked norm's output) is quantised by each FP8 consumer
    and carries nothing afterwards: its memory may be rewritten without a version change (a graph
    replay into the prefill graphs' static buffers, a Triton kernel's store), where a kept form
    would go stale. Through hyla.ops.fp8 as the modules call it (a 3-D input)."""
    from hyla.ops.fp8 import fp8_linear, fp8_moe_experts

    triton_module("fp8_gemm")
    use_backend(monkeypatch, "triton")
    B, T, H, I, E, k = 1, 3, 256, 128, 4, 2
    x = _randn(B, T, H, seed=7)
    gen = torch.Generator().manual_seed(8)
    (w1, s1), (w2, s2) = ([t.to(DEVICE) for t in block_quantize(torch.randn(n, H, generator=gen) / H ** 0.5)]
                          for n in (72, 300))
    ids, weights = (t.to(DEVICE) for t in (torch.rand(T, E, generator=gen).topk(k, dim=-1).indices,
                                           torch.rand(T, k, generator=gen)))
    fp8_moe_experts(x.view(T, H), *_experts(E, H, I), weights, ids)
    fp8_linear(x, w1, s1)
    fp8_linear(x, w2, s2)
    assert quantiser_calls == [(T, H)] * 3
    assert fp8_activation.lookup(x) is None and fp8_activation.lookup(x.view(T, H)) is None


def test_a_form_must_match_its_tensor():
    y, q, s = fp8_activation.producer_buffers(2, 256, torch.bfloat16, DEVICE, fp8=True)
    with pytest.raises(ValueError, match="e4m3 codes of its 512 elements"):
        fp8_activation.carry_produced(y, q[:1], s)
    with pytest.raises(ValueError, match="fp32 group scales"):
        fp8_activation.carry_produced(y, q, s.double())
