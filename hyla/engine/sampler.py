"""Sampler: logits -> next tokens, with penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Everything runs batched on the logits' device, with per-row parameter tensors (one host->device
copy of them per step), and exactly one device->host copy per step (`_to_host`): token ids, a
per-row failure flag and the requested logprobs, packed into one tensor.

Structured outputs: a guided row's grammar masks the tokens it does not allow (`guide_mask`)
after logit_bias and the penalties, before greedy or sampled choice; under speculative decoding
`guide_drafts` cuts a request's drafts where its grammar rejects one and gives the mask of every
verify position, which the acceptance rule applies in the same place. A grammar that waits for
the reasoning's end (Sequence.guide_pending) masks nothing until then (`pending_guide_drafts`:
from the draft after the marker on). allowed_token_ids and bad_words mask the same way
(`restrict_batch`, rows that have them only), in the plain step and in every verify position.

Draws use the exponential race: argmax(probs / E) with E ~ Exp(1) is a draw from probs, so no
torch.multinomial is needed. A seeded request draws its E from its own generator (on the device),
so it gives the same tokens whatever else is batched; the other rows share one batched draw from
the engine's generator. Logprobs are the log-softmax of the model's raw logits (before penalties
and temperature), as vLLM returns by default. `distribution` is also what speculative decoding's
acceptance rule compares drafts against.
"""

from __future__ import annotations

import torch

from hyla.ops.transfer import stage_long

# `seqs` / `seq` below: hyla.engine.sequence.Sequence, or a stand-in with the fields read (not
# imported here: the Sequence's stop rule lives in hyla.engine.spec.acceptance, which imports this).

_NEG_INF = float("-inf")


def _counts(x: torch.Tensor, ids: list[list[int]]) -> torch.Tensor:
    """How often each token id occurs in each list: [len(ids), V] in x's dtype, on x's device
    (the ids go host->device once, the counts are built there with a scatter-add)."""
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(r) for r in ids]))
    # one pinned transfer (a plain .to(device) from pageable memory waits for the stream)
    row_ids, token_ids = stage_long([rows, [t for r in ids for t in r]], x.device)
    counts = x.new_zeros(len(ids), x.shape[-1])
    return counts.index_put_((row_ids, token_ids), x.new_ones(row_ids.shape[0]), accumulate=True)


def penalize_batch(x: torch.Tensor, params: list, token_ids: list[list[int]],
                   output_ids: list[list[int]]) -> torch.Tensor:
    """logit_bias, then repetition (over token_ids: prompt + output) and presence / frequency
    (over output_ids) penalties on logits x [M, V], out of place; only the rows that need them
    are touched."""
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and token_ids[i]]
    add = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and output_ids[i]]
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if not rep and not add and not bias:
        return x
    x = x.clone()
    if bias:  # logit_bias, before the penalties (vLLM's order)
        rows, toks, vals = zip(*bias)
        dev = lambda v, dt: torch.tensor(v, dtype=dt).to(x.device, non_blocking=True)  # noqa: E731 - no sync
        x.index_put_((dev(rows, torch.long), dev(toks, torch.long)), dev(vals, x.dtype), accumulate=True)
    if rep:
        seen = _counts(x, [token_ids[i] for i in rep]) > 0
        # In fp64, the penalty within [1e-30, 1e30] (beyond, O(1..100) logits already act as the
        # limit: the seen tokens alone, or never); a row whose largest logit then passes 1e30 is
        # shifted to make it 0 (every later rule is shift-invariant): no logit overflows to inf in
        # fp32 (a penalty of 1e-300 gave NaN), and ordinary rows keep their values.
        r = torch.tensor([params[i].repetition_penalty for i in rep], dtype=torch.float64).clamp(1e-30, 1e30)
        r = r.to(x.device, non_blocking=True)[:, None]
        sub = x[rep].double()
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        top = sub.amax(-1, keepdim=True)
        x[rep] = (sub - torch.where(top > 1e30, top, 0.0)).to(x.dtype)
    if add:
        counts = _counts(x, [output_ids[i] for i in add])
        pf = torch.tensor([[params[i].presence_penalty for i in add], [params[i].frequency_penalty for i in add]],
                          device=x.device)
        x[add] -= (counts > 0) * pf[0][:, None] + counts * pf[1][:, None]
    return x


