"""The checkpoint's multi-token-prediction head as a drafter: drafter.py (MTPDrafter), fused.py
(its fused greedy verify-and-draft step), overlap.py (the next fused step launched before the
current one is read)."""
