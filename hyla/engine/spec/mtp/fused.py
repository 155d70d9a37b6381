"""MTP's fused greedy step: the verify forward, the acceptance, the head's catch-up and the next
step's draft chain in ONE CUDA graph, with one readback.

A speculative step of the unfused path runs, for a greedy batch: the head's catch-up over the
previous verify's kept rows (one head graph), the k - 1 chained draft steps (a second graph,
one copy of the drafts to the host), the verify (a third graph, its logits to the host), then
the acceptance on the host. For a tiny model every one of those replays and syncs costs more
than its kernels. When the acceptance is a plain argmax comparison (`argmax_accepts`), the
head's inputs for the next step are known on the device as soon as the verify's logits are:
the token after verify row i is the target's argmax a_i for every kept row i <= n (n: the
drafts accepted; the drafts d_1 .. d_n equal a_0 .. a_{n-1} and a_n is the bonus token). So the
graph goes on, with no host sync in between:

    verify forward            -> logits [bs, W, V], hidden [bs, W, hidden]   (W = 1 + k)
    a = argmax(logits)        -> [bs, W]
    n = cumprod(d_i == a_{i-1}).sum()  (missing drafts are -1: never equal)  -> [bs]
                                 (hyla.engine.spec.acceptance.accepted_drafts: the greedy
                                 acceptance rule's device form)
    head over all W rows (h_i, a_i) at head rows done .. done + W - 1        -> head states [bs, W, hidden]
    head state at row n       -> d'_1 = argmax(its logits); d'_2 .. d'_k: one-row head steps at
                                 head rows done + n + 1 .., each step's argmax feeding the next
    readback (a [N, W], n [N], d' [N, k]): ONE copy

Rows n + 1 .. W - 1 of the head's catch-up are garbage (their input token is not the one that
follows), as are the chain's rows: all lie past the committed head rows (done + n + 1 after the
step), so the next catch-up overwrites them before anything reads them, exactly like the
speculative rows of the unfused path. The chain's rows past the pages reserved for this verify
land in the head's scratch page (block table -1): they shape only the drafts d'_2 .., which the
target verifies anyway.

Host bookkeeping (`commit`): when the engine keeps all n + 1 tokens, the head has consumed
the pairs of rows 0 .. n: the view's `done` advances by n + 1 (no pending pairs) and d' is kept
as the view's `prefetched` drafts, which the next propose returns without running the head
(cut to what the request asks for then). When the request keeps fewer (it finished mid-step)
the drafts are dropped and the kept rows become pending pairs, as after an unfused verify: the
next propose, if any, runs the normal path.

FusedVerify is the MTP drafter's graph extension (hyla.engine.spec.protocol.GraphExtension):
SpecDecoder asks it for a step's extension (`extend`), runs the verify with it
(ModelRunner.execute(plan, extension=...)), and hands the launched step back (`launched` -> a Flight,
`collect`). Launch and readback are separate: the packed rows travel to pinned host memory in
one asynchronous copy enqueued right behind the replay, so a further step may be launched before
they are read (hyla.engine.spec.mtp.overlap; its inputs derived on the device from this step's
outputs by DerivedExtension).

When it applies (`extend`, else None and SpecDecoder runs the unfused step): CUDA graphs on, no
tensor parallelism, every request argmax-accepting (greedy, no grammar, no penalties or logit
bias) and asking no logprobs, every request's view having consumed everything before its last
token (after any propose that drafted for it, or a prefetch), and the verify running padded in
a graph. On the CPU (capture off) the same function runs eagerly on the same buffers: what the
CPU tests check is exactly what the graph captures.
"""

from __future__ import annotations

import itertools

import torch

from hyla.engine.cuda_graph import width_bucket
from hyla.engine.cuda_graph_verify import HeadStepGraphs, _table_row, _verify_pad_row
from hyla.engine.sequence import Status
from hyla.engine.spec.acceptance import Verified, accepted_drafts, argmax_accepts
from hyla.engine.spec.protocol import GraphExtension
from hyla.ops import constants, dispatch
from hyla.ops.transfer import fill_long


def _pad_row(k: int, width: int) -> list[int]:
    """A padding row of FusedVerify.meta: no context, no drafts, no pages (writes go to scratch)."""
    return [0] + [-1] * k + [-1] * width


