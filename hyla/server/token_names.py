"""How a response's logprobs name their tokens: by the tokenizer's text, or as "token_id:N"
(vLLM's `return_tokens_as_token_ids`), so that tokens whose text is not valid on its own (part
of a character, a lone byte) can still be told apart.

The choice builders read their tokenizer for nothing but these names, so a request that asks
for ids hands them `TokenIdNames` in the tokenizer's place (`token_namer`); text offsets then
count the names, as vLLM's do.
"""

from __future__ import annotations


class TokenIdNames:
    """Decodes every token to "token_id:N" (the first id of what it is given: the logprobs
    decode one token at a time)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return f"token_id:{ids[0]}"


def token_namer(tokenizer, as_token_ids: bool | None):
    """What the logprobs name tokens with: `tokenizer`, or TokenIdNames when the request asks."""
    return TokenIdNames() if as_token_ids else tokenizer
