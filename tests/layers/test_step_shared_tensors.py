"""What an engine step computes once instead of once per layer or per step: the cached constant
index tensors (hyla.ops.constants), the per-step values of a ForwardBatch (`shared`: RoPE tables,
attention masks), the single-pass RoPE (bit-equal to transformers' rotate-half), and the packed
gate / up GEMM of the MLP (a shared expert stacked behind the routed ones stays stacked)."""

import pytest
import torch

from hyla.contract import ForwardBatch
from hyla.layers import GatedAttention, RotaryEmbedding
from hyla.layers.mlp import MLP
from hyla.layers.moe import StackedExperts
from hyla.ops import constants


def test_constants_are_built_once_and_right():
    a = constants.arange(7, "cpu")
    assert a is constants.arange(7, "cpu") and torch.equal(a, torch.arange(7))
    assert not a.is_inference()  # usable outside inference mode too
    with torch.inference_mode():
        assert constants.arange(9, "cpu") is constants.arange(9, "cpu")
    z = constants.full((2, 3), -1, "cpu")
    assert z.dtype == torch.long and torch.equal(z, torch.full((2, 3), -1))


def test_constants_are_not_cached_inside_a_capture(monkeypatch):
    """A tensor built inside a CUDA-graph capture holds nothing until the first replay: never cached."""
    built = []

    def build(device):
        built.append(device)
        return torch.zeros(1)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    key = ("test-capture", len(built))
    constants.constant(key, "cuda:0", build)
    constants.constant(key, "cuda:0", build)
    assert len(built) == 2
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    constants.constant(key, "cuda:0", build)
    constants.constant(key, "cuda", build)  # the same device
    assert len(built) == 3
    constants._CACHE.pop((key, torch.device("cuda", 0)))


def _batch(ctx, w):
    n = len(ctx)
    return ForwardBatch.build(seq_lens=[w] * n, context_lens=ctx, block_tables=[[0, 1]] * n, state_slots=[0] * n)


def test_batch_shared_values_are_per_batch():
    b, calls = _batch([3, 5], 1), []
    for _ in range(3):
        b.shared("x", lambda _: calls.append(1) or len(calls))
    assert calls == [1]
    assert _batch([3, 5], 1).shared("x", lambda _: "fresh") == "fresh"  # a new step computes it anew


