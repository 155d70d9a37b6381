"""The --tensor-parallel-size / --enable-expert-parallel / --load-format flags reach EngineConfig
(hyla serve / generate) and the benchmark's argument checks (no worker is started here)."""

import argparse

import pytest

from hyla.bench import throughput
from hyla.cli import _add_engine_args, _engine_config
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint


def test_engine_flags(tmp_path):
    p = argparse.ArgumentParser()
    _add_engine_args(p, prefix_cache_default=False)
    path = build_kimi_checkpoint(tmp_path, "moe")
    args = p.parse_args(["--model", str(path), "--device", "cpu", "-tp", "2", "--enable-expert-parallel",
                         "--load-format", "dummy"])
    config = _engine_config(args)
    assert (config.tensor_parallel_size, config.enable_expert_parallel, config.load_format) == (2, True, "dummy")
    with pytest.raises(ValueError, match="`linear_num_heads`"):
        _engine_config(p.parse_args(["--model", str(path), "--device", "cpu", "--tensor-parallel-size", "4"]))


def test_bench_tensor_parallel_runs_the_engine_only():
    with pytest.raises(SystemExit):
        throughput.main(["--random-config", "tiny-kimi-moe", "--tensor-parallel-size", "2", "--mode", "decode"])
