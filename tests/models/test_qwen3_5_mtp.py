"""The `mtp.*` head of Qwen3.5 and Qwen3-Next checkpoints (stored in its own shard, as released):
loading, a step computed by hand from the raw tensors, and the paged engine step against whole
sequences."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from hyla.contract import ForwardBatch
from hyla.models import load_model
from hyla.models.qwen3_5_mtp import load_mtp_head
from tests.oracles.qwen3_5_checkpoint import add_mtp_shard
from tests.oracles.qwen3_5_checkpoint import qwen3_5_checkpoint  # noqa: F401  (session fixture)


@pytest.fixture(scope="module")
def with_mtp(qwen3_5_checkpoint, tmp_path_factory):
    """(variant, layout) -> (checkpoint path with an mtp shard, the head's raw tensors)."""
    root, made = tmp_path_factory.mktemp("qwen3_5-mtp"), {}

    def make(variant, layout):
        if (variant, layout) not in made:
            dst = root / f"{variant}-{layout}"
            shutil.copytree(qwen3_5_checkpoint(variant, layout), dst)
            made[variant, layout] = dst, add_mtp_shard(dst)
        return made[variant, layout]

    return make


def _zrms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def test_one_step_by_hand(with_mtp):
    """A first token (position 0, so its attention reads only its own value): fc over the two
    normed inputs, the gated attention's value path, the SwiGLU MLP, both residuals, the norm."""
    path, t = with_mtp("dense", "text")
    model = load_model(path, dtype="float64")
    head = load_mtp_head(path, model)
    t = {k[len("mtp."):]: v.double() for k, v in t.items()}
    h, nxt = torch.randn(1, 1, 64, dtype=torch.float64), torch.tensor([[17]])
    e = model.model.embed_tokens.weight[17]
    x = t["fc.weight"] @ torch.cat([_zrms(e, t["pre_fc_norm_embedding.weight"]),
                                    _zrms(h[0, 0], t["pre_fc_norm_hidden.weight"])])
    a = _zrms(x, t["layers.0.input_layernorm.weight"])
    gate = (t["layers.0.self_attn.q_proj.weight"] @ a).view(4, 2, 32)[:, 1]  # per head: q, then its gate
    v = (t["layers.0.self_attn.v_proj.weight"] @ a).view(2, 32).repeat_interleave(2, dim=0)  # GQA 4 over 2
    x = x + t["layers.0.self_attn.o_proj.weight"] @ (v * torch.sigmoid(gate)).flatten()
    m = _zrms(x, t["layers.0.post_attention_layernorm.weight"])
    x = x + t["layers.0.mlp.down_proj.weight"] @ (F.silu(t["layers.0.mlp.gate_proj.weight"] @ m)
                                                  * (t["layers.0.mlp.up_proj.weight"] @ m))
    want = _zrms(x, t["norm.weight"])
    with torch.no_grad():
        got = head(h, nxt, model)[0, 0]
    assert (got - want).abs().max() < 1e-12


def test_paged_steps_equal_the_whole_sequence(with_mtp):
    """MoE head of the multimodal layout: a chunked prefill over paged KV, then one-token steps,
    give the states of one whole-sequence forward."""
    path, _ = with_mtp("moe", "multimodal")
    model = load_model(path, dtype="float64")
    head = load_mtp_head(path, model)
    assert type(head.layers[0].mlp).__name__ == "Qwen3NextSparseMoE"
    T, page = 21, 4
    h = torch.randn(T, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = head(h[None], ids[None], model)[0]
        kv = head.allocate_kv(num_pages=8, page_size=page)
        table = [5, 2, 7, 0, 3, 6]
        got, done = [], 0
        for n in (9, 7, 1, 1, 1, 1, 1):
            batch = ForwardBatch.build(seq_lens=[n], context_lens=[done], block_tables=[table], state_slots=[0])
            got.append(head.forward_batch(h[done:done + n], ids[done:done + n], model, batch, kv))
            done += n
    assert (torch.cat(got) - want).abs().max() < 1e-10


def test_qwen3_next_head_is_moe_as_stored(tmp_path):
    """Qwen3-Next's head (its layer MoE like the model's) loads beside the model and runs."""
    from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint

    path = build_qwen3_next_checkpoint(tmp_path, "moe")
    t = add_mtp_shard(path)
    model = load_model(path)
    head = load_mtp_head(path, model)
    assert type(head.layers[0].mlp).__name__ == "Qwen3NextSparseMoE"
    assert torch.equal(head.layers[0].self_attn.q_proj.weight, t["mtp.layers.0.self_attn.q_proj.weight"])
    with torch.no_grad():
        y = head(torch.randn(2, 6, 64), torch.randint(0, 256, (2, 6)), model)
    assert model.compute_logits(y).shape == (2, 6, 256)


def test_checkpoint_without_mtp_is_a_clear_error(qwen3_5_checkpoint):
    path = qwen3_5_checkpoint("dense", "text")
    with pytest.raises(ValueError, match=r"no multi-token-prediction head \(no `mtp\.\*` tensors\)"):
        load_mtp_head(path, load_model(path))


def test_mtp_shard_is_skipped_by_the_model_loader(with_mtp):
    path, t = with_mtp("moe", "multimodal")
    model = load_model(path)
    assert not any(k.startswith("mtp.") for k in model.state_dict())
    head = load_mtp_head(path, model)
    assert torch.equal(head.fc.weight, t["mtp.fc.weight"])
    gate_up = head.layers[0].mlp.experts.gate_up_proj  # per-expert tensors stacked in place
    assert torch.equal(gate_up[3, :32], t["mtp.layers.0.mlp.experts.3.gate_proj.weight"])
    assert head.layers[0].mlp.gate.weight.dtype == torch.float32


def test_the_family_loads_its_head(with_mtp, tmp_path):
    """The engine loads the head through the model's family (HybridForCausalLM.load_mtp_head):
    Qwen's is this module's head; a family without one gives None."""
    from hyla.models.base import HybridForCausalLM

    path, t = with_mtp("dense", "text")
    head = load_model(path).load_mtp_head(path)
    assert torch.equal(head.fc.weight, t["mtp.fc.weight"])
    assert HybridForCausalLM.load_mtp_head(object(), path) is None
