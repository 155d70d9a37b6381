"""The per-rank memory report (hyla.parallel.tp_memory) == what one rank's loaded shard holds, and
the loader gives each rank only its part (no process group needed to load)."""

import pytest
import torch

from hyla.models import load_config, load_model
from hyla.parallel.tp_memory import tensor_parallel_section
from hyla.parallel.plans import make_plan
from hyla.parallel.tp_memory import rank_memory_report
from tests.oracles.kimi_checkpoint import build_kimi_checkpoint
from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-memory")


@pytest.mark.parametrize("family,ep", [("kimi", False), ("kimi", True), ("qwen3_next", False), ("qwen3_next", True)])
def test_report_equals_loaded_shard(root, family, ep):
    path = build_kimi_checkpoint(root, "moe") if family == "kimi" else build_qwen3_next_checkpoint(root, "moe")
    config = load_config(path)
    full = load_model(path, dtype=torch.float32)
    total = 0
    for rank in range(2):
        shard = load_model(path, dtype=torch.float32, shard=make_plan(config.model_type, rank, 2, None, ep))
        report = rank_memory_report(config, 2, torch.float32, torch.float32, ep)
        assert report.weight_bytes == shard.weight_bytes() < 0.6 * full.weight_bytes()
        assert report.state_bytes_per_request == shard.state_bytes_per_slot(torch.float32)
        assert report.kv_bytes_per_token == shard.kv_bytes_per_token()
        total += shard.weight_bytes()
    assert total > full.weight_bytes()  # the norms, routers and latent projections are on both ranks


def test_section_lists_each_degree(root):
    text = tensor_parallel_section(load_config(build_kimi_checkpoint(root, "moe")), degrees=(1, 2, 4))
    assert "TP=1: weights" in text and "TP=2: weights" in text
    assert "TP=4: tensor_parallel_size=4 does not divide config field `linear_num_heads` (2)" in text
