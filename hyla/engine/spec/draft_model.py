"""Draft-model drafter: a smaller checkpoint with the same tokenizer proposes k tokens.

The draft model has its own pools (state slots and KV pages, outside the target's Scheduler: a
request's view holds them until release()) and two slots per request: the committed slot holds
its state over the request's tokens so far; drafting runs on a scratch copy, so rejected drafts
never touch the committed state. Each step first feeds the tokens the target
committed since the last step (one varlen chunk for all requests), then decodes k - 1 more.
"""

from __future__ import annotations

import torch

from hyla.engine.model_runner import ModelRunner
from hyla.engine.pools import Pools, size_pools
from hyla.engine.sampler import distribution
from hyla.engine.spec.protocol import Proposer
from hyla.engine.step_plan import StepPlan


class _DraftView:
    """One request in the draft model's pools: its tokens, how many are computed, its pages and
    its two slots (`slot`: the one the next step runs in). StepPlan.plain reads it as a sequence."""

    def __init__(self, slot: int, scratch: int):
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.slot = slot
        self.committed, self.scratch = slot, scratch

    def token_range(self, start: int, stop: int) -> list[int]:
        return self.token_ids[start:stop]


class DraftModelDrafter(Proposer):
    def __init__(self, cfg, *, vocab_size: int, max_num_seqs: int, max_model_len: int, page_size: int,
                 state_dtype, dtype, device, enforce_eager: bool = False):
        from hyla.models import load_model

        self.k = cfg.num_speculative_tokens
        self.model = load_model(cfg.model, dtype=dtype, device=device)
        if self.model.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.model.config.vocab_size}) differs from the "
                             f"target's ({vocab_size}): it must share the tokenizer")
        num_slots, num_pages = size_pools(self.model, budget=None, max_num_seqs=2 * max_num_seqs,
                                          max_model_len=max_model_len + self.k, page_size=page_size,
                                          state_dtype=state_dtype, device=self.model.device)
        self.pools = Pools(num_pages, num_slots, page_size)
        self.runner = ModelRunner(self.model, num_slots, num_pages, page_size, state_dtype, enforce_eager)
        self.views: dict[str, _DraftView] = {}

    def _view(self, seq) -> _DraftView | None:
        view = self.views.get(seq.request_id)
        if view is None:
            if self.pools.slots.num_free < 2:
                return None
            view = _DraftView(self.pools.slots.allocate(), self.pools.slots.allocate())
            self.views[seq.request_id] = view
        return view

    def release(self, seq) -> None:
        view = self.views.pop(seq.request_id, None)
        if view is not None:
            self.pools.pages.release(view.block_table)
            self.pools.slots.release(view.committed)
            self.pools.slots.release(view.scratch)

    @torch.inference_mode()
    def propose(self, seqs, ks: list[int], generator: torch.Generator | None = None
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        """-> per sequence (drafts, q [len(drafts), V] or None for greedy requests). Sampled drafts
        draw from the request's own generator when it is seeded, else from `generator` (the
        engine's, seeded by EngineConfig.seed), never from torch's global RNG."""
        live, views = [], []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            view = self._view(seq) if k else None
            if view is None:
                continue
            view.token_ids = list(seq.token_ids)
            new = len(view.token_ids) - view.num_computed_tokens
            if not self.pools.can_allocate(view, new + k):
                continue
            self.pools.allocate(view, new + k)
            live.append(i)
            views.append(view)
        results: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in seqs]
        if not live:
            return results
        # Catch up on the committed tokens (x0 included) in the committed slots.
        for v in views:
            v.slot = v.committed
        news = [len(v.token_ids) - v.num_computed_tokens for v in views]
        logits = self.runner.execute(StepPlan.plain(views, news, [[n - 1] for n in news])).logits
        for v, n in zip(views, news):
            v.num_computed_tokens += n
            self.runner.copy_slot(v.committed, v.scratch)
        drafts = [[] for _ in live]
        probs = [[] for _ in live]
        base = [v.num_computed_tokens for v in views]
        for step in range(max(ks[i] for i in live)):
            for j, i in enumerate(live):
                if step < ks[i]:
                    seq = seqs[i]
                    p = seq.params
                    if p.greedy:
                        drafts[j].append(int(logits[j].argmax()))
                    else:
                        q = distribution(logits[j], p)
                        gen = seq.generator if seq.generator is not None else generator
                        drafts[j].append(int(torch.multinomial(q, 1, generator=gen)))
                        probs[j].append(q)
            if step + 1 == max(ks[i] for i in live):
                break
            # Decode the newest draft on the scratch slots (positions past the committed ones).
            for v, d, b in zip(views, drafts, base):
                v.slot, v.token_ids = v.scratch, v.token_ids[:b] + d
                v.num_computed_tokens = b + len(d) - 1
            logits = self.runner.execute(StepPlan.plain(views, [1] * len(views), [[0]] * len(views))).logits
        for j, (i, v, b) in enumerate(zip(live, views, base)):
            v.num_computed_tokens, v.slot = b, v.committed
            q = torch.stack(probs[j][: ks[i]]) if probs[j] else None
            results[i] = (drafts[j][: ks[i]], q)
        return results