class FusedVerify(GraphExtension):
    """The fused steps' head-side inputs and graphs' extension (see the module docstring), for
    `drafter` (the MTPDrafter whose head it runs). `meta[width] [max_batch, 1 + k + width]`
    holds per request its head context (the view's done), the k drafts (-1 past its drafts: no
    argmax equals it, so the acceptance needs no count of them) and the head's block table."""

    def __init__(self, steps: HeadStepGraphs, k: int, drafter):
        self.steps, self.k, self.drafter = steps, k, drafter
        self.meta: dict[int, torch.Tensor] = {}
        self.runs = 0  # fused steps run (the tests assert the path was taken)
        self.readback = Readback()
        self.derive = DeriveGraphs()

    # -- the graph extension SpecDecoder drives (hyla.engine.spec.protocol.GraphExtension) -------

    def extend(self, seqs, drafts: list[list[int]], pad_to: int) -> _Extension | None:
        """The fused step's extension of this verify, None when it does not apply (see the module
        docstring; the verify's own graph is the runner's to decide: ModelRunner.execute)."""
        drafter = self.drafter
        if (drafter.group is not None or pad_to != 1 + self.k
                or not all(argmax_accepts(s) and s.params.logprobs is None for s in seqs)):
            return None
        views = []
        for seq in seqs:
            view = drafter.views.get(seq.request_id)
            if view is None or view.pending or not view.at(seq, seq.num_computed_tokens):
                return None  # its head has not consumed everything before x0: the unfused path
            views.append(view)
        return self.extension([v.done for v in views], drafts, [drafter._pages(s, v) for s, v in zip(seqs, views)])

    def launched(self, seqs, drafts: list[list[int]] | None, outputs: tuple, pad_to: int) -> Flight:
        return Flight(seqs, drafts, outputs, pad_to, self.readback)

    def collect(self, flight: Flight) -> list[Verified | None]:
        """Wait for a launched fused step's readback -> its Verified results (the host state of
        its requests must be where the step started: nothing of it committed yet), None for a
        request that finished before it (its row was padding); the next drafts are kept in the
        drafter's `_fused` until commit."""
        if flight.ready is not None:
            flight.ready.synchronize()
        host = flight.host.tolist()  # the step's one readback
        W, k = flight.W, flight.W - 1
        self.runs += 1
        results = []
        for i, (seq, row) in enumerate(zip(flight.seqs, host)):
            if seq.status is not Status.RUNNING:  # it finished in the step before: a padding row here
                results.append(None)
                continue
            acc = row[W]  # the drafts accepted on the device (accepted_drafts): the tokens kept are row[:acc + 1]
            self.drafter._fused[seq.request_id] = FusedResult(acc, row[W + 1:], flight.hidden[i],
                                                              seq.num_computed_tokens, seq.num_preemptions)
            drafted = k if flight.drafts is None else len(flight.drafts[i])
            results.append(Verified(row[:acc + 1], flight.logits[i, :1 + drafted], drafted, in_graph=True))
        return results

    # -- the fused step's parts -----------------------------------------------------------------

    def extension(self, done: list[int], drafts: list[list[int]], tables: list[list[int]]) -> _Extension:
        """The head's part of one fused step for N requests: done[n] head rows already in
        tables[n], drafts[n] the tokens this verify checks."""
        graphs, k = self.steps.graphs, self.k
        bs = next(b for b in graphs.buckets if b >= len(done))
        # the catch-up writes head rows done .. done + k, the chain up to done + 2k - 1
        width = width_bucket(max(-(-(c + 2 * k) // self.steps.page_size) for c in done))
        rows = [[c] + list(d) + [-1] * (k - len(d)) + _table_row(t, width)
                for c, d, t in zip(done, drafts, tables)]
        rows += [_pad_row(k, width)] * (bs - len(done))
        if width not in self.meta:
            self.meta[width] = torch.zeros(graphs.max_batch, 1 + k + width, dtype=torch.long, device=graphs.device)
        return _Extension(self, bs, width, rows)

    def forward(self, bs: int, width: int, logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The device part after the verify forward: logits [bs, W, V], hidden [bs, W, hidden]
        -> packed [bs, W + 1 + k] int64: the argmax a [W], the drafts accepted n, the next
        drafts d' [k]. Nothing reads the host: capturable."""
        steps, k, W = self.steps, self.k, self.k + 1
        meta = self.meta[width][:bs]
        ctx, drafts, tables = meta[:, 0], meta[:, 1:1 + k], meta[:, 1 + k:]
        top = logits.argmax(-1)  # [bs, W]
        n = accepted_drafts(top, drafts)  # [bs]: the acceptance rule's device form
        y = steps.head.forward_batch(hidden.reshape(bs * W, -1).to(steps.hidden.dtype), top.reshape(-1), steps.model,
                                     steps.rows_batch(ctx, tables, W), steps.kv).view(bs, W, -1)
        y = y[constants.arange(bs, y.device), n]  # the head state at each request's newest kept row
        first = steps.model.greedy_tokens(y)
        # the head's context after the step: rows done .. done + n are committed
        nxt = [first, *steps.chain_steps(y, first, ctx + n + 1, tables, k - 1)]
        return torch.cat([top, n[:, None], *(d[:, None] for d in nxt)], 1)


class _Extension:
    """One fused step's extension of the verify graph (CUDAGraphRunner.replay_verify's protocol:
    tag, pad, fill, forward)."""

    def __init__(self, fused: FusedVerify, bs: int, width: int, rows: list[list[int]]):
        self.fused, self.bs, self.width, self.rows = fused, bs, width, rows
        self.tag = ("mtp", width)

    def pad(self) -> None:
        """Padding rows before a capture's warm-up: every head write lands in the scratch page."""
        meta = self.fused.meta[self.width]
        meta[:self.bs] = torch.tensor(_pad_row(self.fused.k, self.width), device=meta.device)

    def fill(self, vmeta: torch.Tensor, rows: list[list[int]]) -> None:
        """Write the step's inputs: the verify rows `rows` into vmeta [bs, VW] (the verify
        graph's input buffer) and this extension's head rows."""
        fill_long(vmeta, rows)
        fill_long(self.fused.meta[self.width][:self.bs], self.rows)

    def forward(self, logits: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.fused.forward(self.bs, self.width, logits, hidden),)


class FusedResult:
    """What commit needs of a request's fused step: the drafts it accepted, the next drafts,
    the verify's hidden rows [W, hidden] (a view of the graph's buffer: used, copied, before
    the next replay), the position of x0 and the request's preemption count."""

    __slots__ = ("accepted", "drafts", "hidden", "position", "generation")

    def __init__(self, accepted: int, drafts: list[int], hidden: torch.Tensor, position: int, generation: int):
        self.accepted, self.drafts, self.hidden = accepted, drafts, hidden
        self.position, self.generation = position, generation


class Flight:
    """One launched fused step whose readback the host has not read yet: seqs in row order,
    the graph's outputs (logits [bs, W, V], hidden [bs, W, hidden], packed [bs, W + 1 + k]:
    views of its buffers, overwritten by the next replay of the same graph) and the packed rows
    of seqs on their way to the host (one asynchronous copy, enqueued right after the replay,
    so that a later step's replay cannot overwrite them first), into one of `readback`'s
    pinned buffers."""

    def __init__(self, seqs, drafts: list[list[int]] | None, out: tuple, W: int, readback: Readback):
        self.seqs, self.drafts, self.W = list(seqs), drafts, W
        self.logits, self.hidden, self.packed = out
        n = len(self.seqs)
        if self.packed.device.type == "cuda":
            self.host, self.ready = readback.take(self.packed[:n].shape)
            self.host.copy_(self.packed[:n], non_blocking=True)
            self.ready.record()
        else:  # eager on the CPU: computed already
            self.host, self.ready = self.packed[:n].clone(), None


class Readback:
    """Pinned host buffers (and their CUDA events) for the flights' readbacks, reused round
    robin per shape instead of a pinned allocation and an event per step. Safe with DEPTH
    buffers per shape: at most two flights are alive at once (the one being read and the one
    launched behind it, hyla.engine.spec.mtp.overlap), and a flight's buffer is read before the
    flight is dropped."""

    DEPTH = 3

    def __init__(self):
        self._rings: dict[tuple, itertools.cycle] = {}

    def take(self, shape: torch.Size) -> tuple[torch.Tensor, torch.cuda.Event]:
        key = tuple(shape)
        if key not in self._rings:
            self._rings[key] = itertools.cycle([(torch.empty(key, dtype=torch.long, pin_memory=True),
                                                 torch.cuda.Event()) for _ in range(self.DEPTH)])
        return next(self._rings[key])


class DerivedExtension(_Extension):
    """The extension of a fused step launched before the previous fused step's readback
    (`derive`): its inputs come from that step's outputs on the device. The host knows the slots,
    block tables, the base context and head rows (the requests' state before the previous step)
    and the stop ids; `fill` stages them in one transfer, then one small graph (DeriveGraphs)
    copies them into the step's buffers and writes, per request, the context and head rows
    advanced by the previous step's kept tokens, the accepted count (its slot), the tokens
    [bonus, d'] and the drafts d'; a request whose kept tokens hold one of its stop tokens becomes
    a padding row (it finished there: nothing of it may be written). The rule is one op,
    dispatch.derive_step_rows (hyla.ops.step_rows)."""

    def __init__(self, fused: FusedVerify, bs: int, width: int, rows: list[list[int]], graphs,
                 prev: torch.Tensor, base: list[list[int]], replay: bool):
        """graphs: the CUDAGraphRunner; prev: the previous step's packed outputs; base[n]:
        [context + 1, head rows + 1, stop ids (-1: none)] before the previous step; replay:
        rollback "replay" (the previous step's commit runs on the device, from the kept counts
        derived here, before this step's verify)."""
        super().__init__(fused, bs, width, rows)
        self.graphs, self.prev, self.base, self.replay = graphs, prev, base, replay

    def fill(self, vmeta: torch.Tensor, rows: list[list[int]]) -> None:
        em = self.fused.meta[self.width][:self.bs]
        kept = self.graphs.accepted[:self.bs] if self.replay else None
        self.fused.derive.run(self.graphs, vmeta, rows, em, self.rows, self.base, self.prev, kept)
        if self.replay:
            self.graphs.replay_commit()


class DeriveGraphs:
    """The derivation of an overlapped step's inputs with one host-to-device copy and one graph
    replay: per key (the previous step's packed buffer, the step's verify and head buffers, the
    kept-count buffer of rollback "replay", the rows, the stop ids) a static staging buffer
    [verify rows | head rows | base rows] and a graph of (copy the staged rows into the step's
    buffers, derive_step_rows). On the host, launching the dozen small ops (or one Triton
    kernel) costs more than the GPU time they take; a replay costs one launch. With capture off
    (the CPU) the same work runs eagerly."""

    def __init__(self):
        self._steps: dict[tuple, tuple[torch.Tensor, torch.cuda.CUDAGraph | None]] = {}  # key -> staging, graph

    def run(self, runner, vmeta: torch.Tensor, vrows: list[list[int]], emeta: torch.Tensor, erows: list[list[int]],
            base: list[list[int]], prev: torch.Tensor, kept: torch.Tensor | None) -> None:
        """vmeta [bs, VW], emeta [bs, EW]: the step's buffers, to hold vrows / erows (bs rows each)
        with the first n = len(base) rows derived from prev [>= n, 2W]; kept [bs] or None."""
        n, (bs, VW), EW = len(base), vmeta.shape, emeta.shape[1]
        S = len(base[0]) - 2 if base else 0
        key = (prev.data_ptr(), vmeta.data_ptr(), emeta.data_ptr(), None if kept is None else kept.data_ptr(),
               bs, VW, EW, n, S)
        entry = self._steps.get(key)
        staged = entry[0] if entry else torch.empty(bs * (VW + EW) + n * (2 + S), dtype=torch.long,
                                                    device=vmeta.device)
        fill_long(staged, [v for r in vrows for v in r] + [v for r in erows for v in r] + [v for r in base for v in r])
        if entry is not None and entry[1] is not None:
            entry[1].replay()
            return
        k = prev.shape[1] // 2 - 1
        vpad = _device_row(_verify_pad_row(k + 1, VW - 2 * k - 4), vmeta.device)[0]
        epad = _device_row(_pad_row(k, EW - 1 - k), vmeta.device)[0]
        sv, se = staged[:bs * VW].view(bs, VW), staged[bs * VW:bs * (VW + EW)].view(bs, EW)
        sb = staged[bs * (VW + EW):].view(n, 2 + S)

        def step():
            vmeta.copy_(sv)
            emeta.copy_(se)
            dispatch.derive_step_rows(sb, prev, vmeta[:n], emeta[:n], vpad, epad, kept)

        graph = runner._capture(step)[0] if runner.capture else None
        self._steps[key] = (staged, graph)
        if graph is None:
            step()
        else:
            graph.replay()


def _device_row(values: list[int], device) -> torch.Tensor:
    """A padding row [1, len(values)] int64 on device, built once."""
    return constants.constant(("pad row", tuple(values)), device,
                              lambda d: torch.tensor([values], dtype=torch.long, device=d))


def commit_fused(drafter, seq, kept: int, result: FusedResult) -> bool:
    """commit for a request whose verify ran fused -> True when done (the head consumed the kept
    rows, the next drafts are prefetched); False: the caller commits the kept rows as pending
    pairs (drafter._seen holds them), as after an unfused verify."""
    view = drafter.views.get(seq.request_id)
    consistent = (view is not None and result.generation == seq.num_preemptions and not view.pending
                  and view.at(seq, result.position))
    if consistent and kept == result.accepted + 1:
        view.done += kept
        view.prefetched = result.drafts
        return True
    # it kept fewer (finished mid-step): the kept rows as pending pairs; the head's rows past
    # them are speculative rows, overwritten by the next catch-up before anything reads them
    drafter._seen[seq.request_id] = (result.position, result.hidden.clone())
    return False
