"""MTP drafter: the target checkpoint's own multi-token-prediction head (loaded by the model's
family: HybridForCausalLM.load_mtp_head, e.g. hyla.models.qwen3_5_mtp) proposes k tokens from
the target's final-norm hidden states.

What the head reads. Every target forward of a request hands the drafter the final-norm hidden
states of its rows (`observe`): prefill chunks and verify steps (ModelRunner.execute with
return_hidden; a verify eager or in a CUDA graph, whose hidden-state output buffer is sliced like
its logits). Once the engine knows which tokens follow those rows (`commit`: after a prefill
step sampled, after a verify step kept n tokens) they become committed pairs: row i at
position p + i pairs with the token now at p + i + 1 (the last prompt row with the first
sampled token; a verify's n kept rows with the n tokens kept), so the head's context covers the
prompt and a request's first speculative step already drafts. After a prefill step (`commit`
with prefill) the head runs that step's pairs at once (`catch_up`, all but the newest, which
propose starts from): a long prompt's head work is spread over its chunks as the target's is.

Where its KV lives: in the engine's page pool, addressed by the request's own block table (the
same page ids as the target; the head's attention layer is one more layer's worth of bytes per
page, counted in the engine's memory budget through `kv_bytes_per_token`; the tensors are
allocated at `bind` for every page of the runner's cache, scratch page included). Per request
the drafter keeps a view: `start`, the first position the head processed; `done`, how many
committed positions it has processed since; and the committed pairs not yet run.

Prefix cache: a request that hits L cached tokens did not recompute their hidden states, so the
head's attention for it starts at L (view start = L; RoPE scores depend on distances only, the
head runs at positions relative to start). Head row j of a view (position start + j) is stored
at row j of the block table from page start // page_size on (start % page_size rows below the
target's row of that position, in the same page or the one before): every head row lands in a page
the request owns (the hit shares only pages wholly below L; the page holding L is its own,
copy-on-write or fresh). So no head row is ever written into a page shared through the prefix
cache, and nobody reads another request's head rows (copy_page_rows copies the target's
layers only). A preempted request loses its pages: its view starts over when it is recomputed.

propose, for a request whose last token x0 sits at position p:
    1. its pending pairs (h_t, x_{t+1}), t <= p - 1, run through the head as one chunk over its
       KV (rows below start + done only ever hold committed inputs);
    2. the head state at p - 1 gives d1 (the token at p + 1); step j >= 2 feeds (the head state
       of step j - 1, d_{j-1}) at the next position, reusing the one head layer (as vLLM and
       SGLang do), for requests that asked for j drafts or more. These speculative rows (at most
       position p + k - 2, inside the pages the Scheduler reserved for the verify) lie past the
       committed ones: the next propose overwrites them with committed inputs before anything
       reads them, so a rejected draft leaves nothing behind. The target itself rolls back
       through its slots / replay.
With CUDA graphs on in the runner, both steps replay graphs (hyla.engine.cuda_graph_verify.
HeadStepGraphs: requests padded to a batch bucket, the head's block tables to a page width):
step 1 with 1 + k rows per request (a verify kept 1 .. 1 + k; the padding rows land past the
committed ones, like speculative rows), the steps after it with one. A prompt's chunks
(catch_up, or a step 1 with more than 1 + k pending rows) run eagerly.
When every request drafting in a propose is greedy and there is no tensor parallelism, the
steps after step 1 are chained on the device (`_chains`; HeadStepGraphs.run_chain, one graph
for all of them): each step's argmax feeds the next without a trip to the host, and the drafts
of every request come back in one copy. Every request then runs the batch's most steps; the
rows of one that asked for fewer land past its reserved positions, in its own pages or (no page
there) the scratch page, and its extra drafts are dropped. Sampling requests, and every step
under tensor parallelism or without graphs, draft one step at a time (`_stepped_drafts`).
Outputs are exact whatever the head drafts: the target verifies every draft.

Fused greedy step (hyla.engine.spec.mtp.fused.FusedVerify, the drafter's graph extension, which
SpecDecoder runs with its verify): for a batch of argmax-accepting requests (no logprobs, no
tensor parallelism, graphs on) whose views consumed everything before x0, the verify, the
acceptance, the head's catch-up over the W verify rows and the next draft chain run as one graph
with one readback; commit advances `done` by the kept n + 1 rows and keeps the next drafts as
`prefetched`, which the next propose returns without running the head. Anything else runs the
unfused path above.

Under tensor parallelism every rank holds such a drafter over its own ModelRunner (bound with the
rank's ShardPlan: the head's layer split like the target's attention layers, its KV per rank) and
runs the same calls in lockstep (hyla.parallel.drafter.TPDrafter sends them); rank 0 alone
draws the drafts and broadcasts each step's tokens, so every rank feeds its head shard the same ids.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyla.contract import ForwardBatch
from hyla.engine.cuda_graph import graph_safe
from hyla.engine.cuda_graph_verify import HeadStepGraphs
from hyla.engine.spec.mtp.fused import FusedResult, FusedVerify, commit_fused
from hyla.engine.sampler import distribution
from hyla.engine.spec.protocol import Proposer
from hyla.ops.transfer import to_device_long


class _View:
    """One request's head state: KV rows for target positions start .. start + done - 1, and the
    committed pairs after them not yet run, in chunks (hidden [n, hidden], the n tokens at the
    next positions). generation: the request's preemption count when the view began (a
    preempted request loses its KV: its view starts over). prefetched: the drafts a fused step
    (hyla.engine.spec.mtp.fused) made for the next propose, valid while nothing else is committed."""

    def __init__(self, start: int, generation: int):
        self.start, self.done, self.generation = start, 0, generation
        self.pending: list[tuple[torch.Tensor, list[int]]] = []
        self.prefetched: list[int] | None = None

    def at(self, seq, position: int) -> bool:
        """Whether this view is still seq's (no preemption since it began) and its next head row
        is the target's `position`."""
        return self.generation == seq.num_preemptions and self.next_position == position

    @property
    def num_pending(self) -> int:
        return sum(len(t) for _, t in self.pending)

    @property
    def next_position(self) -> int:
        """The target position the next committed pair must have."""
        return self.start + self.done + self.num_pending


