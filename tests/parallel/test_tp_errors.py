"""Tensor-parallel startup checks and failures: sizes N does not divide -> ValueError naming the
config field (before any worker starts); a worker killed mid-generation -> the engine raises
TensorParallelError and every worker process is gone."""

import copy
import json
import os
import signal

import pytest
import torch.distributed as dist

from hyla import LLM, SamplingParams
from hyla.engine.config import EngineConfig
from hyla.parallel.errors import TensorParallelError
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-errors")


@pytest.fixture(scope="module")
def kimi(root):
    return build_kimi_checkpoint(root, "moe")


def _config_dir(tmp_path, base, name: str, **changes):
    """A directory holding only a config.json: base's, with `changes` (nested dicts merged)."""
    d = copy.deepcopy(json.loads((base / "config.json").read_text()))
    for key, value in changes.items():
        d[key] = {**d[key], **value} if isinstance(value, dict) else value
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(d))
    return path


KIMI_CASES = [  # (changes, tensor_parallel_size, expert parallel, the field the error names)
    (dict(), 4, False, "linear_num_heads"),
    (dict(linear_attn_config=dict(num_heads=4), linear_num_heads=4), 4, False, "num_attention_heads"),
    (dict(linear_attn_config=dict(num_heads=4), linear_num_heads=4, num_attention_heads=4,
          moe_intermediate_size=30), 4, False, "moe_intermediate_size"),
    (dict(num_experts=6, num_expert_group=1, topk_group=1), 2, True, None),  # 6 experts over 2 ranks: fine
    (dict(linear_attn_config=dict(num_heads=4), linear_num_heads=4, num_attention_heads=4, num_experts=6,
          num_expert_group=1, topk_group=1), 4, True, "num_experts"),
]


@pytest.mark.parametrize("changes,n,ep,field", KIMI_CASES, ids=[c[3] or "divides" for c in KIMI_CASES])
def test_kimi_sizes_not_divisible(tmp_path, kimi, changes, n, ep, field):
    path = _config_dir(tmp_path, kimi, "cfg", **changes)
    if field is None:
        EngineConfig(model=str(path), device="cpu", tensor_parallel_size=n, enable_expert_parallel=ep)
        return
    with pytest.raises(ValueError, match=f"`{field}`"):
        EngineConfig(model=str(path), device="cpu", tensor_parallel_size=n, enable_expert_parallel=ep)


@pytest.mark.parametrize("changes,n,field", [
    (dict(), 4, "linear_num_key_heads"),
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, "num_key_value_heads"),
    (dict(num_experts=6), 4, "num_experts"),
], ids=["linear_num_key_heads", "num_key_value_heads", "num_experts"])
def test_qwen3_next_sizes_not_divisible(tmp_path, root, changes, n, field):
    base = build_qwen3_next_checkpoint(root, "moe")
    if field == "num_experts":  # heads that 4 divides, experts it does not
        changes = dict(changes, linear_num_key_heads=4, linear_num_value_heads=8, num_attention_heads=4,
                       num_key_value_heads=4)
    path = _config_dir(tmp_path, base, "cfg", **changes)
    with pytest.raises(ValueError, match=f"`{field}`"):
        EngineConfig(model=str(path), device="cpu", tensor_parallel_size=n, enable_expert_parallel=field == "num_experts")


def test_bad_tensor_parallel_size(kimi):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=str(kimi), device="cpu", tensor_parallel_size=0)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_killed_worker_ends_the_engine_without_orphans(kimi):
    llm = LLM(str(kimi), dtype="float32", tensor_parallel_size=2)
    engine = llm.engine
    pids = engine.workers.pids
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * (10 + i), params)
    for _ in range(3):
        engine.step()
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(TensorParallelError, match=r"worker 1 \(pid \d+\) died with exit code -9"):
        for _ in range(30):
            engine.step()
    assert all(_gone(p) for p in pids) and not dist.is_initialized()
    with pytest.raises(TensorParallelError):  # and it stays down
        engine.step()


def test_worker_that_cannot_start(kimi, monkeypatch):
    monkeypatch.setattr("sys.executable", "/bin/false")  # the worker command exits with 1 at once
    with pytest.raises(TensorParallelError, match="worker 1 exited with code 1 during startup"):
        LLM(str(kimi), dtype="float32", tensor_parallel_size=2)
    assert not dist.is_initialized()


def test_checkpoint_every_rank_rejects(tmp_path, kimi):
    """A tensor of the wrong shape: every rank's loader refuses it; the engine raises that
    ValueError and the workers are gone."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((kimi / "config.json").read_text())
    tensors = load_file(kimi / "model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"load failed on 2 of 2 ranks: rank 0: ValueError: shape mismatch"):
        LLM(str(bad), dtype="float32", tensor_parallel_size=2)
    assert not dist.is_initialized()


def test_a_collected_llm_releases_its_workers_and_a_second_engine_starts(kimi):
    """Nothing but the LLM holds its worker group (no atexit entry, no watchdog thread): deleting
    the LLM and collecting it stops the workers and leaves the process group, so another
    tensor-parallel engine can start in the same process."""
    import gc
    import weakref

    llm = LLM(str(kimi), dtype="float32", tensor_parallel_size=2)
    group, pids = weakref.ref(llm.engine.workers), llm.engine.workers.pids
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    del llm
    gc.collect()
    assert group() is None
    assert all(_gone(p) for p in pids) and not dist.is_initialized()
    again = LLM(str(kimi), dtype="float32", tensor_parallel_size=2)
    assert again.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == first
    again.shutdown()
    again.shutdown()  # idempotent
    assert not dist.is_initialized()


def test_an_engine_that_fails_after_its_workers_started_leaves_nothing_behind(kimi):
    """A budget too small for one request fails after the workers loaded their shards: the
    workers are stopped and the process group left before the error reaches the caller."""
    with pytest.raises(ValueError, match="cannot hold one request"):
        LLM(str(kimi), dtype="float32", tensor_parallel_size=2, memory_budget=1024)
    assert not dist.is_initialized()
