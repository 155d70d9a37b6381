"""Attention masks the layers share."""

from __future__ import annotations


def causal_after_prefix(new: int, total: int):
    """The causal bias of `new` query tokens at the end of `total` keys (lower-right aligned:
    query i sees keys 0..total-new+i), for scaled_dot_product_attention without a built
    [new, total] mask. Imported inside the call: torch.nn.attention.bias loads torch._dynamo
    and with it triton, which must not be imported before a test sets TRITON_INTERPRET."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(new, total)
