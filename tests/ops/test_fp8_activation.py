"""Activations that carry their block-FP8 form (hyla.ops.fp8_activation): the lookup serves exactly
the carried tensor and its contiguous aligned views, and misses after an in-place change; a
consumer that quantised lets the next consumer of the same tensor reuse it. Triton's interpreter
without a GPU.
"""

import pytest
import torch

from hyla.ops import fp8_activation
from hyla.ops.fp8 import block_quantize, per_token_group_quant, quantize_gate_up
from tests.ops.helpers import use_backend
from tests.ops.triton_env import triton_module


def _randn(*shape, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def assert_is_group_quant(y: torch.Tensor, carried) -> None:
    """carried: (q, s) bit for bit per_token_group_quant of y's rows (up to the sign of zero)."""
    assert carried is not None, "no FP8 form carried"
    q, s = carried
    rq, rs = per_token_group_quant(y.reshape(-1, y.shape[-1]))
    assert torch.equal(s, rs), f"scales differ: {int((s != rs).sum())} of {s.numel()}"
    assert torch.equal(q.float(), rq.float()), f"codes differ: {int((q.float() != rq.float()).sum())}"


def _carrier(shape, seed=0):
    """A tensor of `shape` (rows of whole groups) carrying its FP8 form as a producer's output does."""
    cols = shape[-1]
    rows = torch.Size(shape).numel() // cols
    y, q, s = fp8_activation.producer_buffers(rows, cols, torch.bfloat16, torch.device("cpu"), fp8=True)
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


def test_inference_mode_outputs_carry_and_inference_tensors_do_not():
    """Inference tensors keep no version counter: a producer's output is a normal tensor also
    under inference_mode, and an inference tensor a consumer quantised carries nothing."""
    with torch.inference_mode():
        y = _carrier((2, 256))
        assert not y.is_inference() and fp8_activation.lookup(y) is not None
        x = _randn(2, 256, seed=1).clone()
        assert x.is_inference()
        fp8_activation.carry_quantized(x, *per_token_group_quant(x))
        assert fp8_activation.lookup(x) is None


def test_only_producer_forms_cross_a_graph_capture(monkeypatch):
    """While a CUDA graph is captured a consumer attaches nothing and a form a consumer attached
    before is not served (its input may be a static buffer that replays refill); a producer's
    form (written by the launch that writes the values) is served."""
    produced = _carrier((2, 256))
    x = _randn(2, 256, seed=1)
    fp8_activation.carry_quantized(x, *per_token_group_quant(x))
    assert fp8_activation.lookup(x) is not None
    monkeypatch.setattr(fp8_activation, "is_capturing", lambda t: True)
    assert fp8_activation.lookup(x) is None and fp8_activation.lookup(produced) is not None
    other = _randn(2, 256, seed=2)
    fp8_activation.carry_quantized(other, *per_token_group_quant(other))
    monkeypatch.setattr(fp8_activation, "is_capturing", lambda t: False)
    assert fp8_activation.lookup(other) is None and fp8_activation.lookup(x) is not None


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
    return (*quantize_gate_up(torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5),
            *block_quantize(torch.randn(E, H, I, generator=gen) / I ** 0.5))


def test_a_second_consumer_reuses_the_first_ones_quantisation(monkeypatch, quantiser_calls):
    """A tensor no producer quantised (hidden 200 here: no whole groups, or an unmarked norm) is
    quantised by its first FP8 consumer and reused by the next (the shared expert after the routed
    experts; parts run one by one); a change in place sends it through the quantiser again. Through
    hyla.ops.fp8 as the modules call it: the 3-D input's lookup passes its reshape."""
    from hyla.ops.fp8 import fp8_linear, fp8_moe_experts

    triton_module("fp8_gemm")
    use_backend(monkeypatch, "triton")
    B, T, H, I, E, k = 1, 3, 256, 128, 4, 2
    x = _randn(B, T, H, seed=7)
    gen = torch.Generator().manual_seed(8)
    (w1, s1), (w2, s2) = (block_quantize(torch.randn(n, H, generator=gen) / H ** 0.5) for n in (72, 300))
    ids, weights = torch.rand(T, E, generator=gen).topk(k, dim=-1).indices, torch.rand(T, k, generator=gen)
    first = fp8_moe_experts(x.view(T, H), *_experts(E, H, I), weights, ids)
    second, third = fp8_linear(x, w1, s1), fp8_linear(x, w2, s2)
    assert quantiser_calls == [(T, H)]
    assert torch.equal(second, fp8_linear(x.clone(), w1, s1)) and torch.equal(third, fp8_linear(x.clone(), w2, s2))
    assert torch.equal(first, fp8_moe_experts(x.clone().view(T, H), *_experts(E, H, I), weights, ids))
    quantiser_calls.clear()
    x.add_(1.0)
    fp8_linear(x, w1, s1)
    assert quantiser_calls == [(T, H)]
