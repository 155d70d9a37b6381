"""The bundled models by name: "default" (Kimi-Linear) and "qwen3.5-mtp" (Qwen3.5 with a trained
MTP head), resolved by hyla.models.default and accepted by LLM and the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hyla import LLM, SamplingParams
from hyla.models.default import BUNDLED_MODELS, bundled_model_path, default_model_path
from hyla.models.hub import resolve_model

PROMPTS = ["def read_file(path):", "class Stack:\n    def push(self, item):"]


def test_names_resolve_to_the_shipped_folders(tmp_path, monkeypatch):
    assert resolve_model(None) == resolve_model("default") == default_model_path()
    mtp = Path(resolve_model("qwen3.5-mtp"))
    assert mtp == BUNDLED_MODELS["qwen3.5-mtp"] and (mtp / "model.safetensors").is_file()
    assert mtp.stat().st_size and (mtp / "model.safetensors").stat().st_size <= 20 * 2**20  # the package's limit
    assert resolve_model("/some/checkpoint") == "/some/checkpoint"  # not a name: left to the loader
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    assert resolve_model("default") == "default"  # a directory of that name wins over the bundled one
    with pytest.raises(KeyError):
        bundled_model_path("no-such-model")


def test_mtp_model_is_a_qwen3_5_with_a_trained_head():
    path = Path(bundled_model_path("qwen3.5-mtp"))
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    info = json.loads((path / "training_info.json").read_text())
    assert info["final_val_loss"] < 3.6  # nats/token on held-out stdlib modules (untrained: ln 4096 = 8.3)
    assert {"next", "mtp"} <= set(info["log"][-1])  # both objectives were logged


def test_mtp_drafting_on_the_bundled_model_is_exact_and_accepted():
    """Greedy with the model's own MTP head equals plain greedy, and the trained head's drafts
    are mostly accepted (an untrained head's would almost never be: 4096-token vocabulary)."""
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = [o.outputs[0].token_ids for o in LLM("qwen3.5-mtp", dtype="float32").generate(PROMPTS, params)]
    llm = LLM("qwen3.5-mtp", dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == plain
    m = llm.get_metrics()
    assert m["spec_num_draft_tokens"] > 0 and m["spec_acceptance_rate"] > 0.3


def test_cli_takes_a_bundled_name_and_serves_it_under_that_name():
    from hyla.cli import _add_engine_args, _engine_config

    p = argparse.ArgumentParser()
    _add_engine_args(p, prefix_cache_default=True)
    p.add_argument("--served-model-name", default=None)
    args = p.parse_args(["--model", "qwen3.5-mtp", "--speculative-config",
                         '{"method": "mtp", "num_speculative_tokens": 1}'])
    config = _engine_config(args)
    assert config.model == bundled_model_path("qwen3.5-mtp") and args.served_model_name == "qwen3.5-mtp"
