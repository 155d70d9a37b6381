"""Peak memory while loading: the weights plus one layer's transient, through `LLM`.

prepare_for_inference() stacks each MoE layer's shared expert behind its routed experts, which
replaces that layer's expert tensors by new ones. If anything in the loading path still holds the
old tensors, every MoE layer's experts exist twice until loading returns (on the released 48B
shape that is 40 GB more than the weights: an out-of-memory on one H200). The test records, at
each layer's stacking, how many bytes of the tensors replaced at earlier layers are still alive
(weakrefs): it must be none, for real safetensors and for load_format="dummy" alike.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from hyla.engine import LLM
from hyla.layers.moe import StackedExperts
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint


@pytest.fixture(scope="module")
def kimi_moe(tmp_path_factory):
    return build_kimi_checkpoint(tmp_path_factory.mktemp("load_memory"), "moe")


def _record_stacking(monkeypatch) -> list[int]:
    """Patch StackedExperts.stack_shared: before each call, append the bytes of earlier calls'
    replaced tensors that are still alive; then remember this call's replaced tensors."""
    original = StackedExperts.stack_shared
    replaced: list[tuple[weakref.ref, int]] = []
    alive_at_call: list[int] = []

    def recording(self, shared):
        alive_at_call.append(sum(n for ref, n in replaced if ref() is not None))
        old = [self.gate_up_proj, self.down_proj, shared.gate_proj.weight, shared.up_proj.weight,
               shared.down_proj.weight]
        done = original(self, shared)
        if done:
            replaced.extend((weakref.ref(t), t.numel() * t.element_size()) for t in old)
        return done

    monkeypatch.setattr(StackedExperts, "stack_shared", recording)
    return alive_at_call


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_stacking_frees_each_layers_replaced_experts_before_the_next(kimi_moe, monkeypatch, load_format):
    alive_at_call = _record_stacking(monkeypatch)
    llm = LLM(str(kimi_moe), dtype=torch.float32, device="cpu", load_format=load_format, max_num_seqs=2,
              max_model_len=64, memory_budget=1 << 22)
    assert len(alive_at_call) == 3  # the three MoE layers of the "moe" variant
    assert alive_at_call == [0, 0, 0], f"bytes of earlier layers' replaced experts still alive: {alive_at_call}"
    out = llm.generate([[3, 4, 5]], llm.get_default_sampling_params())  # the stacked model still runs
    assert out[0].outputs[0].token_ids
