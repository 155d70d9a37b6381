"""The fused decode paths of the layers (issue 15): packed projections (prepare_for_inference),
the one-launch short convs, gates and norms, and the residual adds fused into the norms.

- prepare_for_inference keeps state_dict() (names, shapes, values) and load_state_dict still
  reaches the packed weight;
- packed and unpacked layers give the same engine steps (fp64, torch path);
- the decode step through the Triton kernels (TRITON_INTERPRET=1 on the CPU) matches the torch
  path (fp32, tolerance 1e-4 relative as tests/ops/test_triton.py);
- the models' forward_layers (residual fused into the next norm) equals the layer-by-layer loop;
- a GDN whose b and a projections a checkpoint keeps in the model dtype beside FP8 projections
  computes b and a inside its gate kernel at a decode step (not at a prefill step).
"""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton` (as tests/ops/test_triton.py)

from hyla.contract import ForwardBatch, GDNLayerCache, KDALayerCache, KVLayerCache, MLALayerCache
from hyla.layers import GatedDeltaNet, KimiDeltaAttention
from hyla.layers.attention import GatedAttention
from hyla.layers.fp8_linear import quantized_like
from hyla.layers.gdn import Qwen3_5GatedDeltaNet
from hyla.layers.mla import MLAAttention
from tests.ops.helpers import use_backend
from tests.oracles.kimi_checkpoint import kimi_checkpoint  # noqa: F401  (session fixture)
from tests.oracles.qwen3_next_checkpoint import qwen3_next_checkpoint  # noqa: F401  (session fixture)

HIDDEN = 24


def _randomise(layer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    return layer


def make_layer(kind, seed=0):
    torch.manual_seed(seed)
    layer = {
        "kda": lambda: KimiDeltaAttention(HIDDEN, 2, 8, 4),
        "kda_safe_full_rank": lambda: KimiDeltaAttention(HIDDEN, 3, 8, 4, lower_bound=-5.0, full_rank_gate=True),
        "gdn": lambda: GatedDeltaNet(HIDDEN, 2, 4, 8, 6, 4),
        "gdn_single": lambda: GatedDeltaNet(HIDDEN, 2, 2, 8, 8, 4),
        "mla": lambda: MLAAttention(HIDDEN, 2, 16, 8, 4, 8),
        "mla_lora_bias": lambda: MLAAttention(HIDDEN, 2, 16, 8, 4, 8, q_lora_rank=12, bias=True),
        "attention": lambda: GatedAttention(HIDDEN, 4, 2, 8, partial_rotary_factor=0.5, bias=True),
        "gdn_fp8_qkvz": lambda: GatedDeltaNet(HIDDEN, 2, 4, 8, 6, 4),
        "qwen3_5_fp8_qkv_z": lambda: Qwen3_5GatedDeltaNet(HIDDEN, 2, 6, 8, 6, 4),
    }[kind]()
    layer = _randomise(layer, seed)
    return _fp8_beside_model_dtype_ba(layer) if "fp8" in kind else layer


def _fp8_beside_model_dtype_ba(layer):
    """A GDN as an FP8 checkpoint keeping its b and a projections in the model dtype holds it (Qwen's
    FP8 releases): its other input projections block-FP8, so that prepare_for_inference packs each
    kind on its own (MixedPackedLinears)."""
    for name in ("in_proj_qkvz", "in_proj_qkv", "in_proj_z"):
        if hasattr(layer, name):
            setattr(layer, name, quantized_like(getattr(layer, name)))
    return layer


def make_cache(layer, slots=5, pages=6, page_size=4, dtype=torch.float64, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    if isinstance(layer, KimiDeltaAttention):
        D = layer.num_heads * layer.head_dim
        return KDALayerCache(rnd(slots, layer.num_heads, layer.head_dim, layer.head_dim),
                             tuple(rnd(slots, D, 3) for _ in range(3)))
    if isinstance(layer, GatedDeltaNet):
        return GDNLayerCache(rnd(slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim),
                             (rnd(slots, layer.conv_dim, 3),))
    if isinstance(layer, MLAAttention):
        return MLALayerCache(rnd(pages, page_size, layer.latent_dim))
    return KVLayerCache(rnd(pages, page_size, layer.num_kv_heads, layer.head_dim),
                        rnd(pages, page_size, layer.num_kv_heads, layer.head_dim))


def run_steps(layer, cache, dtype=torch.float64, seed=2):
    """A prefill of two sequences (lengths 5, 3), two decode steps, then a chunked prefill of both
    (2 and 4 more tokens after their contexts) exporting state checkpoints, as the prefix cache
    asks: after the first new token of one (its conv window partly the old one) and after 2 and 4
    of the other, to slots of their own."""
    g = torch.Generator().manual_seed(seed)
    dev = next(layer.parameters()).device
    tables, slots = [[0, 1, 2], [3, 4, 5]], [3, 1]
    steps = [([5, 3], [0, 0], None), ([1, 1], [5, 3], None), ([1, 1], [6, 4], None),
             ([2, 4], [7, 5], [[(1, 0)], [(2, 2), (4, 4)]])]
    outs = []
    with torch.no_grad():
        for lens, ctx, checkpoints in steps:
            x = torch.randn(sum(lens), HIDDEN, generator=g).to(dtype).to(dev)
            batch = ForwardBatch.build(lens, ctx, tables, slots, checkpoints=checkpoints, device=dev)
            outs.append(layer.forward_batch(x, batch, cache))
    return outs


KINDS = ["kda", "kda_safe_full_rank", "gdn", "gdn_single", "mla", "mla_lora_bias", "attention"]


@pytest.mark.parametrize("kind", KINDS)
def test_prepare_keeps_state_dict_and_load_reaches_packed_weight(kind):
    layer = make_layer(kind)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.prepare_for_inference()
    after = layer.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert after[k].shape == before[k].shape and torch.equal(after[k], before[k]), k
    other = make_layer(kind, seed=5)
    layer.load_state_dict(other.state_dict())
    x = torch.randn(2, 7, HIDDEN)
    with torch.no_grad():
        assert torch.allclose(layer(x), other(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_engine_steps_equal_unpacked(kind):
    plain = make_layer(kind).double()
    packed = copy.deepcopy(plain)
    packed.prepare_for_inference()
    with torch.no_grad():
        assert packed._packed is not None and packed._packed.weight() is not None
    c1, c2 = make_cache(plain), make_cache(plain)
    for a, b in zip(run_steps(plain, c1), run_steps(packed, c2)):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-12)
    for a, b in zip(c1.tensors(), c2.tensors()):
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-12)
    x = torch.randn(2, 6, HIDDEN, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(plain(x), packed(x), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_packed_layer_falls_back_when_grad_is_wanted_or_weights_move(kind):
    layer = make_layer(kind)
    layer.prepare_for_inference()
    x = torch.randn(1, 5, HIDDEN)
    layer(x).sum().backward()  # grads reach the official parameters (the separate-Linear path)
    first = layer.q_proj if kind == "kda" else layer.in_proj_qkvz
    assert first.weight.grad is not None and first.weight.grad.abs().sum() > 0
    layer.double()  # re-creates the parameters: the packed weight no longer aliases them
    assert layer._packed.weight() is None
    with torch.no_grad():
        layer(x.double())


# -- the Triton decode path, under the interpreter ------------------------------------------------

def _triton_ready():
    if torch.cuda.is_available():
        return True
    try:
        from hyla.ops import triton as hyla_triton
    except ImportError:  # pragma: no cover
        return False
    return hyla_triton.is_available() and hyla_triton.interpreting()


@pytest.mark.skipif(not _triton_ready(), reason="needs triton, and CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["kda", "kda_safe_full_rank", "gdn", "gdn_single", "attention", "mla", "gdn_fp8_qkvz",
                                  "qwen3_5_fp8_qkv_z"])
def test_triton_decode_step_matches_torch(kind, monkeypatch):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = make_layer(kind).to(dev)
    layer.prepare_for_inference()
    layer.requires_grad_(False)
    c_torch, c_triton = (make_cache(layer, dtype=torch.float32, device=dev) for _ in range(2))
    use_backend(monkeypatch, "torch")
    ref = run_steps(layer, c_torch, dtype=torch.float32)
    use_backend(monkeypatch, "triton" if dev == "cpu" else "auto")
    got = run_steps(layer, c_triton, dtype=torch.float32)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (a - b).abs().max()
    for a, b in zip(c_triton.tensors(), c_torch.tensors()):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not _triton_ready(), reason="needs triton, and CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["gdn_fp8_qkvz", "qwen3_5_fp8_qkv_z"])
def test_gdn_decode_projects_b_and_a_in_the_gate_kernel(kind, monkeypatch):
    """b and a kept in the model dtype beside FP8 projections: their GEMM runs at the prefill steps
    only; a decode step leaves them to the gate kernel (dispatch.gdn_projected_gate_beta, one
    launch), on the Triton path. On the torch path every step runs the GEMM, as before."""
    from hyla.ops import triton as hyla_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = make_layer(kind).to(dev)
    layer.prepare_for_inference()
    layer.requires_grad_(False)
    assert layer.ba_weights() is not None
    ba_storage = layer.ba_weights()[0].untyped_storage().data_ptr()
    events = []
    linear, kernel, forward_batch = torch.nn.functional.linear, hyla_triton.gdn_projected_gate_beta, layer.forward_batch

    def spy_linear(x, weight, *args):
        if weight.untyped_storage().data_ptr() == ba_storage:
            events.append("b/a GEMM")
        return linear(x, weight, *args)

    monkeypatch.setattr(torch.nn.functional, "linear", spy_linear)
    monkeypatch.setattr(hyla_triton, "gdn_projected_gate_beta", lambda *a: events.append("gate kernel") or kernel(*a),
                        raising=False)
    monkeypatch.setattr(layer, "forward_batch",
                        lambda x, batch, cache: events.append(batch.is_decode) or forward_batch(x, batch, cache))
    for backend, decode in (("torch", "b/a GEMM"), ("triton" if dev == "cpu" else "auto", "gate kernel")):
        use_backend(monkeypatch, backend)
        events.clear()
        run_steps(layer, make_cache(layer, dtype=torch.float32, device=dev), dtype=torch.float32)
        assert events == [False, "b/a GEMM", True, decode, True, decode, False, "b/a GEMM"], backend


@pytest.mark.skipif(not _triton_ready(), reason="needs triton, and CUDA or TRITON_INTERPRET=1")
def test_gdn_prefill_tensors_keep_one_layout_at_every_row_count(monkeypatch):
    """step_pre (a prefill step's token-wise part) of a GDN whose gate kernel projects b and a at a
    decode step: b and a from their GEMM at 4 rows as at 40, so that the prefill graphs' buffers,
    laid out once, fit every bucket."""
    import torch.utils._pytree as pytree

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = make_layer("gdn_fp8_qkvz").to(dev)
    layer.prepare_for_inference()
    layer.requires_grad_(False)
    use_backend(monkeypatch, "triton" if dev == "cpu" else "auto")
    layouts = []
    for rows in (4, 40):
        leaves, spec = pytree.tree_flatten(layer.step_pre(torch.randn(rows, HIDDEN, device=dev)))
        layouts.append((str(spec), [None if t is None else (t.shape[1:], t.dtype) for t in leaves]))
    assert layouts[0] == layouts[1]
    assert layer.project(torch.randn(1, 4, HIDDEN, device=dev))[1][1] is None  # a decode step's: b and a left out


# -- residual adds fused across layers ----------------------------------------------------------

def _loop(model, ids, batch=None, cache=None):
    h = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        h = layer(h) if batch is None else layer(h, batch, cache.layers[i])
    return model.model.norm(h)


@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
def test_forward_layers_equals_layer_loop(family, kimi_checkpoint, qwen3_next_checkpoint):  # noqa: F811
    from hyla.models.loader import load_model

    model = load_model(kimi_checkpoint("moe") if family == "kimi" else qwen3_next_checkpoint("moe"))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(model.model.forward_layers(model.model.embed_tokens(ids)), _loop(model, ids))
        caches = [model.allocate_cache(4, 8, 4) for _ in range(2)]
        flat = ids.flatten()
        batch = ForwardBatch.build([9, 9], [0, 0], [[0, 1, 2], [3, 4, 5]], [1, 2])
        a = model.model.forward_layers(model.model.embed_tokens(flat), batch, caches[0].layers)
        b = _loop(model, flat, batch, caches[1])
        assert torch.equal(a, b)
        for x, y in zip(caches[0].layers, caches[1].layers):
            for s, t in zip(x.tensors(), y.tensors()):
                assert torch.equal(s, t)
