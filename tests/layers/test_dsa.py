"""DSA indexer + sparse NoPE MLA vs a loop oracle written here (per query: pool the keys, score
the complete pools it can see, keep the top ones, add its tail, attend densely over the kept
positions), and hyla's rule for "shared" indexer layers."""

import math

import pytest
import torch

from hyla.layers.dsa import DSAAttention, DSAIndexer

HID, HEADS, R, NOPE, V, QL = 32, 2, 16, 8, 8, 12


def _layer(kpool: int, topk: int, tail: bool, indexer: bool = True, seed: int = 0) -> DSAAttention:
    torch.manual_seed(seed)
    idx = DSAIndexer(HID, QL, n_heads=6, head_dim=8, kpool=kpool, topk=topk, always_select_tail=tail) if indexer else None
    layer = DSAAttention(HID, HEADS, R, NOPE, V, QL, idx, norm_eps=1e-5).double()
    with torch.no_grad():
        for p in layer.parameters():  # away from every init (norm weights 1, pooling parameters 0)
            p.copy_(torch.randn_like(p) * (0.4 if p.ndim > 1 else 1.0) + (1.0 if p.ndim == 1 else 0.0))
    return layer.eval()


def _rms(v, w, eps):
    return v / math.sqrt(sum(a * a for a in v.tolist()) / v.numel() + eps) * w


def oracle_selection(layer: DSAAttention, x: torch.Tensor) -> list[set[int]]:
    """x: [T, hidden] -> per query the set of positions it attends to."""
    idx, T = layer.indexer, x.shape[0]
    P, D = idx.kpool, idx.head_dim
    keys = [idx.k_norm(idx.wk(x[i])) for i in range(T)]
    logits = [idx.index_kpool_compress_gate @ x[i] for i in range(T)]
    pooled = []
    for j in range(T // P):
        K = torch.zeros(D, dtype=x.dtype)
        for c in range(D):
            s = [logits[j * P + i][c] + idx.index_kpool_compress_ape[i, c] for i in range(P)]
            z = sum(math.exp(v) for v in s)
            K[c] = sum(math.exp(s[i]) / z * keys[j * P + i][c] for i in range(P))
        pooled.append(K)
    out = []
    for t in range(T):
        q_resid = _rms(layer.q_a_proj(x[t]), layer.q_a_layernorm.weight, layer.q_a_layernorm.eps)
        q = idx.wq_b(q_resid).view(idx.n_heads, D)
        w = idx.weights_proj(x[t]) / math.sqrt(idx.n_heads)
        cands = [j for j in range(len(pooled)) if j * P + P - 1 <= t]
        score = {j: sum(w[h] * max(0.0, float(q[h] @ pooled[j]) / math.sqrt(D)) for h in range(idx.n_heads))
                 for j in cands}
        kept = sorted(cands, key=lambda j: -score[j])[: idx.topk // P]
        sel = {j * P + i for j in kept for i in range(P)}
        if idx.always_select_tail:
            sel |= set(range((t + 1) // P * P, t + 1))
        out.append(sel)
    return out


def oracle_attention(layer: DSAAttention, x: torch.Tensor, sel: list[set[int]]) -> torch.Tensor:
    """Dense softmax attention of each query over its selected positions only -> [T, hidden]."""
    T = x.shape[0]
    lat = [_rms(layer.kv_a_proj_with_mqa(x[i]), layer.kv_a_layernorm.weight, layer.kv_a_layernorm.eps)
           for i in range(T)]
    kv = [layer.kv_b_proj(c).view(HEADS, NOPE + V) for c in lat]
    rows = []
    for t in range(T):
        q_resid = _rms(layer.q_a_proj(x[t]), layer.q_a_layernorm.weight, layer.q_a_layernorm.eps)
        q = layer.q_b_proj(q_resid).view(HEADS, NOPE)
        o = torch.zeros(HEADS, V, dtype=x.dtype)
        keys = sorted(sel[t])
        for h in range(HEADS):
            if not keys:
                continue
            logits = torch.stack([q[h] @ kv[i][h, :NOPE] for i in keys]) / math.sqrt(NOPE)
            p = torch.softmax(logits, 0)
            o[h] = sum(p[n] * kv[i][h, NOPE:] for n, i in enumerate(keys))
        rows.append(layer.o_proj(o.flatten()))
    return torch.stack(rows)


@pytest.mark.parametrize("kpool, topk, tail, T", [(4, 8, True, 29), (2, 4, False, 17), (1, 5, True, 12),
                                                 (4, 8, True, 1), (4, 8, True, 7)])
def test_indexer_and_sparse_attention_match_the_loop(kpool, topk, tail, T):
    layer = _layer(kpool, topk, tail)
    x = torch.randn(T, HID, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        out, mask = layer(x[None])
        want_sel = oracle_selection(layer, x)
        assert [set(torch.nonzero(r).flatten().tolist()) for r in mask[0]] == want_sel
        assert torch.allclose(out[0], oracle_attention(layer, x, want_sel), atol=1e-10)
    if T > topk + kpool:  # the selection really drops positions
        assert any(len(s) < t + 1 for t, s in enumerate(want_sel))


def test_shared_layer_attends_to_the_given_selection():
    full, shared = _layer(4, 8, True), _layer(4, 8, True, indexer=False, seed=1)
    x = torch.randn(30, HID, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.randn(30, HID, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, sel = full(x[None])
        out, passed = shared(y[None], sel)
        assert passed is sel
        sets = [set(torch.nonzero(r).flatten().tolist()) for r in sel[0]]
        assert torch.allclose(out[0], oracle_attention(shared, y, sets), atol=1e-10)
        with pytest.raises(ValueError, match="shared"):
            shared(y[None])


def test_shared_layers_use_the_nearest_earlier_full_layer(monkeypatch):
    """Rule: a "shared" layer reuses the selection of the nearest earlier full indexed layer,
    across KDA layers and other shared layers (transformers only passes one on to the very next
    layer; this schedule, which it cannot run, pins hyla's rule)."""
    from hyla.models.glm5_next import Glm5NextForCausalLM
    from hyla.models.glm5_next_config import Glm5NextConfig
    from tests.oracles.glm5_next_checkpoint import TEXT

    K, I = "linear_attention", "indexed_attention"
    d = dict(TEXT, model_type="glm5_next_text", num_hidden_layers=6, layer_types=[I, K, I, I, K, I],
             indexer_types=["full", "full", "shared", "full", "shared", "shared"], mlp_layer_types=["dense"] * 6,
             hc_mult=2, index_kpool=4, index_topk=8)
    config = Glm5NextConfig.from_hf_dict(d)
    assert [config.selection_source(i) for i in config.attention_layers] == [0, 0, 3, 3]
    model = Glm5NextForCausalLM(config).eval()
    seen = {}
    original = DSAAttention.forward

    def spy(self, x, selection=None):
        out, sel = original(self, x, selection)
        seen[self] = (selection, sel)
        return out, sel

    monkeypatch.setattr(DSAAttention, "forward", spy)
    with torch.no_grad():
        model(torch.randint(3, 256, (1, 40)))
    layers = model.model.layers
    for i in config.attention_layers:
        given, used = seen[layers[i].self_attn]
        src = config.selection_source(i)
        if src != i:
            assert given is seen[layers[src].self_attn][1] and used is given
        else:
            assert layers[i].self_attn.indexer is not None
