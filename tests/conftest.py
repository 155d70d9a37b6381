"""The whole suite's run settings: parallel workers by default, one torch thread per worker.

`python -m pytest` (the whole suite: no file or folder named) runs on pytest-xdist workers, one per
CPU and at most MAX_WORKERS, unless the command line says otherwise: `-n 0` or `-p no:xdist` runs
in one process (for debugging; --pdb does too), `-n N` picks the count. Named files or folders run
in one process unless `-n` is given. The default lives here rather than in pyproject's addopts
because `-p no:xdist` would reject an `-n` there.

Every test starts from torch's global generator seeded from its own node id (`_seeded_draws`):
the inputs a test draws without a generator of its own are fresh random values, but the same ones
on every run, whichever worker runs the test and whatever ran there before it; a failure
reproduces with the test alone.

Each worker runs torch on one thread (and so do the processes the tests start: `hyla serve`, the
tensor-parallel ranks, mp.spawn children, through OMP_NUM_THREADS): the workers already fill the
cores, and the suite's tensors are tiny, so a second intra-op thread per process only adds
contention.
"""

from __future__ import annotations

import os

import pytest

CUDA_TEST_POOL_BYTES = 2 << 30  # the KV pages and state slots of an engine a test builds on CUDA
MAX_WORKERS = 4  # beyond this the per-worker start-up (imports, collection, fixtures) outweighs the gain
DIST_MODE = "worksteal"  # contiguous runs of tests per worker (module fixtures built ~once), rebalanced at the tail

if os.environ.get("PYTEST_XDIST_WORKER"):
    # set before any test imports torch's thread pool; children inherit it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Choose xdist workers for a run of the whole suite when the command line chose none (runs
    before xdist's own hook, which turns numprocesses into workers). A run of named files or
    folders stays in one process, where start-up is quicker and output is read live."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return  # xdist disabled (-p no:xdist), or this is a worker
    if config.option.numprocesses is not None or config.option.tx:
        return  # -n / --tx given
    if config.args_source == pytest.Config.ArgsSource.ARGS or config.option.usepdb or config.option.collectonly:
        return
    workers = min(_cpu_count(), MAX_WORKERS)
    if workers >= 2:
        config.option.numprocesses = workers
        if config.option.dist == "no":
            config.option.dist = DIST_MODE


@pytest.fixture(autouse=True)
def _seeded_draws(request: pytest.FixtureRequest) -> None:
    """Seed torch's global generator from the test's node id (module docstring)."""
    import zlib

    import torch

    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session", autouse=True)
def _cuda_pool_cap():
    """On a CUDA machine every engine the tests build without a memory_budget takes
    CUDA_TEST_POOL_BYTES of pools, not gpu_memory_utilization (90%) of the device: several xdist
    workers share the GPU, and a test may hold two engines at once (each would count the other's
    pools as in use). Session-wide, so that engines built by module- and session-scoped fixtures
    (set up before any function-scoped fixture) are capped too. Yields the measuring function."""
    import torch

    if not torch.cuda.is_available():
        yield None
        return
    from hyla.engine import llm_engine

    measured = llm_engine.device_pool_budget
    llm_engine.device_pool_budget = lambda *args, **kwargs: CUDA_TEST_POOL_BYTES
    yield measured
    llm_engine.device_pool_budget = measured


@pytest.fixture(autouse=True)
def _bounded_cuda_pools(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, _cuda_pool_cap):
    """A test marked real_gpu_memory gets the measured budget back (tests/engine/test_memory_profile.py;
    it measures the whole device, so the GPU round runs those tests alone, after the parallel run).
    After each test the worker's cached blocks go back to the device (a full-size kernel test caches
    tens of GiB that the other workers need)."""
    if _cuda_pool_cap is None:
        yield
        return
    import torch

    if request.node.get_closest_marker("real_gpu_memory"):
        from hyla.engine import llm_engine

        monkeypatch.setattr(llm_engine, "device_pool_budget", _cuda_pool_cap)
    yield
    torch.cuda.empty_cache()
