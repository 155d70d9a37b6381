"""Logprobs of one completion in the two OpenAI shapes (legacy completions, chat)."""

from __future__ import annotations

from hyla.engine.outputs import CompletionOutput


def _tokens(tokenizer, c: CompletionOutput, start: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(text, logprob, [(alternative's text, logprob), ...]) per token from `start`. A token's
    text is its id decoded alone, special tokens included (vLLM decodes each with the
    tokenizer's default, skip_special_tokens=False); without a tokenizer, the id as a string."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else str(ids[0])

    return [(decode([t]), lp[t], [(decode([k]), v) for k, v in lp.items()]) for t, lp in
            zip(c.token_ids[start:], (c.logprobs or [])[start:])]  # alternatives as pairs: two ids may decode alike


def completion_logprobs(tokenizer, c: CompletionOutput, start: int, n_top: int, offset: int = 0) -> dict | None:
    """The legacy completions logprobs of tokens start.. : per token its text, logprob, the
    chosen token plus the top n_top, and its character offset in the choice's text (which
    begins `offset` characters in, e.g. after an echoed prompt)."""
    if c.logprobs is None:
        return None
    rows = _tokens(tokenizer, c, 0)
    offsets, at = [], offset
    for text, _, _ in rows:
        offsets.append(at)
        at += len(text)
    rows = rows[start:]
    return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
            "top_logprobs": [dict(r[2][: n_top + 1]) for r in rows], "text_offset": offsets[start:]}


def chat_logprobs(tokenizer, c: CompletionOutput, start: int, n_top: int) -> dict | None:
    """Chat logprobs of tokens start.. : each token's logprob and exactly its n_top most likely
    alternatives (OpenAI: none when top_logprobs is not set)."""
    if c.logprobs is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": k, "logprob": v, "bytes": list(k.encode())}
                                          for k, v in sorted(top, key=lambda kv: -kv[1])[:n_top]]}
                        for t, lp, top in _tokens(tokenizer, c, start)]}


def cumulative_logprob(c: CompletionOutput) -> float:
    """The sum of the emitted tokens' logprobs (what best_of ranks candidates by)."""
    return sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs or []))
