"""Copies to the host tier on a side stream (hyla.engine.host_offload) on CUDA (skipped without):
what reaches the host is what the source held when the copy was planned, although the compute
stream overwrites the source at once; a restore after a fence reads what the side stream wrote;
the engine's host tier gives the same greedy tokens with the side stream as with every copy on
the compute stream (the same plans and kernels: equal, not close)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import hyla.engine.cache_tiers as cache_tiers  # noqa: E402
from hyla import LLM  # noqa: E402
from hyla.engine.host_offload import DeviceToHost  # noqa: E402
from tests.engine.test_host_tier import agent_trace, budget  # noqa: E402
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint  # noqa: E402

MB = 1 << 20


def _busy(x: torch.Tensor, rounds: int = 20) -> None:
    """Keep the compute stream busy for a few ms, so that an unordered copy would race."""
    for _ in range(rounds):
        x = x @ x
        x = x / x.norm()


def test_sources_reused_at_once_reach_the_host_as_they_were():
    dev = torch.device("cuda")
    rows = torch.randn(8, 4 * MB // 4, device=dev)  # 8 rows of 4 MB
    want = rows.cpu()
    host = torch.empty_like(want).pin_memory()
    to_host = DeviceToHost(dev, budget_bytes=20 * MB)  # room for 5 rows: the rest go direct
    _busy(torch.randn(2048, 2048, device=dev))  # the side stream starts behind this
    for i in range(8):
        to_host.copy(host[i], rows[i])
    to_host.flush()
    rows.fill_(float("nan"))  # the sources reused at once, on the compute stream
    torch.cuda.synchronize()
    assert torch.equal(host, want)
    assert to_host.direct_bytes >= 3 * 4 * MB  # over the budget: copied on the compute stream


def test_a_restore_after_the_fence_reads_what_the_side_stream_wrote():
    dev = torch.device("cuda")
    src = torch.randn(16 * MB // 4, device=dev)
    host = torch.zeros(src.shape, pin_memory=True)
    to_host = DeviceToHost(dev)
    for _ in range(5):
        _busy(torch.randn(2048, 2048, device=dev))  # the copy to the host waits for this
        to_host.copy(host, src)
        to_host.flush()
        to_host.fence()
        back = torch.empty_like(src)
        back.copy_(host, non_blocking=True)  # a restore on the compute stream
        assert torch.equal(back, src)
        src = torch.randn_like(src)


@pytest.mark.parametrize("checkpoint_dtype", ["auto", "int8"])  # int8: slots packed on their way to the host
def test_engine_host_tier_side_stream_equals_compute_stream(tmp_path, monkeypatch, checkpoint_dtype):
    ckpt = build_kimi_checkpoint(tmp_path, "dense")
    kw = dict(dtype="float32", max_model_len=160, enable_prefix_caching=True, max_num_seqs=2,
              memory_budget=budget(ckpt, pages=14, slots=4), host_cache_bytes=64 << 20, enforce_eager=True,
              checkpoint_dtype=checkpoint_dtype)
    side = LLM(str(ckpt), **kw)
    got, metrics = agent_trace(side, sessions=6, turns=3)
    assert metrics["pages_to_host"] > 0 and metrics["checkpoints_from_host"] > 0
    assert side.engine.runner.tiers.to_host.direct_bytes == 0  # every copy to the host went on the side stream
    monkeypatch.setattr(cache_tiers, "STAGING_BYTES", 0)  # every copy on the compute stream
    direct = LLM(str(ckpt), **kw)
    assert direct.engine.runner.tiers.to_host.stream is None
    want, _ = agent_trace(direct, sessions=6, turns=3)
    assert got == want
