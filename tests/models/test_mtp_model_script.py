"""scripts/train_mtp_model.py at CI size: a Qwen3.5 checkpoint with a jointly trained `mtp.*`
head, in the official layout (transformers computes hyla's logits from it), that hyla serves with
MTP speculation token for token as plain greedy."""

import math

import pytest
import torch

from hyla import LLM, SamplingParams
from hyla.models import load_model
from hyla.models.qwen3_5_mtp import load_mtp_head
from tests.scripts import load_script


def _script():
    return load_script("train_mtp_model")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_model")
    out = tmp / "model"
    info = _script().main(["--smoke", "--device", "cpu", "--out", str(out), "--data", str(tmp / "data")])
    return out, info


def test_joint_training_learns_both_objectives(trained):
    out, info = trained
    vocab = info["tokenizer"]["vocab_size"]
    assert info["final_val_loss"] < math.log(vocab)
    last = info["log"][-1]
    assert last["mtp"] < math.log(vocab) and last["next"] < math.log(vocab)  # the head learned too


def test_checkpoint_is_the_official_layout(trained):
    out, _ = trained
    import transformers

    model = load_model(out, dtype=torch.float32)
    head = load_mtp_head(out, model)
    assert sum(p.numel() for p in head.parameters()) > 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), ref(ids).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-4


def test_mtp_speculation_equals_plain_greedy(trained):
    out, _ = trained
    prompts = ["def read(path):", "import os\n\nclass"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(out, dtype="float32").generate(prompts, params)]
    llm = LLM(out, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spec == plain


def test_hyla_serve_speculative_config_mtp(trained):
    """`hyla serve --speculative-config '{"method": "mtp", ...}'`: the serve flags build an MTP
    engine (the same parser and EngineConfig as the CLI) whose greedy completion equals the plain
    engine's."""
    import argparse
    import json

    from fastapi.testclient import TestClient

    from hyla import cli
    from hyla.engine import LLMEngine
    from hyla.server import create_app

    out, _ = trained
    body = {"model": "m", "prompt": "def read(path):", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    texts = []
    for spec in (None, '{"method": "mtp", "num_speculative_tokens": 2}'):
        p = argparse.ArgumentParser()
        cli._add_engine_args(p, prefix_cache_default=True)
        args = p.parse_args(["--model", str(out), "--dtype", "float32"]
                            + (["--speculative-config", spec] if spec else []))
        config = cli._engine_config(args)
        assert (config.speculative_config.method if spec else config.speculative_config) == ("mtp" if spec else None)
        with TestClient(create_app(LLMEngine(config), "m")) as client:
            r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts.append(json.loads(r.text)["choices"][0]["text"])
    assert texts[0] == texts[1]
