"""MTP drafter: the target checkpoint's own multi-token-prediction head (hyla.models.qwen3_5_mtp)
proposes k tokens from the target's final-norm hidden states.

Per request the drafter keeps a view: the head's KV pages (a page pool of its own, like the
draft model's), how many committed positions the head has processed, and the committed
(hidden state, next token) pairs it has not processed yet. The pairs come from the target's
verify forwards: SpecDecoder hands over the hidden states of every verified row (`observe`);
once the engine knows how many tokens a request kept, those rows become committed pairs
(`commit`): row i of a verify at position p + i pairs with the token now at p + i + 1.

propose, for a request whose last token x0 sits at position p:
    1. its pending pairs (h_t, x_{t+1}), t <= p - 1, run through the head as one chunk over its
       KV (positions below the committed count only ever hold committed inputs);
    2. the head state at p - 1 gives d1 (the token at p + 1); step j >= 2 feeds (the head state
       of step j - 1, d_{j-1}) at the next position, reusing the one head layer (as vLLM and
       SGLang do). These speculative KV rows lie past the committed count: the next propose
       overwrites them with committed inputs before anything reads them, so a rejected draft
       leaves nothing behind. The target itself rolls back through its slots / replay.

What the head does not see: positions before a request's first speculative step (the prompt's
hidden states stay inside the plain prefill forward), so its attention starts there (at
relative positions: RoPE scores depend on distances only), and that first step drafts nothing.
Also a verify that ran as a CUDA graph returns no hidden states (EngineConfig runs MTP eagerly).
Outputs are exact either way: the target verifies every draft.
"""

from __future__ import annotations

import torch

from hyla.contract import ForwardBatch
from hyla.engine.pools import PagePool
from hyla.engine.sampler import distribution
from hyla.engine.spec_decode import Drafter


class _View:
    """One request's head state: KV rows for target positions start .. start + done - 1, and the
    committed pairs after them not yet run, in chunks (hidden [n, hidden], the n tokens at the
    next positions). generation: the request's preemption count when the view began (a
    preempted request loses its KV: its view starts over)."""

    def __init__(self, start: int, generation: int):
        self.start, self.done, self.generation = start, 0, generation
        self.pages: list[int] = []
        self.pending: list[tuple[torch.Tensor, list[int]]] = []

    @property
    def num_pending(self) -> int:
        return sum(len(t) for _, t in self.pending)

    @property
    def next_position(self) -> int:
        """The target position the next committed pair must have."""
        return self.start + self.done + self.num_pending


