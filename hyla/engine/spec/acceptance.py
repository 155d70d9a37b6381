"""What a step keeps of its tokens: the acceptance rule of speculative decoding (greedy and
sampled) and the stop rule, each defined here once, in its host form and, beside it, its device
form (what the fused MTP step and the step launched behind it evaluate inside a CUDA graph,
reading nothing on the host). The two forms of a rule decide the same: tests/engine/
test_stop_rule.py checks them against each other on random inputs.

    acceptance   host    accept: greedy and sampled, one request (the standard rule);
                         accept_argmax: greedy, a batch, one copy of the argmaxes to the host
                 device  accepted_drafts: greedy, the drafts equal to the target's argmax
                         (hyla.engine.spec.mtp.fused.FusedVerify.forward)
                 argmax_accepts: the requests whose acceptance is that argmax comparison
    stop rule    host    stop_ids, stopping_token, reaches_length (Sequence.check_stop, with the
                         text's stop strings and the grammar's end, which only the host sees)
                 device  device_stop_ids: the requests the device may decide and their stop ids;
                         kept_through_stop: the tokens kept up to the first stop token
                         (hyla.ops.step_rows.derive_step_rows, the overlapped MTP step's inputs)
    Verified     what one verify step yields
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.engine.sampler import choose, distribution, penalize, restrict

# The stop rule's device form: its torch definition lives beside the op that evaluates it
# (hyla.ops.step_rows.derive_step_rows, whose Triton kernel is checked bit for bit against it),
# since hyla.ops imports nothing of the engine; it is this module's rule (see below).
from hyla.ops.step_rows import kept_through_stop

__all__ = ["accept", "argmax_accepts", "accept_argmax", "accepted_drafts", "stop_ids", "stopping_token",
           "reaches_length", "device_stop_ids", "kept_through_stop", "Verified"]


def accept(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, seq, generator,
           allowed: torch.Tensor | None = None) -> list[int]:
    """The tokens a verify step appends: accepted drafts, then one token from the target.

    logits: [1 + k, V] raw target logits at x0, d1..dk; q: [k, V] draft probabilities (None: the
    drafts were certain, as from prompt lookup); allowed: [1 + k, V] bool, a guided request's
    grammar mask at each position (guide_drafts), applied where the sampler applies it, as are
    allowed_token_ids and bad_words (over the output with the drafts accepted before position i).
    Greedy: accept the longest prefix of drafts equal to the target's argmax, then emit the
    target's own token. Sampling (the standard rule, Leviathan et al. / Chen et al.):
      accept d_i with probability min(1, p(d_i) / q(d_i));
      at the first rejection emit a token drawn from normalise(max(p - q, 0)) and stop;
      if every draft is accepted, emit a bonus token drawn from p at the last position.
    p is the target's sampling distribution given the tokens so far (penalties, temperature,
    top-k / top-p / min-p), so the output is distributed exactly as non-speculative sampling.
    """
    params = seq.params
    history, out_hist = list(seq.token_ids), list(seq.output_token_ids)
    out: list[int] = []
    for i in range(len(drafts) + 1):
        row = restrict(penalize(logits[i].float(), params, history, out_hist), params, out_hist)
        if allowed is not None:  # p is the grammar-masked distribution the plain sampler draws from
            row = row.masked_fill(~allowed[i], float("-inf"))
        if i == len(drafts):
            out.append(choose(row, params, generator))
            return out
        d = drafts[i]
        if params.greedy:
            t = int(row.argmax())
            out.append(t)
            if t != d:
                return out
        else:
            p = distribution(row, params)
            if q is None:
                q_i = torch.zeros_like(p).index_fill_(0, torch.tensor([d], device=p.device), 1.0)
            else:
                q_i = q[i].to(p)
            u = torch.rand((), generator=generator, device=p.device)  # the generators live on the logits' device
            if u * q_i[d] < p[d]:  # u < p/q without dividing by a possibly tiny q
                out.append(d)
            else:
                residual = (p - q_i).clamp_min(0)
                total = residual.sum()
                residual = residual / total if total > 0 else p
                out.append(int(torch.multinomial(residual, 1, generator=generator)))
                return out
        history.append(out[-1])
        out_hist.append(out[-1])
    return out


def argmax_accepts(seq) -> bool:
    """Whether `accept` reduces to comparing drafts with the target's argmax for seq: greedy,
    no grammar (active or pending: a pending one applies from the reasoning's end, which may
    come inside the drafts), and nothing that `penalize` or `restrict` would change (no logit
    bias, no repetition, presence or frequency penalty, no allowed_token_ids or bad_words). The
    fused MTP step and its overlap take only such requests too."""
    p = seq.params
    return (p.greedy and getattr(seq, "guide", None) is None and getattr(seq, "guide_pending", None) is None
            and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and not p.logit_bias
            and p.allowed_token_ids is None and not p.bad_words)


def argmax_draws(seqs: list) -> bool:
    """Whether every seq's next token is its logits' argmax, the logits as the model gave them
    (argmax_accepts, and no logprobs asked for): a decode graph's argmax (StepResult.argmax) is
    then the step's draws, with no sampler pass (hyla.engine.sampler.PendingSample)."""
    return all(seq.params.logprobs is None and argmax_accepts(seq) for seq in seqs)