def penalize(row: torch.Tensor, params, token_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """`penalize_batch` for one row of logits [V]."""
    return penalize_batch(row[None], [params], [token_ids], [output_ids])[0]


def banned_tokens(params, output_ids: list[int]) -> list[int]:
    """The tokens bad_words forbid next after `output_ids` (vLLM's rule, over the output only):
    the last token of each of params.bad_words_token_ids whose other tokens end the output
    (a one-token word: always)."""
    out = []
    for word in params.bad_words_token_ids or ():
        n = len(word) - 1
        if n <= len(output_ids) and (n == 0 or output_ids[-n:] == word[:-1]):
            out.append(word[-1])
    return out


def restrict_batch(x: torch.Tensor, params: list, output_ids: list[list[int]]) -> torch.Tensor:
    """allowed_token_ids and bad_words on logits x [M, V], out of place: -inf on every token
    outside a row's allowed_token_ids and on the tokens its bad_words forbid after its output so
    far; rows with neither are untouched. The (row, token) pairs are gathered on the host, where
    the outputs are, and go to the device without a sync."""
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    banned = [(i, t) for i, p in enumerate(params) if p.bad_words_token_ids for t in banned_tokens(p, output_ids[i])]
    if not allowed and not banned:
        return x
    x = x.clone()

    def dev(values) -> torch.Tensor:  # host ids -> the device, without a sync
        return torch.tensor(values, dtype=torch.long).to(x.device, non_blocking=True)

    if allowed:
        ids = [params[i].allowed_token_ids for i in allowed]
        keep = torch.zeros(len(allowed), x.shape[-1], dtype=torch.bool, device=x.device)
        keep[dev([j for j, row in enumerate(ids) for _ in row]), dev([t for row in ids for t in row])] = True
        rows = dev(allowed)
        x[rows] = x[rows].masked_fill(~keep, _NEG_INF)
    if banned:
        rows, toks = zip(*banned)
        x.index_put_((dev(rows), dev(toks)), x.new_full((len(banned),), _NEG_INF))
    return x


def restrict(row: torch.Tensor, params, output_ids: list[int]) -> torch.Tensor:
    """`restrict_batch` for one row of logits [V]."""
    return restrict_batch(row[None], [params], [output_ids])[0]


def guide_mask(x: torch.Tensor, seqs: list) -> torch.Tensor:
    """Structured outputs: -inf on the tokens each guided row's grammar does not allow next, out
    of place; unguided rows are untouched, so one request's grammar never affects another's.
    The matchers fill one int32 bitmask [G, ceil(V / 32)] on the host, which goes to the device
    without a sync and is unpacked there."""
    guided = [i for i, s in enumerate(seqs) if getattr(s, "guide", None) is not None]  # rows may be light stand-ins
    if not guided:
        return x
    V = x.shape[-1]
    words = torch.full((len(guided), (V + 31) // 32), -1, dtype=torch.int32)
    for j, i in enumerate(guided):
        try:
            seqs[i].guide.fill_next_token_bitmask(words, j)
        except Exception:  # noqa: BLE001 - a broken matcher fails its own row (nothing allowed), not the step
            words[j] = 0
    allowed = unpack_bitmask(words, V, x.device)  # [G, V]
    rows = torch.tensor(guided, dtype=torch.long).to(x.device, non_blocking=True)
    x = x.clone()
    x[rows] = x[rows].masked_fill(~allowed, _NEG_INF)
    return x


def unpack_bitmask(words: torch.Tensor, V: int, device) -> torch.Tensor:
    """int32 bitmask [G, ceil(V / 32)] on the host -> allowed [G, V] bool on `device` (no sync)."""
    words = words.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :V]


def guide_drafts(guide, drafts: list[int], keep_rejected: bool, V: int) -> tuple[list[int], torch.Tensor]:
    """Speculative decoding with a grammar: walk the request's matcher over its drafts, filling
    the grammar's mask at every verify position, and cut the drafts at the first token it rejects
    (or after its stop token: nothing may follow). -> (the drafts kept, int32 bitmask
    [1 + len(kept), ceil(V / 32)] on the host: row i = the mask after kept[:i], for the acceptance
    rule). The matcher ends where it started (rolled back): the engine advances it by the tokens
    the verify step emits, as for any sampled token.

    keep_rejected: keep the rejected token as the last draft (q-drafters). The acceptance rule
    then rejects it for certain (its target probability is 0 under the mask) and draws from the
    residual max(p - q, 0), which an exact sampler needs: cutting before it would draw from p.
    A point-mass draft (prompt lookup) has residual p there, so it is cut (one verify row fewer).
    A matcher without rollback drafts nothing."""
    words = torch.full((1 + len(drafts), (V + 31) // 32), -1, dtype=torch.int32)  # rows past a cut: never read
    if not hasattr(guide, "rollback"):
        drafts = []
    cut, taken = len(drafts), 0
    try:
        for i, d in enumerate(drafts):
            guide.fill_next_token_bitmask(words, i)
            if not (int(words[i, d // 32]) >> (d % 32)) & 1 or not guide.accept_token(d):
                cut = i + 1 if keep_rejected else i
                break
            taken += 1
            if guide.is_terminated():
                cut = i + 1
                break
        else:
            guide.fill_next_token_bitmask(words, len(drafts))
    finally:
        if taken:
            guide.rollback(taken)
    return drafts[:cut], words[: 1 + cut]


def pending_guide_drafts(seq, drafts: list[int], keep_rejected: bool, V: int
                         ) -> tuple[list[int], torch.Tensor | None]:
    """`guide_drafts` for a sequence whose grammar waits for the reasoning end marker
    (seq.guide_pending): the drafts up to the one completing the marker are unmasked (rows of
    every bit set), those after it walk the grammar from its start, as they will once the marker
    is emitted. Drafts that do not complete the marker: all kept, no mask (None)."""
    n = seq.guide_waits_for(drafts)
    if n is None:
        return drafts, None
    kept, words = guide_drafts(seq.guide_pending, drafts[n:], keep_rejected, V)
    return drafts[:n] + kept, torch.cat([torch.full((n, words.shape[1]), -1, dtype=torch.int32), words])


def probs_batch(x: torch.Tensor, params: list) -> torch.Tensor:
    """The distributions non-greedy rows sample from: penalised logits [M, V] -> probs [M, V]
    (temperature, then what top-k, top-p and min-p exclude masked out), batched over rows with
    different settings."""
    V = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]  # V: no top-k for that row
    t, k, top_p, min_p = torch.tensor([[p.temperature for p in params], ks, [p.top_p for p in params],
                                       [p.min_p for p in params]], dtype=torch.float32, device=x.device)
    # shifted so that each row's largest logit is 0 before the division: a temperature near 0
    # (or a huge logit) then sends the others to -inf, never the largest to inf
    x = x.float()
    x = (x - x.amax(-1, keepdim=True)) / t[:, None]
    use_k, use_p = min(ks) < V, any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        # Top-p needs the whole row sorted; top-k alone only the largest max(k) of it.
        vals, order = x.sort(-1, descending=True) if use_p else x.topk(max(kk for kk in ks if kk < V), -1)
        kth = vals.gather(1, (k.long().clamp(max=vals.shape[-1]) - 1)[:, None])  # [M, 1]
        if not use_p:
            kth = kth.masked_fill(k[:, None] >= V, _NEG_INF)  # rows without top-k keep everything
        x = x.masked_fill(x < kth, _NEG_INF)  # ties with the k-th value stay, as torch.topk's cut
        if use_p:
            probs = vals.masked_fill(vals < kth, _NEG_INF).softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p < 1.0)[:, None]
            drop[:, 0] = False  # also when top_p is below the smallest fp32 value (1e-300 -> 0)
            x = x.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), _NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), _NEG_INF)
    return x.softmax(-1)


def distribution(row: torch.Tensor, params) -> torch.Tensor:
    """The distribution a (non-greedy) request samples from: penalised logits [V] -> probs [V]."""
    return probs_batch(row[None], [params])[0]


def choose(row: torch.Tensor, params, generator: torch.Generator) -> int:
    """One token from penalised logits [V]: argmax when greedy, else a draw from `distribution`
    (generator on row's device)."""
    if params.greedy:
        return int(row.argmax())
    return int(torch.multinomial(distribution(row, params), 1, generator=generator))


def token_logprobs(raw_row: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """{token: logprob} for the emitted token and the top-n of one raw logits row [V]."""
    lp = torch.log_softmax(raw_row.float(), dim=-1)
    top = torch.topk(lp, min(n, lp.shape[-1]))
    vals = torch.cat([lp[token : token + 1], top.values, top.indices.to(lp.dtype)]).tolist()  # one copy
    n = len(top.values)
    return {token: vals[0], **{int(t): v for t, v in zip(vals[1 + n :], vals[1 : 1 + n])}}


def prompt_logprobs(rows: torch.Tensor, tokens: list[int], n: int,
                    block: int = 1024) -> tuple[list[dict[int, float]], list[int]]:
    """({token: logprob} of tokens[i] and the top-n under rows[i] (raw logits [R, V]), the rank
    of tokens[i] there: how many tokens have a logprob >= its own, itself included, as vLLM
    counts) for every row: token_logprobs over many rows with one device-to-host copy per block
    of rows (a prompt's worth of rows would otherwise copy once each); fp32 log-softmax a block
    at a time."""
    out, ranks = [], []
    for start in range(0, rows.shape[0], block):
        lp = torch.log_softmax(rows[start:start + block].float(), dim=-1)
        picked = torch.tensor(tokens[start:start + block], device=lp.device)
        own = lp.gather(1, picked[:, None])[:, 0]
        rank = (lp >= own[:, None]).sum(-1).to(lp.dtype)  # exact in fp32 below 2^24 (any vocabulary)
        top = torch.topk(lp, min(n, lp.shape[-1]), dim=-1)
        host = torch.cat([own[:, None], rank[:, None], top.values, top.indices.to(lp.dtype)], dim=1).tolist()
        k = top.values.shape[1]
        for token, row in zip(tokens[start:start + block], host):
            out.append({token: row[0], **{int(t): v for t, v in zip(row[2 + k:], row[2:2 + k])}})
            ranks.append(int(row[1]))
    return out, ranks


def _draw(probs: torch.Tensor, gens: list, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [m, V] -> [m], by the exponential race. Row j's E comes from
    gens[j] when it has one, else from one batched draw from `generator` for all such rows."""
    e = torch.empty_like(probs)
    free = [j for j, g in enumerate(gens) if g is None]
    if len(free) == len(gens):
        e.exponential_(generator=generator)
    elif free:
        e[free] = e.new_empty(len(free), probs.shape[-1]).exponential_(generator=generator)
    for j, g in enumerate(gens):
        if g is not None:
            e[j].exponential_(generator=g)
    # An exact 0 from exponential_ would make 0 / 0 = nan, which argmax would pick.
    return (probs / e.clamp_min_(torch.finfo(e.dtype).tiny)).argmax(-1)


def _sample_on_device(logits: torch.Tensor, seqs: list, generator: torch.Generator):
    """Everything but the host copy. -> (packed [2M + L(1 + 2n)] float64 on the device, L rows'
    indices, n): tokens [M], failed [M], then for the L rows that want logprobs: the sampled
    token's logprob [L], the top-n values [L, n] and their ids [L, n]."""
    params = [s.params for s in seqs]
    raw = logits.float()
    hist = [s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]
    x = penalize_batch(raw, params, hist, [s.output_token_ids for s in seqs])
    x = guide_mask(x, seqs)  # after logit_bias and the penalties, before any sampling rule (greedy too)
    x = restrict_batch(x, params, [s.output_token_ids for s in seqs])  # allowed_token_ids, bad_words
    greedy = argmax_ids(x)  # the greedy rows' answer, -1 where it failed; sampled rows are overwritten below
    failed = greedy < 0
    tokens = greedy.clamp_(min=0)  # a failed row's id stays a valid index (its logprobs gather below)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        rows = slice(None) if len(drawn) == len(seqs) else drawn
        probs = probs_batch(x[rows], [params[i] for i in drawn])
        tokens[rows] = _draw(probs, [seqs[i].generator for i in drawn], generator)
        failed[rows] |= ~torch.isfinite(probs).all(-1)  # e.g. temperature scaling overflowed
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    pieces, n = [tokens, failed], 0
    if want:
        lp = torch.log_softmax(raw[want], -1)
        pieces.append(lp.gather(1, tokens[want][:, None])[:, 0])
        n = min(max(params[i].logprobs for i in want), lp.shape[-1])
        if n:
            top = lp.topk(n, -1)
            pieces += [top.values.flatten(), top.indices.flatten()]
    return torch.cat([p.double() for p in pieces]), want, n


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [M, V] -> [M] int64: each row's argmax (the first of equal maxima), -1 where the
    row's largest value is not finite (nan counts as the largest): a greedy row's draw as
    `sample` makes it (a failed draw for -1), in one pass over the logits. A decode graph
    computes it beside its logits (PendingSample's `argmax`)."""
    top, index = logits.max(-1)
    return index.masked_fill_(top * 0 != 0, -1)  # x * 0 is nan exactly when x is nan or +-inf


def _to_host(packed: torch.Tensor) -> list[float]:
    """The step's one device->host copy."""
    return packed.tolist()


class PendingSample:
    """A step's draws, on the device and on their way to the host: `tokens` [M] (int64, on the
    device: what an overlapped next step feeds, hyla.engine.overlap; -1 where a draw taken from
    `argmax` failed) and `failed` [M] (bool, or None when -1 in `tokens` says it); `result()`
    waits for the copy and returns what `sample` returns. On CUDA the copy goes into pinned
    memory behind an event, so the host can queue more work before it waits.

    argmax: [M] int64, the rows' argmax with -1 where a row's largest logit is not finite (a
    decode graph's StepResult.argmax), given when every row's draw is exactly that (the caller
    checked hyla.engine.spec.acceptance.argmax_draws): the draws are then these ids, with no
    sampler pass over the logits (one copy to the host)."""

    def __init__(self, logits: torch.Tensor, seqs: list, generator: torch.Generator,
                 argmax: torch.Tensor | None = None):
        self.seqs = seqs
        M = len(seqs)
        if argmax is not None:  # a view of a graph's buffer, which the next step overwrites:
            # on CUDA the copy below is queued before that step; elsewhere a copy is taken now
            self.packed = argmax if argmax.device.type == "cuda" else argmax.clone()
            self.want, self.n = None, 0
            self.tokens, self.failed = self.packed, None
        else:
            self.packed, self.want, self.n = _sample_on_device(logits, seqs, generator)
            self.tokens = self.packed[:M].long()
            self.failed = self.packed[M:2 * M] != 0
        self.event = None
        if self.packed.device.type == "cuda":
            host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            host.copy_(self.packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
            self.packed = host

    def result(self) -> tuple[list, list]:
        if self.event is not None:
            self.event.synchronize()
        host = _to_host(self.packed)
        if self.want is None:  # argmax ids, -1 failed
            return ([t if t >= 0 else None for t in host],
                    [None if t >= 0 else _draw_failed() for t in host])
        return _unpack(host, self.seqs, self.want, self.n)


def sample(logits: torch.Tensor, seqs: list, generator: torch.Generator) -> tuple[list, list]:
    """logits: [M, V] for M sequences, on the model's device (generator and the seeded sequences'
    generators on that device too) -> (token ids [M], per-row logprob dicts or None). A row
    whose logits are not finite, or whose distribution is not valid, gets token None and the
    exception in place of its logprobs; the other rows are unaffected."""
    return PendingSample(logits, seqs, generator).result()


def _unpack(host: list[float], seqs: list, want: list[int], n: int) -> tuple[list, list]:
    """_sample_on_device's packed values, on the host -> sample's (tokens, logprobs)."""
    M, L = len(seqs), len(want)
    tokens = [int(t) for t in host[:M]]
    logprobs: list = [None] * M
    vals, ids = host[2 * M + L : 2 * M + L + L * n], host[2 * M + L + L * n :]
    for j, i in enumerate(want):
        top = slice(j * n, j * n + min(seqs[i].params.logprobs, n))  # this row's own n of the batch's max
        logprobs[i] = {tokens[i]: host[2 * M + j], **{int(t): v for t, v in zip(ids[top], vals[top])}}
    for i in range(M):
        if host[M + i]:
            tokens[i] = None
            logprobs[i] = _draw_failed()
    return tokens, logprobs


def _draw_failed() -> RuntimeError:
    return RuntimeError("the logits are not finite (nan / inf, or no finite entry) or do not "
                        "give a valid sampling distribution")
