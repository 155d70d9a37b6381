"""The safe-gate variant (lower bound -5), which transformers' Kimi-Linear cannot run, against
hyla's own loop reference: the same model with every KDA core swapped for the token loop."""

import pytest
import torch

import hyla.layers.kda as kda_module
from hyla.models import load_model
from hyla.ops.naive import naive_recurrent_kda
from tests.oracles.paged import greedy_generate


def _loop_core(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
               cu_seqlens=None, **_chunk_only_args):
    return naive_recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


@pytest.fixture
def loop_model(monkeypatch):
    """Calls fn(model) with the KDA layers running the token-loop oracle."""
    def run(fn):
        with monkeypatch.context() as m:
            m.setattr(kda_module, "chunk_kda", _loop_core)
            return fn()
    return run


def test_logits_equal_loop_reference(kimi_checkpoint, loop_model):
    model = load_model(kimi_checkpoint("safe_gate"))
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = model(ids)
        slow = loop_model(lambda: model(ids))
    assert fast.abs().max() > 1.0
    assert (fast - slow).abs().max().item() <= 1e-4


def test_greedy_tokens_equal_loop_reference(kimi_checkpoint, loop_model):
    """32 greedy tokens through the paged engine path (chunk prefill + recurrent decode) equal
    greedy decoding that re-runs the loop-reference model on the whole sequence every step."""
    model = load_model(kimi_checkpoint("safe_gate"))
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 29)]
    ours = greedy_generate(model, prompts, max_new_tokens=32, prefill_chunk=16)

    def reference(prompt):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(32):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        return seq[len(prompt):]

    assert ours == loop_model(lambda: [reference(p) for p in prompts])
