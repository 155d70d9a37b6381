"""What the tensor-parallel engine tests share: prompts, the TP = 1 reference, per-rank budgets."""

from __future__ import annotations

import torch

from hyla import LLM, SamplingParams
from hyla.models import memory
from hyla.models.loader import load_config
from hyla.parallel.plans import make_plan

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
LOGPROB_TOL = 1e-4  # fp32: TP sums the row-parallel products in another order (~1e-6 seen)


def prompts(seed: int = 0, lengths: tuple[int, ...] = (95, 94, 1)) -> list[list[int]]:
    """Random prompts of `lengths` (by default two long ones first: they start together and
    outgrow a small budget) and one repeated phrase (prompt lookup drafts)."""
    gen = torch.Generator().manual_seed(seed)
    rand = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]
    phrase = torch.randint(3, 256, (6,), generator=gen).tolist()
    return rand + [phrase * 6]


def follow_ups(first: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """A second turn of all but the first of `first`, the latest first (still cached under a
    small budget): prompt + its output + new tokens (prefix-cache hits)."""
    return [first[i] + outputs[i] + [5, 6, 7][: i % 3 + 1] for i in range(len(first) - 1, 0, -1)]


def generate(llm: LLM, first: list[list[int]], ref_outputs: list[list[int]] | None = None,
             params: SamplingParams = GREEDY):
    """Both turns: -> [(token ids, logprobs)] for first + follow_ups(first, ...). The second turn
    is built from `ref_outputs` when given (the TP = 1 outputs), so both engines see the same prompts."""
    out = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(first, params, use_tqdm=False)]
    second = follow_ups(first, ref_outputs or [t for t, _ in out])
    out += [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(second, params, use_tqdm=False)]
    return out


def assert_same(got, ref) -> None:
    """Token for token, and every reported logprob within LOGPROB_TOL."""
    assert [g[0] for g in got] == [r[0] for r in ref]
    for (_, lg), (_, lr) in zip(got, ref):
        for a, b in zip(lg, lr):
            assert a.keys() == b.keys()
            assert max(abs(a[t] - b[t]) for t in a) < LOGPROB_TOL


def rank_bytes(path, world: int, expert_parallel: bool = False) -> tuple[int, int]:
    """(state bytes per slot, KV bytes per token) of one rank in fp32."""
    local = make_plan(load_config(path).model_type, 0, world, None, expert_parallel).configure(load_config(path))
    return (memory.state_bytes_per_slot(local, torch.float32, torch.float32),
            memory.kv_bytes_per_token(local, torch.float32))