class MTPDrafter(Proposer):
    needs_hidden = True

    def __init__(self, cfg, *, page_size: int):
        self.cfg = cfg
        self.k, self.path, self.page_size = cfg.num_speculative_tokens, cfg.model, page_size
        self.views: dict[str, _View] = {}
        self._seen: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (first row's position, rows)
        self._fused: dict[str, FusedResult] = {}  # request -> its fused verify step, until commit
        self.fused: FusedVerify | None = None  # the graph extension, when the runner has CUDA graphs (bind)
        self.leader, self.group = True, None  # tensor parallel: whether this is rank 0; the model group

    @staticmethod
    def kv_bytes_per_token(model) -> int:
        """Bytes per token of the head's one attention layer (keys + values in the model dtype):
        what each engine page holds for it, beside the target's layers."""
        return model.config.layer_sizes().kv_per_token * torch.empty((), dtype=model.dtype).element_size()

    def bind_weight_bytes(self, model) -> int:
        """The whole `mtp.*` head at the target's dtype (fp32 tensors at 4 bytes), read from the
        checkpoint's headers: an upper bound for a tensor-parallel rank, which loads a slice."""
        from safetensors import safe_open

        from hyla.models import loader

        item = torch.empty((), dtype=model.dtype).element_size()
        by_file: dict[str, list[str]] = {}
        for name, file in loader.weight_files(self.path).items():
            if name.startswith("mtp."):
                by_file.setdefault(str(file), []).append(name)
        total = 0
        for file, names in by_file.items():
            with safe_open(file, "pt") as f:
                for name in names:
                    numel = 1
                    for d in f.get_slice(name).get_shape():
                        numel *= d
                    total += numel * (4 if loader._keeps_fp32(name) else item)
        return total

    def bind(self, runner, shard=None) -> None:
        """Load the head from the target checkpoint, beside runner.model (whose embeddings,
        lm_head, dtype and device it shares), and its KV for every page of runner.cache.
        shard: the rank's tensor-parallel plan (runner.model is that rank's shard): the head is
        loaded split the same way and the drafts come from rank 0 (`_agree`). The model's family
        loads the head (HybridForCausalLM.load_mtp_head); ValueError for a family without one."""
        model = self.model = runner.model
        if shard is not None and shard.world > 1:
            self.leader, self.group = shard.rank == 0, shard.group
        self.head = model.load_mtp_head(self.path, shard=shard)
        if self.head is None:
            raise ValueError(f"speculative method 'mtp': the {type(model).__name__} family has no multi-token-"
                             "prediction head")
        if len(self.head.layers) != 1:
            raise ValueError(f"the MTP head of {self.path} has {len(self.head.layers)} layers; hyla drafts with one")
        self.kv = self.head.allocate_kv(runner.cache.num_pages, runner.cache.page_size)
        graphs = runner.graphs  # the runner's CUDA graphs (or None): the head's draft steps get some too
        self.step_graphs = (HeadStepGraphs(graphs, self.head, model, self.kv, max_width=1 + self.k)
                            if graphs is not None and graph_safe(self.head) else None)
        self.fused = FusedVerify(self.step_graphs, self.k, self) if self.step_graphs is not None else None

    @property
    def graph_extension(self) -> FusedVerify | None:
        """The protocol's optional graph extension: the fused greedy step (None without CUDA
        graphs; it declines steps it cannot take: FusedVerify.extend)."""
        return self.fused

    # -- what the target's forwards hand over ------------------------------------------------

    def observe(self, seqs, positions: list[int], counts: list[int], hidden: torch.Tensor) -> None:
        """hidden: [sum(counts), hidden] the rows of seqs[i] at positions[i] .. + counts[i] - 1."""
        start = 0
        for seq, p, n in zip(seqs, positions, counts):
            self._seen[seq.request_id] = (p, hidden[start : start + n])
            start += n

    def commit(self, seqs, kept: list[int], prefill: bool = False) -> None:
        """seqs[i] kept the first kept[i] of its observed rows (a verify: the tokens it accepted,
        already appended to its token_ids; a prefill chunk: all of them). Row j at position
        p + j pairs with the token now at p + j + 1; a row whose next token does not exist yet
        (none: the engine commits after sampling) is dropped. prefill: then `catch_up`."""
        for seq, n in zip(seqs, kept):
            fused = self._fused.pop(seq.request_id, None)
            if fused is not None and commit_fused(self, seq, n, fused):
                continue
            view = self.views.get(seq.request_id)
            if view is not None:
                view.prefetched = None  # something else is committed: the fused step's drafts are stale
            seen = self._seen.pop(seq.request_id, None)
            if seen is None:
                continue
            p, rows = seen
            n = min(n, len(rows), seq.num_tokens - 1 - p)
            view = self.views.get(seq.request_id)
            if view is None or not view.at(seq, p):
                # its first rows (p = the prefix-cache hit, or 0), or it was recomputed: start at p
                view = self.views[seq.request_id] = _View(p, seq.num_preemptions)
            if n > 0:
                view.pending.append((rows[:n], seq.token_range(p + 1, p + 1 + n)))
        if prefill:
            self.catch_up(seqs)

    @torch.inference_mode()
    def catch_up(self, seqs) -> None:
        """After a prefill step: run seqs' committed pairs through the head now, all but the newest
        (propose starts from it), so that a long prompt's head work is spread over its chunks as
        the target's is."""
        views, owners, newest = [], [], []
        for seq in seqs:
            view = self.views.get(seq.request_id)
            if view is None or view.generation != seq.num_preemptions or view.num_pending < 2:
                continue
            h, t = view.pending[-1]
            view.pending[-1:] = [(h[:-1], t[:-1])] if len(t) > 1 else []
            views.append(view)
            owners.append(seq)
            newest.append((h[-1:].clone(), t[-1:]))  # a copy: not the whole step's hidden states
        if views:
            self._catch_up(owners, views)
            for view, pair in zip(views, newest):
                view.pending = [pair]

    def release(self, seq) -> None:
        self.views.pop(seq.request_id, None)
        self._seen.pop(seq.request_id, None)
        self._fused.pop(seq.request_id, None)

    # -- drafting -------------------------------------------------------------------------

    def _ready(self, seq, k: int) -> _View | None:
        """seq's view when it can draft now: pending pairs reaching its last token."""
        view = self.views.get(seq.request_id)
        if not k or view is None or not view.pending or not view.at(seq, seq.num_tokens - 1):
            return None
        return view

    def _prefetched(self, seq) -> list[int] | None:
        """The drafts a fused step made for seq's next propose (taken: used once), when its view
        is still where that step left it (nothing pending, its last token next)."""
        view = self.views.get(seq.request_id)
        if view is None or view.prefetched is None:
            return None
        drafts, view.prefetched = view.prefetched, None
        if view.pending or not view.at(seq, seq.num_tokens - 1):
            return None
        return drafts

    def _pages(self, seq, view: _View) -> list[int]:
        """The block table the head reads and writes for seq: the request's own, from the page
        holding view.start on (head row j at its row j)."""
        return seq.block_table[view.start // self.page_size:]

    def _run(self, hidden: torch.Tensor, ids: list[int], tables: list[list[int]], seq_lens: list[int],
             context: list[int]) -> torch.Tensor:
        """hidden: [sum(seq_lens), hidden], ids: the tokens after them; context[i]: head rows
        already in tables[i] -> final-norm head states [sum(seq_lens), hidden]."""
        batch = ForwardBatch.build(seq_lens=seq_lens, context_lens=context, block_tables=tables,
                                   state_slots=[0] * len(tables), device=hidden.device)
        ids_t = to_device_long(ids, hidden.device)
        return self.head.forward_batch(hidden, ids_t, self.model, batch, self.kv)

    def _catch_up(self, seqs, views: list[_View], logits: bool = False):
        """Run every view's pending pairs as one chunk each -> the head state at each request's
        position p - 1 [len(views), hidden], and with `logits` also its logits [len(views), V]
        (then a CUDA graph when the runner has them and every chunk fits its width: after a
        verify, the 1 .. 1 + k rows it kept)."""
        lens = [v.num_pending for v in views]
        hidden = torch.cat([h for v in views for h, _ in v.pending])
        ids = [t for v in views for _, ts in v.pending for t in ts]
        tables, context = [self._pages(s, v) for s, v in zip(seqs, views)], [v.done for v in views]
        for v in views:
            v.done += v.num_pending
            v.pending = []
        if logits and self.step_graphs is not None and self.step_graphs.can_run(lens):
            return self.step_graphs.run(hidden, ids, lens, context, tables)
        y = self._run(hidden, ids, tables, lens, context)
        y = y[to_device_long(lens, y.device).cumsum(0) - 1]  # each chunk's last row
        return (y, self.model.compute_logits(y)) if logits else y

    def _step(self, y: torch.Tensor, ids: list[int], tables: list[list[int]], context: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step, a row per request: y [N, hidden] head states, ids the drafts fed with
        them at head context `context` -> (new head states [N, hidden], logits [N, V]); a CUDA
        graph when the runner has them (its output buffers: used before the next step)."""
        if self.step_graphs is not None and self.step_graphs.can_run([1] * len(ids)):
            return self.step_graphs.run(y, ids, [1] * len(ids), context, tables)
        y = self._run(y, ids, tables, [1] * len(ids), context)
        return y, self.model.compute_logits(y)

    def _chains(self, seqs, k: int) -> bool:
        """Whether seqs (the requests drafting now, the most drafts k) draft on the device:
        HeadStepGraphs.run_chain, the draft steps chained in one graph, one copy to the host.
        Every request must draft greedily (a draw needs its q and generator on the host; a
        guided request drafts as an unguided one: its grammar cuts the drafts after propose) and
        no tensor parallelism (each step's tokens are broadcast, `_agree`). A request asking for
        fewer than k drafts runs all k - 1 steps: its extra rows land past its committed ones, in
        pages it holds (overwritten before anything reads them, as any speculative row) or, past
        its block table (-1), in the scratch page; its extra drafts are dropped."""
        return (self.group is None and self.step_graphs is not None and self.step_graphs.can_chain(len(seqs), k)
                and all(seq.params.greedy for seq in seqs))

    def _draw(self, logits: torch.Tensor, seq, generator) -> tuple[int, torch.Tensor]:
        """One draft of a sampling request from logits [V]: a draw from q, returned with q [V]."""
        q = distribution(logits, seq.params)
        gen = seq.generator if seq.generator is not None else generator
        return int(torch.multinomial(q, 1, generator=gen)), q

    def _choose(self, logits: torch.Tensor, seqs: list, generator) -> tuple[list[int], list[torch.Tensor | None]]:
        """One step's drafts, a row per request: logits [len(seqs), V] -> (tokens, q [V] of each
        sampling request, None for greedy ones). Rank 0 only: it holds the requests' parameters
        and generators."""
        top = logits.argmax(-1).tolist()  # the greedy requests' drafts, in one copy to the host
        tokens, qs = [], []
        for row, seq in enumerate(seqs):
            if seq.params.greedy:
                tokens.append(top[row])
                qs.append(None)
            else:
                d, q = self._draw(logits[row], seq, generator)
                tokens.append(d)
                qs.append(q)
        return tokens, qs

    def _agree(self, tokens: list[int] | None, n: int, device: torch.device) -> list[int]:
        """The n draft tokens every rank feeds its head shard next: rank 0's (`tokens`; None on
        rank 0: its draw failed), broadcast over the model group under tensor parallelism (one
        [n] int64 tensor), so that a sampled draft, or an argmax tie broken differently, never
        splits the ranks' heads apart. A failed draw still broadcasts (-1s): the other ranks then
        raise too instead of waiting for a step rank 0 abandoned."""
        if self.group is None:
            return tokens
        if self.leader:
            t = torch.tensor(tokens if tokens is not None else [-1] * n, dtype=torch.long, device=device)
        else:
            t = torch.empty(n, dtype=torch.long, device=device)
        dist.broadcast(t, src=0, group=self.group)
        if self.leader:
            return tokens
        fed = t.tolist()
        if any(d < 0 for d in fed):
            raise RuntimeError("rank 0 failed to draw this step's drafts")
        return fed

    @torch.inference_mode()
    def propose(self, seqs, ks: list[int], generator: torch.Generator | None = None
                ) -> list[tuple[list[int], torch.Tensor | None]]:
        """-> per sequence (drafts, q [len(drafts), V] or None for greedy requests), drawn as the
        draft-model drafter draws them. Under tensor parallelism every rank runs this in
        lockstep; only rank 0's result (it drew the drafts) is meaningful."""
        results: list[tuple[list[int], torch.Tensor | None]] = [([], None) for _ in seqs]
        self._fused.clear()  # a new step: a failed step's fused results are no one's
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if (d := self._prefetched(seq)) is not None:
                results[i] = (d[:k], None)
        live = [(i, v) for i, (seq, k) in enumerate(zip(seqs, ks)) if (v := self._ready(seq, k)) is not None]
        if not live:
            return results
        idx, views = [i for i, _ in live], [v for _, v in live]
        live_seqs, live_ks = [seqs[i] for i in idx], [ks[i] for i in idx]
        y, logits = self._catch_up(live_seqs, views, logits=True)
        if self._chains(live_seqs, max(live_ks)):
            drafts = self._chained_drafts(y, logits, live_seqs, views, live_ks)
        else:
            drafts = self._stepped_drafts(y, logits, live_seqs, views, live_ks, generator)
        for i, d in zip(idx, drafts):
            results[i] = d
        return results

    def _chained_drafts(self, y: torch.Tensor, logits: torch.Tensor, seqs, views: list[_View], ks: list[int]
                        ) -> list[tuple[list[int], None]]:
        """Greedy drafts with every draft step on the device (see `_chains`): y [N, hidden],
        logits [N, V] the catch-up's -> per request (its ks[n] drafts, None)."""
        tables = [self._pages(s, v) for s, v in zip(seqs, views)]
        drafts = self.step_graphs.run_chain(y, logits, max(ks), [v.done for v in views], tables).tolist()  # one copy
        return [(d[:k], None) for d, k in zip(drafts, ks)]  # drafts past ks[n]: dropped

    def _stepped_drafts(self, y: torch.Tensor, logits: torch.Tensor, seqs, views: list[_View], ks: list[int],
                        generator) -> list[tuple[list[int], torch.Tensor | None]]:
        """Drafts one step at a time, each step's tokens chosen on the host (drawn for sampling
        requests, agreed over the ranks under tensor parallelism): y [N, hidden], logits [N, V]
        the catch-up's -> per request (its ks[n] drafts, q [ks[n], V] or None when greedy)."""
        drafts, probs = [[] for _ in seqs], [[] for _ in seqs]
        active = list(range(len(seqs)))  # rows of y: requests still drafting
        failed = None  # rank 0's draw error: raised once the other ranks know (_agree)
        for step in range(max(ks)):
            if self.leader:
                try:
                    tokens, qs = self._choose(logits, [seqs[j] for j in active], generator)
                except Exception as err:  # noqa: BLE001 - re-raised below, after the broadcast
                    failed = err
                else:
                    for j, d, q in zip(active, tokens, qs):
                        drafts[j].append(d)
                        if q is not None:
                            probs[j].append(q)
            # (head state, newest draft) at the next position, past the committed rows; only for
            # requests that draft more (their next row lies inside the pages reserved for them)
            keep = [row for row, j in enumerate(active) if ks[j] > step + 1]
            if not keep:
                break
            fed = self._agree([drafts[active[r]][-1] for r in keep] if self.leader and failed is None else None,
                              len(keep), y.device)
            if failed is not None:
                break
            active = [active[row] for row in keep]
            y, logits = self._step(y[to_device_long(keep, y.device)], fed,
                                   [self._pages(seqs[j], views[j]) for j in active],
                                   [views[j].done + step for j in active])
        if failed is not None:
            raise failed
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, probs)]
