"""A prefill step cut into token-wise spans and per-sequence cores, so that the spans can run as
CUDA graphs (hyla.engine.prefill_graphs) while the cores, which read the pools and the step's
sequence boundaries, stay eager.

A decoder layer of an opted-in family (`piecewise_prefill = True` on the model class) is

    x, h = input_layernorm.add_forward(f, h)       f: the previous layer's FFN output
    a = mixer.step_post(mixer.step_core(mixer.step_pre(x), batch, cache), pre)
    x, h = post_attention_layernorm.add_forward(a, h)
    f = layer.ffn(x)

where the mixer's `step_pre` (projections) and `step_post` (output norm and projection) are
token-wise and touch no pool, and `step_core` (convs and chunk, or page writes and attention) is
everything that reads the step's sequences or the pools. Span i (0 <= i <= L, L layers) is what
lies between core i - 1 and core i:

    span 0:  h = embed(ids); x, h = norm_0(h); pre_0 = mixer_0.step_pre(x)
    span i:  a = mixer_{i-1}.step_post(core_{i-1}, pre_{i-1}); x, h = post_norm_{i-1}.add(a, h);
             f = ffn_{i-1}(x); x, h = norm_i.add(f, h); pre_i = mixer_i.step_pre(x)
    span L:  ... f = ffn_{L-1}(x); hidden = final_norm.add(f, h)

Every tensor a span reads or writes for the next part lives in a `SpanState`: the eager program
keeps the tensors themselves, the graphs' state copies them into static buffers (one set per
layout, shared by the layers of that layout). A token's span output depends on that token's
inputs alone, so the spans may run over more rows than the step has (padding rows at the end);
the cores see the step's rows only. `run` below is the eager program: bit for bit
`model.forward_batch` (tests/models/test_prefill_program.py).
"""

from __future__ import annotations

import torch
from torch import nn

from hyla.contract import ForwardBatch, HybridCache


def supports(model: nn.Module) -> bool:
    """Whether the model runs its prefill steps as spans and cores: its class opts in
    (`piecewise_prefill = True`) and every layer's mixer has the three step parts."""
    if not getattr(type(model), "piecewise_prefill", False):
        return False
    return all(all(hasattr(layer.token_mixer, name) for name in ("step_pre", "step_core", "step_post",
                                                                    "step_core_like"))
               for layer in model.model.layers)


def check_prefill(batch: ForwardBatch) -> None:
    """ValueError unless batch is a prefill step (the layers take other paths for the rest)."""
    if batch.is_verify or batch.is_decode:
        raise ValueError("spans and cores run prefill steps; a verify or pure-decode step goes through "
                         "forward_batch")


class SpanState:
    """What the spans and cores hand each other: the token ids, each layer's step_pre tensors
    (`pre[i]`), its core output (`core[i]`), the residual stream and the final hidden states.
    This one keeps the tensors as they are (the eager program); hyla.engine.prefill_graphs'
    subclass keeps them in static buffers."""

    def __init__(self, ids: torch.Tensor | None = None):
        self._ids = ids
        self._pre: dict[int, object] = {}
        self._core: dict[int, torch.Tensor] = {}
        self._residual: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def ids(self) -> torch.Tensor:
        return self._ids

    def set_pre(self, i: int, pre) -> None:
        self._pre[i] = pre

    def pre(self, i: int, rows: int | None = None):
        """Layer i's step_pre tensors (rows: only the first `rows` token rows)."""
        return self._pre[i]

    def set_core(self, i: int, out: torch.Tensor) -> None:
        self._core[i] = out

    def core(self, i: int) -> torch.Tensor:
        return self._core[i]

    def residual(self) -> torch.Tensor:
        return self._residual

    def set_residual(self, h: torch.Tensor) -> None:
        self._residual = h

    def set_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class PrefillProgram:
    """The spans of a model's prefill step (module docstring). model: a HybridForCausalLM whose
    class opts in (`supports`)."""

    def __init__(self, model: nn.Module):
        if not supports(model):
            raise ValueError(f"{type(model).__name__} does not run its prefill steps in spans "
                             "(piecewise_prefill and every mixer's step_pre / step_core / step_post)")
        self.model = model
        self.layers = list(model.model.layers)

    @property
    def num_spans(self) -> int:
        return len(self.layers) + 1

    def span(self, i: int, state: SpanState) -> None:
        """Run span i (0 .. num_spans - 1) over state's rows: reads state.ids (span 0) or layer
        i - 1's step_pre and core output and the residual; writes layer i's step_pre and the
        residual, or (the last span) the final hidden states."""
        layers = self.layers
        if i == 0:
            h = self.model.model.embed_tokens(state.ids())
            x, h = layers[0].input_layernorm.add_forward(h, None)
        else:
            prev = layers[i - 1]
            a = prev.token_mixer.step_post(state.core(i - 1), state.pre(i - 1))
            x, h = prev.post_attention_layernorm.add_forward(a, state.residual())
            f = prev.ffn(x)
            if i == len(layers):
                state.set_hidden(self.model.model.norm.add_forward(f, h)[0])
                return
            x, h = layers[i].input_layernorm.add_forward(f, h)
        state.set_pre(i, layers[i].token_mixer.step_pre(x))
        state.set_residual(h)

    def core(self, i: int, state: SpanState, batch: ForwardBatch, cache: HybridCache) -> None:
        """Run layer i's core over the step's rows (batch.num_tokens) and hand its output to state."""
        rows = batch.num_tokens
        state.set_core(i, self.layers[i].token_mixer.step_core(state.pre(i, rows), batch, cache.layers[i]))

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        """The eager program: input_ids [T_total] -> final-norm hidden states [T_total, hidden],
        as model.forward_batch (a prefill step: not a verify, not a pure decode)."""
        check_prefill(batch)
        state = SpanState(input_ids)
        for i in range(len(self.layers)):
            self.span(i, state)
            self.core(i, state, batch, cache)
        self.span(len(self.layers), state)
        return state.hidden
