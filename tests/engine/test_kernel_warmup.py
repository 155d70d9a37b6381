"""The startup kernel warm-up (hyla.engine.kernel_warmup): its steps stay within the token budget
and cover both divisibilities of every length on its ladder, contexts, several rows and checkpoint
exports; they run through every family's model without touching an engine; the flag reaches the
engine config."""

from __future__ import annotations

import argparse

import pytest
import torch

from hyla.bench.random_models import random_model
from hyla.engine.kernel_warmup import MAX_ROWS, warm_up_kernels, warmup_rows
from hyla.models import load_model
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.oracles.kimi_k3_checkpoint import build_kimi_k3_checkpoint
from tests.oracles.qwen3_5_checkpoint import build_qwen3_5_checkpoint


@pytest.mark.parametrize("budget", [1, 7, 40, 8192])
def test_steps_stay_within_the_budget_and_cover_the_ladder(budget):
    steps = warmup_rows(budget, checkpoints=True)
    assert steps and all(1 <= len(s) <= MAX_ROWS and sum(r[0] for r in s) <= budget for s in steps)
    assert all(n >= 1 and c >= 0 and k in (0, 1, 2) for s in steps for n, c, k in s)
    single = {s[0][0] for s in steps if len(s) == 1 and s[0][1] == 0}
    assert 1 in single and budget in single
    if budget >= 64:
        assert {16, 17, 64} <= single  # a multiple of 16 and its neighbour
        assert any(len(s) == 1 and s[0][1] % 16 and s[0][1] > 0 for s in steps)  # a context off 16
        assert any(len(s) == MAX_ROWS for s in steps)
        assert any(sum(r[0] == 1 for r in s) >= 2 and len(s) > 2 for s in steps)  # decode rows beside a prefill
        crowds = [sum(r[0] == 1 for r in s) for s in steps if len(s) > 2 and s[-1][0] > 1]
        assert {16, 17} <= set(crowds)  # a loaded server's mixed steps: both divisibilities of the count
    assert any(k for s in steps for _, _, k in s)
    assert not any(k for s in warmup_rows(budget, checkpoints=False) for _, _, k in s)


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        warmup_rows(0, checkpoints=False)


def _models(root):
    yield "kimi", load_model(build_kimi_checkpoint(root, "moe"), dtype=torch.float32)
    yield "qwen3.5", load_model(build_qwen3_5_checkpoint(root, "moe"), dtype=torch.float32)
    yield "kimi-k3", load_model(build_kimi_k3_checkpoint(root), dtype=torch.float32)
    for name in ("tiny-qwen3-next-moe", "tiny-glm5-next"):
        yield name, random_model(name, dtype=torch.float32, device="cpu")


def test_every_family_runs_the_warm_up(tmp_path):
    for name, model in _models(tmp_path):
        for checkpoints in (False, True):
            ran = warm_up_kernels(model, max_num_batched_tokens=40, page_size=16, state_dtype=torch.float32,
                                  checkpoints=checkpoints)
            assert ran == len(warmup_rows(40, checkpoints)), name


def test_the_cli_flag_reaches_the_engine_config(tmp_path):
    from hyla.cli import _add_engine_args, _engine_config

    p = argparse.ArgumentParser()
    _add_engine_args(p, prefix_cache_default=False)
    base = ["--model", str(build_kimi_checkpoint(tmp_path, "moe")), "--device", "cpu"]
    assert _engine_config(p.parse_args(base)).kernel_warmup is True
    assert _engine_config(p.parse_args(base + ["--no-kernel-warmup"])).kernel_warmup is False
