"""The bundled default model (hyla/assets/default_model) and the script that trains it."""

import bisect
import json
import keyword
import math
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hyla.models import default_model_path, load_model, load_tokenizer
from hyla.models.config import DENSE, FULL, LINEAR
from tests.scripts import load_script

PYTHON_SOURCE = 'import os\n\n\ndef read(path, mode="r"):\n    """Read a file."""\n    with open(path) as f:\n'


@pytest.fixture(scope="module")
def path():
    return Path(default_model_path())


@pytest.fixture(scope="module")
def model(path):
    return load_model(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(path):
    return load_tokenizer(path)


def test_bundled_checkpoint_layout(path):
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "training_info.json"} <= names
    assert sum(p.stat().st_size for p in path.iterdir()) <= 16_000_000
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_linear" and config["mla_use_nope"] is True
    kinds = config["layer_types"]
    assert kinds.count(LINEAR) == 3 * kinds.count(FULL) and all(t == DENSE for t in config["mlp_layer_types"])
    info = json.loads((path / "training_info.json").read_text())
    assert math.isfinite(info["final_val_loss"]) and info["training"]["steps"] > 0
    assert 1_000_000 <= info["model"]["parameters"] <= 10_000_000


def test_logits_match_transformers(path, model, tok):
    from transformers import KimiLinearForCausalLM

    ref, info = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([tok.encode(PYTHON_SOURCE)])
    assert ids.shape[1] > 20
    with torch.no_grad():
        ours, theirs = model(ids), ref.eval()(ids).logits
    assert ours.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_tokenizer_round_trips_python(tok):
    for module in (bisect, json.decoder, re):
        src = Path(module.__file__).read_text(encoding="utf-8")
        ids = tok.encode(src)
        assert ids[0] == tok.bos_token_id == tok.eos_token_id == 0
        assert tok.decode(ids) == src
        assert len(ids) < len(src.encode()) / 2.5  # BPE merges, not bytes
    assert tok.decode(tok.encode("x = 'é → ✓'\t\r\n")) == "x = 'é → ✓'\t\r\n"  # byte-level: any text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|endoftext|><|user|>\nhi<|endoftext|><|assistant|>\n"


def test_predicts_held_out_python(model, tok):
    """bisect.py is held out (validation split): far below the uniform 8.3 nats / token."""
    ids = torch.tensor([tok.encode(Path(bisect.__file__).read_text(encoding="utf-8"))[:512]])
    with torch.no_grad():
        loss = F.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:]).item()
    assert loss < 4.5


def test_greedy_generation_is_python(path):
    from hyla import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=2)
    prompt = "def read_file(path):"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0]
    text = prompt + out.outputs[0].text
    words = set(re.findall(r"[A-Za-z_]+", text))
    assert len(words & set(keyword.kwlist)) >= 3, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) >= 5, text
    indents = [len(line) - len(line.lstrip(" ")) for line in lines]
    assert sum(i % 4 == 0 for i in indents) >= 0.9 * len(lines), text  # PEP 8 indentation
    assert any(i > 0 for i in indents), text  # the body is indented under the def


def _script():
    return load_script("train_default_model")


def test_training_script_smoke(tmp_path):
    """--smoke: corpus, tokenizer, a few steps and a checkpoint that hyla loads, on the CPU."""
    out = tmp_path / "model"
    info = _script().main(["--smoke", "--device", "cpu", "--out", str(out), "--data", str(tmp_path / "data")])
    vocab = info["tokenizer"]["vocab_size"]
    assert info["final_val_loss"] < math.log(vocab)  # it learned something in 12 steps
    assert info["corpus"]["python_version"] and info["corpus"]["train"]["bytes"] > 0
    model, tok = load_model(out, dtype=torch.float32), load_tokenizer(out)
    assert model.config.vocab_size == vocab and model.config.layer_types.count(FULL) == 1
    assert tok.decode(tok.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    assert os.stat(out / "model.safetensors").st_size < 2_000_000