def accept_argmax(logits: torch.Tensor, drafts: list[list[int]]) -> list[list[int]]:
    """`accept` for a batch of requests for which `argmax_accepts` holds: logits [sum(1 + k_n),
    V] the verify rows of every request, packed in order; drafts[n] its k_n drafts -> the tokens
    each appends: its drafts up to the first that differs from the target's argmax, then the
    argmax there (after k_n accepted drafts: the bonus token, the argmax at the last row). One
    argmax over all rows and one copy of it to the host, for the whole batch."""
    top = logits.argmax(-1).tolist()
    out, start = [], 0
    for d in drafts:
        row = top[start : start + 1 + len(d)]
        n = next((i for i, (t, x) in enumerate(zip(row, d)) if t != x), len(d))  # drafts accepted
        out.append(row[: n + 1])
        start += 1 + len(d)
    return out


def accepted_drafts(top: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The device form of `accept_argmax` (the same rule, on padded rows): top [bs, W] the
    target's argmax at each verify row, drafts [bs, W - 1] the drafts checked (-1 past a
    request's drafts: no argmax equals it) -> [bs] int64 the drafts accepted, n: the longest
    prefix with d_i == top[i - 1]. The tokens kept are top[:, :n + 1] (the accepted drafts, then
    the target's own token). Reads nothing on the host: a CUDA graph captures it."""
    return (drafts == top[:, :drafts.shape[1]]).cumprod(-1).sum(-1)  # cumprod of bools: int64


# ---- the stop rule ---------------------------------------------------------------------------
# Host form: after each output token, in order (Sequence.check_stop): an error ends the request;
# the grammar's end (its stop token came) ends it; once the output holds at least min_tokens
# tokens, an EOS id (unless ignore_eos), a stop_token_ids id or a stop string ends it; at
# max_tokens tokens it ends by length. Device form: over a verify step's kept tokens, the first
# that is one of stop_ids ends the request there (kept_through_stop) -- the same decision for
# the requests device_stop_ids admits: past min_tokens, not within reach of max_tokens, with no
# stop strings, grammar or error (what only the host can see).


def stop_ids(params, eos_token_ids) -> list[int]:
    """The token ids that end a request once past min_tokens: its EOS ids (config.json's,
    generation_config.json's, the tokenizer's) unless ignore_eos, then params.stop_token_ids."""
    eos = [] if params.ignore_eos else list(eos_token_ids)
    return eos + [t for t in params.stop_token_ids if t not in eos]


def stopping_token(params, eos_token_ids, token: int, num_output: int) -> str | None:
    """Whether output token `token`, the output's num_output-th, ends the request by its id:
    "eos" (an EOS id, unless ignore_eos: its text is dropped), "stop" (a stop_token_ids id), or
    None; not None exactly when num_output >= min_tokens and token is in stop_ids(params,
    eos_token_ids)."""
    if num_output < params.min_tokens:
        return None
    if not params.ignore_eos and token in eos_token_ids:
        return "eos"
    if token in params.stop_token_ids:
        return "stop"
    return None


def reaches_length(num_output: int, max_tokens: int) -> bool:
    """Whether an output of num_output tokens ends the request by length."""
    return num_output >= max_tokens


def device_stop_ids(seq, horizon: int) -> list[int] | None:
    """The stop ids with which the device form (kept_through_stop) decides seq's next `horizon`
    output tokens exactly as the host form would, or None when it cannot: before min_tokens (a
    stop id does not end it yet), within `horizon` tokens of max_tokens (the length does), with
    stop strings (matched on the text), a grammar (its end) or an error. Otherwise the host form
    over those tokens reduces to "the first token in stop_ids ends the request"."""
    p, n = seq.params, len(seq.output_token_ids)
    if (p.stop_strings or seq.error is not None or seq.guide is not None or seq.guide_pending is not None
            or n < p.min_tokens or n + horizon >= seq.max_tokens):
        return None
    return stop_ids(p, seq.eos_token_ids)


@dataclass
class Verified:
    """One request's verify step: the tokens to append (accepted drafts + one from the target),
    the raw target logits each was chosen from, how many tokens were drafted, and whether the
    verify ran in a CUDA graph (StepResult.in_graph: what its "replay" commit needs)."""

    tokens: list[int]
    logits: torch.Tensor
    num_drafted: int
    in_graph: bool = False

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1
