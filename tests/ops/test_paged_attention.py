"""Gated attention over paged KV (hyla.ops.paged_attention): the torch reference against a
per-token fp64 loop, and the Triton kernels (TRITON_INTERPRET=1 on the CPU) against the reference
at awkward sizes: head dims that are not powers of two, rotary dims from a quarter to all of the
head, grouped heads (G = 1, 2, 3, 4), query and key heads read in place from a packed
projection, padding pages (-1), W = 1 .. 4 queries per sequence, one-token sequences and
lengths across several key slices. Then GatedAttention.forward_batch on the Triton path against
its torch path (decode, verify and a CUDA-graph-shaped padded batch)."""

from __future__ import annotations

import math

import pytest
import torch

from hyla.contract import ForwardBatch, KVLayerCache
from hyla.ops import paged_attention as ref
from tests.ops.helpers import use_backend
from tests.ops.paged_tables import random_block_tables
from tests.ops.triton_env import triton_module


def _triton():
    return triton_module("paged_attention")


def _case(S, W, H, Hkv, D, rot, ps, lens, dtype, seed=0):
    """Random projections (q, gate, k, v as views of one packed row), a random pool and block
    tables: sequence s holds lens[s] tokens, its W new ones the last W, in pages drawn without
    replacement and padded with -1."""
    g = torch.Generator().manual_seed(seed)
    tables, num_pages = random_block_tables(lens, ps, g)
    ck, cv = (torch.randn(num_pages, ps, Hkv, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    T = S * W
    packed = torch.randn(T, 2 * H * D + 2 * Hkv * D + 3, generator=g, dtype=torch.float64).to(dtype)
    qg = packed[:, :2 * H * D].view(T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:]
    k = packed[:, 2 * H * D:2 * H * D + Hkv * D].view(T, Hkv, D)
    v = packed[:, 2 * H * D + Hkv * D:2 * H * D + 2 * Hkv * D].view(T, Hkv, D)
    qw, kw = (torch.randn(D, generator=g) * 0.2 for _ in range(2))
    inv = 1.0 / (100.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    # the step's per-sequence values as columns of one buffer, as the CUDA-graph runners hold them
    meta = torch.cat([torch.tensor([[n - W] for n in lens]), torch.full((S, 2), 7), tables], 1)
    ctx, tables = meta[:, 0], meta[:, 3:]
    pos = torch.tensor([n - W + i for n in lens for i in range(W)])
    return dict(q=q, gate=gate, k=k, v=v, qw=qw, kw=kw, inv=inv, pos=pos, ctx=ctx, tables=tables, ck=ck, cv=cv, W=W)


def _loop(c):
    """Per token and head, fp64: norm, rotate-half RoPE on the first rotary channels (fp32
    angles), keys / values into their rows, attention over positions 0 .. own, the gate."""
    q, k, v, W = c["q"].double(), c["k"].double(), c["v"].double(), c["W"]
    T, H, D = q.shape
    Hkv, R = k.shape[1], 2 * c["inv"].shape[0]
    ps = c["ck"].shape[1]
    ck, cv = c["ck"].double().clone(), c["cv"].double().clone()

    def norm(t, w):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())

    def rope(t, pos):
        out = t.clone()
        for i in range(R // 2):
            ang = torch.tensor(float(pos), dtype=torch.float32) * c["inv"][i]
            co, si = ang.cos().double(), ang.sin().double()
            out[..., i] = t[..., i] * co - t[..., i + R // 2] * si
            out[..., i + R // 2] = t[..., i + R // 2] * co + t[..., i] * si
        return out

    qs = torch.stack([rope(norm(q[t], c["qw"]), int(c["pos"][t])) for t in range(T)])
    for t in range(T):
        p = int(c["pos"][t])
        row = int(c["tables"][t // W, p // ps]) % ck.shape[0] * ps + p % ps
        ck.view(-1, Hkv, D)[row] = rope(norm(k[t], c["kw"]), p)
        cv.view(-1, Hkv, D)[row] = v[t]
    out = torch.empty(T, H, D, dtype=torch.float64)
    for t in range(T):
        s, p = t // W, int(c["pos"][t])
        rows = [int(c["tables"][s, j // ps]) % ck.shape[0] * ps + j % ps for j in range(p + 1)]
        for h in range(H):
            kh = h // (H // Hkv)
            keys, vals = ck.view(-1, Hkv, D)[rows, kh], cv.view(-1, Hkv, D)[rows, kh]
            w = torch.softmax(keys @ qs[t, h] / math.sqrt(D), 0)
            out[t, h] = (w[:, None] * vals).sum(0) * torch.sigmoid(c["gate"][t, h].double())
    return qs, ck, cv, out.reshape(T, H * D)


def _run(ops, c, dtype=None, **kw):
    ck, cv = c["ck"].clone(), c["cv"].clone()
    q = ops.qk_norm_rope_write(c["q"], c["k"], c["v"], c["qw"], c["kw"], 1e-6, c["inv"], c["pos"], ck, cv, c["tables"],
                               c["W"])
    D = q.shape[2]
    out = ops.paged_window_attention(q, ck, cv, c["tables"], c["ctx"], D ** -0.5, c["gate"], **kw)
    return q, ck, cv, out


SHAPES = [  # S, W, H, Hkv, D, rotary dim, page size, lengths
    (2, 4, 4, 2, 64, 16, 16, [37, 5]),
    (3, 1, 6, 2, 48, 12, 8, [9, 20, 1]),
    (2, 3, 6, 2, 40, 40, 4, [30, 7]),
    (1, 2, 4, 1, 32, 8, 16, [150]),
    (2, 1, 2, 2, 24, 24, 8, [3, 70]),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_loop(shape):
    c = _case(*shape, torch.float64)
    want = _loop(c)
    for got, w in zip(_run(ref, c), want):
        assert torch.allclose(got, w, atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_equals_reference(shape, dtype):
    """fp32: to 2e-6 (the kernels' online softmax and in-kernel cos / sin against torch's);
    bf16: the writes bit for bit (same roundings), the attention to one bf16 step of its
    magnitude (probabilities rounded before or after the normalisation)."""
    tk, dev = _triton()
    c = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in _case(*shape, dtype, seed=1).items()}
    want = _run(ref, c)
    got = _run(tk, c, block_n=16, split=32)  # several key slices (the combine kernel) at these lengths
    one = _run(tk, c)  # one slice of 512 keys
    for g, o, w, name in zip(got, one, want, ("q", "k pool", "v pool", "out")):
        if dtype == torch.float32:
            tol = 2e-6 * max(1.0, float(w.abs().max()))
            assert (g - w).abs().max() <= tol and (o - w).abs().max() <= tol, name
        elif name != "out":
            assert torch.equal(g, w) and torch.equal(o, w), name
        else:
            scale = float(w.float().abs().max())
            assert (g.float() - w.float()).abs().max() <= 2 ** -7 * scale, name
            assert (o.float() - w.float()).abs().max() <= 2 ** -7 * scale, name


def test_triton_split_boundaries_depend_on_length_only():
    """The same sequence in a wider table and beside other sequences: bit for bit (a CUDA-graph
    replay over the widest table gives the eager step's numbers)."""
    tk, dev = _triton()
    c = {k: v.to(dev) if isinstance(v, torch.Tensor) else v
         for k, v in _case(2, 2, 4, 2, 32, 16, 8, [100, 9], torch.float32, seed=3).items()}
    q = torch.randn(4, 4, 32, device=dev)
    a = tk.paged_window_attention(q, c["ck"], c["cv"], c["tables"], c["ctx"], 0.2, block_n=16, split=32)
    wide = torch.cat([c["tables"], torch.full((2, 9), -1, dtype=torch.long, device=dev)], 1)
    b = tk.paged_window_attention(q, c["ck"], c["cv"], wide, c["ctx"], 0.2, block_n=16, split=32)
    alone = tk.paged_window_attention(q[:2], c["ck"], c["cv"], c["tables"][:1], c["ctx"][:1], 0.2, block_n=16,
                                      split=32)
    assert torch.equal(a, b) and torch.equal(a[:2], alone)


def test_bad_arguments_name_the_problem():
    c = _case(2, 2, 4, 2, 16, 8, 4, [6, 9], torch.float32)
    ck, cv = c["ck"].clone(), c["cv"].clone()
    with pytest.raises(ValueError, match="tokens are not 3 per sequence"):
        ref.qk_norm_rope_write(c["q"], c["k"], c["v"], c["qw"], c["kw"], 1e-6, c["inv"], c["pos"], ck, cv,
                               c["tables"], 3)
    with pytest.raises(ValueError, match="q_weight and k_weight"):
        ref.qk_norm_rope_write(c["q"], c["k"], c["v"], c["qw"][:3], c["kw"], 1e-6, c["inv"], c["pos"], ck, cv,
                               c["tables"], 2)
    with pytest.raises(ValueError, match="context_lens"):
        ref.paged_window_attention(c["q"].contiguous(), ck, cv, c["tables"], c["ctx"][:1], 0.5)
    with pytest.raises(ValueError, match="gate must be"):
        ref.paged_window_attention(c["q"].contiguous(), ck, cv, c["tables"], c["ctx"], 0.5, c["gate"][:1])
    tk, _ = _triton()
    with pytest.raises(ValueError, match="multiple of block_n"):
        tk.paged_window_attention(c["q"].contiguous(), ck, cv, c["tables"], c["ctx"], 0.5, block_n=16, split=40)


@pytest.mark.parametrize("W", [1, 3])
def test_gated_attention_triton_path_equals_torch_path(W, monkeypatch):
    """GatedAttention.forward_batch with its two fused ops (HYLA_BACKEND=triton: on a GPU, or on
    CPU tensors under the interpreter) against its torch path, fp32, over shuffled pages; a
    padded graph-shaped batch (a row with no pages, every table column) included."""
    _, dev = _triton()
    from hyla.layers import GatedAttention

    torch.manual_seed(0)
    layer = GatedAttention(40, 6, 2, 16, partial_rotary_factor=0.5, rope_theta=50.0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    layer = layer.to(dev)
    layer.prepare_for_inference()
    ctx, tables = [13, 4, 1], [[5, 2, 9, 11], [3, 7], [-1, -1, -1, -1]]
    x = torch.randn(3 * W, 40).to(dev)
    outs, pools = [], []
    for backend in ("torch", "triton"):
        use_backend(monkeypatch, backend)
        g = torch.Generator().manual_seed(1)
        cache = KVLayerCache(*(torch.randn(13, 4, 2, 16, generator=g).to(dev) for _ in range(2)))
        slots = [[(W + 1) * i + j for j in range(W + 1)] for i in range(3)] if W > 1 else [0, 1, 2]
        batch = ForwardBatch.build([W] * 3, ctx, tables, torch.tensor(slots),
                                   num_accepted_tokens=[1] * 3 if W > 1 else None, device=dev)
        batch.cuda_graph = True  # the graph-shaped batch: every table column, no page checks
        with torch.no_grad():
            outs.append(layer.forward_batch(x, batch, cache))
        pools.append(cache)
    real = slice(0, 2 * W)  # the padding row writes and reads the scratch page (garbage)
    assert torch.allclose(outs[0][real], outs[1][real], atol=2e-5, rtol=0)
    for a, b in ((pools[0].k, pools[1].k), (pools[0].v, pools[1].v)):
        assert torch.allclose(a[:-1], b[:-1], atol=2e-6, rtol=0)
