"""scripts/train_k3_model.py at CI size: a small Kimi K3 (KDA + gated NoPE MLA, block attention
residuals, latent SiTU MoE) trained with hyla's modules learns, and its checkpoint is what the
training computed: hyla's loader rebuilds it (no transformers class exists for K3), its logits
equal the training forward's on the saved weights, its validation loss is the one recorded, and
hyla's engine generates with it the greedy tokens of a full-forward argmax loop.

Tolerances: the training forward (a loop over experts) and hyla's inference path (sorted
grouped GEMMs, the chunked KDA of the loader's model) compute the same fp32 function in other
summation orders: 1e-5 relative on the logits; the recorded loss is rounded to 4 decimals."""

import json
import math
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hyla import LLM, SamplingParams
from hyla.layers.latent_moe import LatentMoE
from hyla.models import load_model
from tests.scripts import load_script

torch.set_num_threads(1)  # CI's few cores are shared: threads only contend


def _script():
    return load_script("train_k3_model")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k3_model")
    out, data = tmp / "model", tmp / "data"
    info = _script().main(["--smoke", "--device", "cpu", "--out", str(out), "--data", str(data)])
    return out, data, info


def test_smoke_run_learns_and_logs_like_the_bundled_model(trained):
    out, _, info = trained
    vocab = info["tokenizer"]["vocab_size"]
    log = info["log"]
    assert [e["step"] for e in log] == [6, 12]  # the bundled model's format: every eval_every steps
    assert set(log[0]) >= {"step", "train_loss", "val_loss"}
    assert log[-1]["val_loss"] < log[0]["val_loss"] < math.log(vocab)  # below chance, and falling
    assert json.loads((out / "training_info.json").read_text())["log"] == log
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and "hidden_size" not in config  # K3's layout: text_config


def test_checkpoint_is_k3_shaped(trained):
    out, _, _ = trained
    model = load_model(out, dtype=torch.float32)
    c = model.config
    assert c.num_attn_res_blocks >= 2 and c.use_full_rank_gate and c.mla_use_output_gate
    assert c.mlp_layer_types[0] == "dense" and set(c.mlp_layer_types[1:]) == {"sparse"}
    assert {"linear_attention", "full_attention"} == set(c.layer_types)
    moe = model.model.layers[1].block_sparse_moe
    assert isinstance(moe, LatentMoE) and moe.latent and moe.routed_expert_norm is not None
    # the router's bias was trained (auxiliary-loss-free balancing), not left at zero
    assert moe.gate.e_score_correction_bias.abs().sum() > 0
    assert model.model.layers[0].self_attn.A_log.shape == (c.linear_head_dim,)


def test_loaded_logits_equal_the_training_forward(trained):
    out, data, info = trained
    script = _script()
    config = json.loads((out / "config.json").read_text())
    trainable = script.K3Recipe(smoke=True).build(config)
    state = {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}
    trainable.load_state_dict(state)
    trainable.eval()
    model = load_model(out, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(ids), trainable(ids)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
    # the saved weights are the ones whose validation loss training_info.json records
    val = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64))
    base = sys.modules["train_default_model"]
    assert abs(base.evaluate(model, val, 64, 4) - info["final_val_loss"]) < 1e-4


def test_engine_greedy_equals_the_forward_argmax(trained):
    """hyla's engine (KDA state slots, MLA latent pages, the residual bank per step, two prompts
    batched) generates what a full forward's argmax does, token for token."""
    out, _, _ = trained
    model = load_model(out, dtype=torch.float32)
    llm = LLM(out, dtype="float32")
    prompts = [llm.tokenizer.encode("def read(path):"), llm.tokenizer.encode("import os\n\nclass")]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert list(output.outputs[0].token_ids) == seq[len(prompt):]
