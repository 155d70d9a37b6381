"""Logprobs of one completion in the OpenAI shapes (legacy completions, chat), and prompt
logprobs in vLLM's shape."""

from __future__ import annotations

from hyla.engine.outputs import CompletionOutput, RequestOutput

# What a logprob of -inf (a token the model gives no chance) is written as: JSON has no
# infinity, and OpenAI / vLLM answer this floor instead.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _decoder(tokenizer):
    """A token's text: its id decoded alone, special tokens included (vLLM decodes each with the
    tokenizer's default, skip_special_tokens=False); without a tokenizer, the id as a string."""
    def decode(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else str(token)

    return decode


def _tokens(tokenizer, c: CompletionOutput, start: int) -> list[tuple[str, float | None, list[tuple[str, float]] | None]]:
    """(text, logprob, [(alternative's text, logprob), ...]) per token from `start`; logprob and
    alternatives are None where c.logprobs has no entry (an echoed prompt's first token)."""
    decode = _decoder(tokenizer)
    rows = []
    for t, lp in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        if lp is None:
            rows.append((decode(t), None, None))
        else:  # alternatives as pairs: two ids may decode alike
            rows.append((decode(t), _finite(lp[t]), [(decode(k), _finite(v)) for k, v in lp.items()]))
    return rows


def completion_logprobs(tokenizer, c: CompletionOutput, start: int, n_top: int, offset: int = 0) -> dict | None:
    """The legacy completions logprobs of tokens start.. : per token its text, logprob, the
    chosen token plus the top n_top, and its character offset: the lengths of the texts of the
    tokens before it (vLLM's text_offset), `offset` being token start's (a stream passes what its
    earlier chunks covered). With echo, c holds the prompt's tokens first, the first of which
    has null logprob and top_logprobs."""
    if c.logprobs is None:
        return None
    rows = _tokens(tokenizer, c, start)
    offsets, at = [], offset
    for text, _, _ in rows:
        offsets.append(at)
        at += len(text)
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [None if r[2] is None else dict(r[2][: n_top + 1]) for r in rows],
            "text_offset": offsets}


def chat_logprobs(tokenizer, c: CompletionOutput, start: int, n_top: int) -> dict | None:
    """Chat logprobs of tokens start.. : each token's logprob and exactly its n_top most likely
    alternatives (OpenAI: none when top_logprobs is not set)."""
    if c.logprobs is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode())}
                                          for k, v in sorted(top, key=lambda kv: -kv[1])[:n_top]]}
                        for t, lp, top in _tokens(tokenizer, c, start)]}


def prompt_logprobs(tokenizer, out: RequestOutput, n_top: int) -> list[dict[str, dict] | None] | None:
    """vLLM's `prompt_logprobs` of a request that asked for n_top of them: None for the first
    prompt token, then per token {token id (a string, as JSON keys are): {"logprob", "rank",
    "decoded_token"}} holding the prompt token (first) and the n_top most likely tokens, ranked
    1..n_top; the prompt token, when not among them, has its rank in the whole vocabulary (how
    many tokens are at least as likely, itself included). None when the engine computed none."""
    if out.prompt_logprobs is None:
        return None
    decode = _decoder(tokenizer) if tokenizer is not None else (lambda token: None)
    ranks_in_vocab = out.prompt_token_ranks or [None] * len(out.prompt_logprobs)
    result: list[dict[str, dict] | None] = []
    for token, scores, rank in zip(out.prompt_token_ids, out.prompt_logprobs, ranks_in_vocab):
        if scores is None:
            result.append(None)
            continue
        # the engine's dict: the prompt token, then the top n_top best first; the prompt token
        # is one of them exactly when the dict holds no more than n_top entries
        entries = list(scores.items())
        top = entries if len(entries) <= n_top else entries[1:]
        ranks = {t: r for r, (t, _) in enumerate(sorted(top, key=lambda kv: -kv[1]), start=1)}
        ranks.setdefault(token, rank)
        result.append({str(t): {"logprob": _finite(v), "rank": ranks[t], "decoded_token": decode(t)}
                       for t, v in entries})
    return result


def cumulative_logprob(c: CompletionOutput) -> float:
    """The sum of the emitted tokens' logprobs (what best_of ranks candidates by)."""
    return sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs or []))