class MTPDrafter(Drafter):
    needs_hidden = True

    def __init__(self, cfg, *, max_num_seqs: int, max_model_len: int, page_size: int):
        self.k, self.path, self.page_size = cfg.num_speculative_tokens, cfg.model, page_size
        self.num_pages = max_num_seqs * -(-(max_model_len + self.k) // page_size)
        self.views: dict[str, _View] = {}
        self._seen: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (x0's position, its verify rows)

    def bind(self, runner) -> None:
        """Load the head from the target checkpoint, beside runner.model (whose embeddings,
        lm_head, dtype and device it shares)."""
        from hyla.models.qwen3_5_mtp import load_mtp_head

        model = self.model = runner.model
        self.head = load_mtp_head(self.path, model)
        if len(self.head.layers) != 1:
            raise ValueError(f"the MTP head of {self.path} has {len(self.head.layers)} layers; hyla drafts with one")
        self.pages = PagePool(self.num_pages)
        self.kv = self.head.allocate_kv(self.num_pages, self.page_size)

    # -- what the target's verify steps hand over -------------------------------------------

    def observe(self, seqs, positions: list[int], counts: list[int], hidden: torch.Tensor) -> None:
        """hidden: [sum(counts), hidden] the rows of seqs[i] at positions[i] .. + counts[i] - 1."""
        start = 0
        for seq, p, n in zip(seqs, positions, counts):
            self._seen[seq.request_id] = (p, hidden[start : start + n])
            start += n

    def commit(self, seqs, kept: list[int]) -> None:
        """seqs[i] kept the first kept[i] of its observed rows (a verify: the tokens it accepted,
        already appended to its token_ids; a prefill chunk: all of them). Row j at position
        p + j pairs with the token now at p + j + 1; a row whose next token does not exist yet
        (none: the engine commits after sampling) is dropped."""
        for seq, n in zip(seqs, kept):
            seen = self._seen.pop(seq.request_id, None)
            if seen is None:
                continue
            p, rows = seen
            n = min(n, len(rows), len(seq.token_ids) - 1 - p)
            view = self.views.get(seq.request_id)
            if view is None or view.next_position != p or view.generation != seq.num_preemptions:
                self.release(seq)  # its first rows, or the request was recomputed: start over at p
                view = self.views[seq.request_id] = _View(p, seq.num_preemptions)
            if n > 0:
                view.pending.append((rows[:n], seq.token_ids[p + 1 : p + 1 + n]))

    def release(self, seq) -> None:
        view = self.views.pop(seq.request_id, None)
        if view is not None:
            self.pages.release(view.pages)
        self._seen.pop(seq.request_id, None)

    # -- drafting -------------------------------------------------------------------------

    def _ready(self, seq, k: int) -> _View | None:
        """seq's view when it can draft now: pending pairs reaching its last token, and pages for
        every row this propose writes (taken here)."""
        view = self.views.get(seq.request_id)
        if not k or view is None or not view.pending or view.next_position != len(seq.token_ids) - 1:
            return None
        need = -(-(view.done + view.num_pending + self.k - 1) // self.page_size) - len(view.pages)
        if need > self.pages.num_free:
            return None
        view.pages += self.pages.allocate(max(0, need))
        return view

    def _run(self, hidden: torch.Tensor, ids: list[int], views: list[_View], seq_lens: list[int],
             context: list[int]) -> torch.Tensor:
        batch = ForwardBatch.build(seq_lens=seq_lens, context_lens=context, block_tables=[v.pages for v in views],
                                   state_slots=[0] * len(views), device=hidden.device)
        ids_t = torch.tensor(ids, dtype=torch.long, device=hidden.device)
        return self.head.forward_batch(hidden, ids_t, self.model, batch, self.kv)

    @torch.inference_mode()
    def propose(self, seqs, ks: list[int], generator: torch.Generator | None = None
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        """-> per sequence (drafts, q [len(drafts), V] or None for greedy requests), drawn as the
        draft-model drafter draws them."""
        results: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in seqs]
        live = [(i, v) for i, (seq, k) in enumerate(zip(seqs, ks)) if (v := self._ready(seq, k)) is not None]
        if not live:
            return results
        views = [v for _, v in live]
        lens = [v.num_pending for v in views]
        y = self._run(torch.cat([h for v in views for h, _ in v.pending]), [t for v in views for _, ts in v.pending
                                                                          for t in ts], views, lens,
                      [v.done for v in views])
        y = y[torch.tensor(lens, device=y.device).cumsum(0) - 1]  # each chunk's last row: position p - 1
        for v in views:
            v.done += v.num_pending
            v.pending = []
        steps = max(ks[i] for i, _ in live)
        drafts, probs = [[] for _ in live], [[] for _ in live]
        for step in range(steps):
            logits = self.model.compute_logits(y)
            for j, (i, _) in enumerate(live):
                seq = seqs[i]
                if seq.params.greedy:
                    drafts[j].append(int(logits[j].argmax()))
                else:
                    q = distribution(logits[j], seq.params)
                    gen = seq.generator if seq.generator is not None else generator
                    drafts[j].append(int(torch.multinomial(q, 1, generator=gen)))
                    probs[j].append(q)
            if step + 1 < steps:  # (head state, newest draft) at the next position, past the committed rows
                y = self._run(y, [d[-1] for d in drafts], views, [1] * len(views), [v.done + step for v in views])
        for j, (i, _) in enumerate(live):
            results[i] = (drafts[j][: ks[i]], torch.stack(probs[j][: ks[i]]) if probs[j] else None)
        return results