@pytest.mark.parametrize("w", [1, 3])
def test_query_window_masks(w):
    ctx, page = [3, 9], 8
    verify = ({"state_slots": [[0] * w, [1] * w], "num_accepted_tokens": [1, 1]} if w > 1
              else {"state_slots": [0, 1]})
    b = ForwardBatch.build(seq_lens=[w] * 2, context_lens=ctx, block_tables=[[0, 1], [2, -1]], **verify)
    rows, masked, unread = b.query_window(page)
    assert b.query_window(page)[1] is masked  # once per step
    t = torch.arange(rows.shape[1])
    tables = torch.tensor([[0, 1], [2, -1]])[:, :rows.shape[1] // page]
    assert torch.equal(rows, (tables[:, :, None] * page + torch.arange(page)).flatten(1))  # page -1: the last page
    for n, c in enumerate(ctx):
        for i in range(w):
            assert torch.equal(masked[n, i], t > c + i)
        assert torch.equal(unread[n], t > c + w - 1)


def _transformers_rope(x, positions, rotary, dtype):
    """transformers' partial rotate-half RoPE, literally (fp32 angles, cos / sin cast to dtype)."""
    R = rotary.rotary_dim
    inv = rotary.inv_freq(x.device)
    freqs = positions[:, None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    rot, rest = x[..., :R], x[..., R:]
    half = torch.cat([-rot[..., R // 2:], rot[..., :R // 2]], -1)
    return torch.cat([rot * cos + half * sin, rest], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("factor", [0.25, 1.0])
def test_single_pass_rope_equals_rotate_half_bitwise(dtype, factor):
    torch.manual_seed(0)
    rotary = RotaryEmbedding(32, factor, theta=10000.0)
    x = torch.randn(11, 6, 32).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 4096, 30000, 5, 6, 8])
    cos, sin = rotary.cos_sin(positions, dtype)
    assert torch.equal(rotary(x, cos, sin), _transformers_rope(x, positions, rotary, dtype))


def test_attention_layers_of_a_step_share_one_rope_table():
    layer = GatedAttention(16, 2, 1, 8, partial_rotary_factor=0.5)
    b, x = _batch([2, 4], 1), torch.randn(2, 16)
    layer.qkv(x, b.positions, b)
    tables = [v for k, v in b._memo.items() if isinstance(k, tuple) and k[0] == "rope"]
    assert len(tables) == 1
    other = GatedAttention(16, 2, 1, 8, partial_rotary_factor=0.5)
    other.qkv(x, b.positions, b)  # the same RoPE: the same table
    assert [v for k, v in b._memo.items() if isinstance(k, tuple) and k[0] == "rope"] == tables


def test_packed_mlp_equals_separate_projections():
    torch.manual_seed(0)
    mlp = MLP(16, 24).requires_grad_(False)
    x = torch.randn(5, 16)
    want = mlp(x)
    keys = set(mlp.state_dict())
    mlp.prepare_for_inference()
    assert set(mlp.state_dict()) == keys
    assert mlp._packed.weight() is not None
    torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)


def test_packing_a_stacked_shared_expert_keeps_it_stacked():
    """StackedExperts.stack_shared makes the shared MLP's weights views of the stacked tensors;
    packing its gate / up afterwards must not copy them away (the stacked path would be lost)."""
    torch.manual_seed(0)
    experts, shared = StackedExperts(4, 16, 8), MLP(16, 8)
    experts.requires_grad_(False), shared.requires_grad_(False)
    assert experts.stack_shared(shared)
    gate, up = shared.gate_proj.weight.data_ptr(), shared.up_proj.weight.data_ptr()
    x = torch.randn(3, 16)
    want = shared(x)
    shared.prepare_for_inference()
    assert experts.shared_is_stacked()
    assert (shared.gate_proj.weight.data_ptr(), shared.up_proj.weight.data_ptr()) == (gate, up)
    assert shared._packed.weight()[0].data_ptr() == gate
    torch.testing.assert_close(shared(x), want, rtol=1e-6, atol=1e-6)


def test_columns_of_a_grid_equal_one_row_batches():
    """A chain of one-row attention steps run as the columns of one grid batch (the MTP head's
    draft steps) writes the same KV rows and gives the same outputs as one fresh one-row batch
    per step; the grid's tables are computed once."""
    from hyla.contract import KVLayerCache

    torch.manual_seed(0)
    layer = GatedAttention(16, 2, 1, 8, partial_rotary_factor=0.5).double()
    page, ctx, steps = 4, [3, 6], 3
    tables = [[0, 1, 2], [3, 4, 5]]

    def pools():
        torch.manual_seed(1)
        return KVLayerCache(*(torch.randn(6, page, 1, 8, dtype=torch.float64) for _ in range(2)))

    xs = [torch.randn(2, 16, dtype=torch.float64) for _ in range(steps)]
    a, b = pools(), pools()
    want = [layer.forward_batch(x, ForwardBatch.build(seq_lens=[1, 1], context_lens=[c + j for c in ctx],
                                                      block_tables=tables, state_slots=[0, 0]), a)
            for j, x in enumerate(xs)]
    grid = ForwardBatch.build(seq_lens=[steps] * 2, context_lens=ctx, block_tables=tables,
                              state_slots=[[0] * steps] * 2, num_accepted_tokens=[1, 1])
    got = [layer.forward_batch(x, grid.column(j), b) for j, x in enumerate(xs)]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert sum(isinstance(k, tuple) and k[0] == "rope" for k in grid._memo) == 1  # computed once, on the grid
    assert ("slots", page) in grid._memo and ("query_window", page) in grid._memo
    with pytest.raises(ValueError):
        grid.column(steps)


def test_greedy_tokens_is_the_argmax_of_the_logits():
    """Without the fp32 copy of the logits, ties included (duplicate lm_head rows)."""
    from types import SimpleNamespace

    from hyla.models.base import HybridForCausalLM

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight[7] = head.weight[3]
    model = SimpleNamespace(lm_head=head)
    h = torch.randn(64, 16, dtype=torch.bfloat16)
    want = HybridForCausalLM.compute_logits(model, h).argmax(-1)
    assert torch.equal(HybridForCausalLM.greedy_tokens(model, h), want)
