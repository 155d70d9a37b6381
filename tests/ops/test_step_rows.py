"""The next overlapped MTP step's input rows (hyla.ops.step_rows): the torch reference against a
python loop spelling out the rule (kept tokens, first stop token, padding rows), and the Triton
kernel (TRITON_INTERPRET=1 on the CPU) against the reference, bit for bit (integers), with stop
tokens among the kept tokens, past them, none, and padding rows of the batch."""

from __future__ import annotations

import random

import pytest
import torch

from hyla.ops import step_rows as ref
from tests.ops.triton_env import triton_module


def _case(n: int, bs: int, k: int, S: int, width: int, seed: int):
    """Random previous-step outputs and host rows for n requests in a batch of bs; stop ids are
    planted among the kept tokens of some requests and past them for others."""
    rnd = random.Random(seed)
    W, V = k + 1, 50
    prev, base = [], []
    for i in range(bs):
        acc = rnd.randint(0, k)
        top = [rnd.randrange(V) for _ in range(W)]
        stops = [rnd.randrange(V, 2 * V) for _ in range(S)]  # ids the argmax never hits
        if S and i % 3 == 0:  # a stop token among the kept ones (maybe twice)
            top[rnd.randint(0, acc)] = stops[-1]
            top[rnd.randint(0, acc)] = stops[0]
        elif S and i % 3 == 1 and acc < k:  # one past the kept tokens: not a stop
            top[rnd.randint(acc + 1, k)] = stops[0]
        stops = stops[:rnd.randint(0, S)] + [-1] * S
        prev.append(top + [acc] + [rnd.randrange(V) for _ in range(k)])
        base.append([rnd.randint(1, 900), rnd.randint(1, 900)] + stops[:S])
    VW, EW = 2 + 2 * W + width, 1 + k + width
    vmeta = torch.randint(0, 99, (n, VW))
    emeta = torch.randint(0, 99, (n, EW))
    vpad = torch.tensor([0, 1] + [0] * W + [-1] * W + [-1] * width)
    epad = torch.tensor([0] + [-1] * (k + width))
    return torch.tensor(base[:n], dtype=torch.long).view(n, 2 + S), torch.tensor(prev), vmeta, emeta, vpad, epad


def _loop(base, prev, vmeta, emeta, vpad, epad, replay: bool):
    """The rule one request at a time in python -> (vmeta, emeta, kept or None) as new tensors."""
    n, W = base.shape[0], prev.shape[1] // 2
    bs = prev.shape[0]
    vm, em, kept = vmeta.tolist(), emeta.tolist(), [1] * bs
    for i in range(n):
        b, p = base[i].tolist(), prev[i].tolist()
        acc, top, nxt = p[W], p[:W], p[W + 1:]
        stops = {s for s in b[2:] if s >= 0}
        first = next((j for j in range(acc + 1) if top[j] in stops), None)
        kept[i] = acc + 1 if first is None else first + 1
        if first is not None:
            vm[i], em[i] = vpad.tolist(), epad.tolist()
            continue
        vm[i][:2 + W] = [b[0] + acc, 1 if replay else acc + 1, top[acc]] + nxt
        em[i][:W] = [b[1] + acc] + nxt
    return torch.tensor(vm).view(vmeta.shape), torch.tensor(em).view(emeta.shape), (torch.tensor(kept) if replay else None)


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("n,bs,k,S,width", [(1, 1, 1, 1, 1), (3, 4, 2, 4, 3), (7, 8, 3, 2, 5), (5, 8, 3, 0, 2),
                                            (0, 2, 2, 1, 1)])
def test_reference_is_the_rule(replay, n, bs, k, S, width):
    for seed in range(4):
        base, prev, vmeta, emeta, vpad, epad = _case(n, bs, k, S, width, seed)
        want = _loop(base, prev, vmeta, emeta, vpad, epad, replay)
        kept = torch.full((bs,), 7) if replay else None
        ref.derive_step_rows(base, prev, vmeta, emeta, vpad, epad, kept)
        assert torch.equal(vmeta, want[0]) and torch.equal(emeta, want[1])
        if replay:
            assert torch.equal(kept, want[2])


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("n,bs,k,S,width", [(1, 1, 1, 1, 1), (3, 4, 2, 4, 3), (7, 8, 3, 2, 5), (5, 8, 3, 0, 2)])
def test_triton_equals_reference(replay, n, bs, k, S, width):
    tk, dev = triton_module("step_rows")
    for seed in range(3):
        args = [a.to(dev) for a in _case(n, bs, k, S, width, 10 + seed)]
        mine = [a.clone() for a in args]
        kept_ref = torch.full((bs,), 7, device=dev) if replay else None
        kept_tk = kept_ref.clone() if replay else None
        ref.derive_step_rows(*args, kept_ref)
        tk.derive_step_rows(*mine, kept_tk)
        assert torch.equal(mine[2], args[2]) and torch.equal(mine[3], args[3])
        if replay:
            assert torch.equal(kept_tk, kept_ref)


def test_bad_arguments_are_named():
    base, prev, vmeta, emeta, vpad, epad = _case(2, 2, 2, 1, 1, 0)
    with pytest.raises(ValueError, match="padding rows"):
        ref.derive_step_rows(base, prev, vmeta, emeta, vpad[:-1], epad)
    with pytest.raises(ValueError, match="int64"):
        ref.derive_step_rows(base, prev, vmeta, emeta.int(), vpad, epad)
    with pytest.raises(ValueError, match="expects base"):
        ref.derive_step_rows(base, prev[:, :-1], vmeta, emeta, vpad, epad)
