"""Train hyla's bundled default model (hyla/assets/default_model): a small Kimi-Linear on Python.

What it is: a Kimi-Linear-format checkpoint (KDA : NoPE-MLA 3:1, dense SwiGLU MLPs, ~7M
parameters, bf16) with a byte-level BPE tokenizer, trained from scratch with hyla's own model
code (`hyla.models.KimiLinearForCausalLM`, whose KDA layers train through the differentiable
torch `hyla.ops.chunk_kda`). It writes Python. `hyla serve` / `hyla generate` use it when no
`--model` is given; `hyla.models.default_model_path()` returns its directory.

Corpus: the CPython standard library's own `*.py` sources of the interpreter that prepares the
data (`sysconfig.get_paths()["stdlib"]`), so it exists on every machine with Python. Excluded:
the test suites (`test/`, `tests/`, `idle_test/`), `site-packages/`, `encodings/` (codec
tables), `pydoc_data/` (prose dumped into a string) and `_sysconfigdata*` (machine-specific).
Files are taken in sorted path order; every 20th (index % 20 == 0) is held out for validation.
Each file is one document, preceded by `<|endoftext|>` (the BOS / EOS token). The bundled
model's corpus: Python 3.11.7, see `training_info.json` for the file and byte counts.

Tokenizer: byte-level BPE (`tokenizers`, GPT-2 pre-tokenisation, no normaliser, so any text
round-trips exactly), 4096 tokens trained on the training files, with the special tokens
<|endoftext|> (id 0: BOS, EOS and document separator), <|system|>, <|user|>, <|assistant|>;
the chat template is role-tagged turns ending in <|endoftext|>. GPT-2's pre-tokeniser joins a
newline to the next line's indentation, so a prompt is best ended before its last newline
(`"def f(x):"`, not `"def f(x):\n"`, which asks for an unindented next line).

Model (`model_config`): hidden 256, 8 layers = (3 KDA + 1 MLA) x 2 (MLA at 1-based layers 4
and 8, NoPE as in Kimi-Linear), KDA 4 heads x 64, MLA 4 heads (kv_lora_rank 128, qk 64 + 32,
v 64), dense MLP 384, vocab 4096, untied embeddings. Init: normal(0, 0.02), output projections
scaled by 1/sqrt(2 * layers), FLA's A_log / dt_bias init.

Training: AdamW (0.9, 0.95, weight decay 0.1 on matrices), lr 3e-3 with 100 warmup steps then
cosine to 10%, gradient clipping 1.0, batches of 64 random 512-token windows, fp32, seed 0.
`--time-budget S` fixes the step count after 10 timed steps (before warmup ends, so the
schedule equals a run with `--steps` set to the count it chose, which training_info.json
records). The validation loss is the mean cross-entropy over the whole held-out set in
non-overlapping 512-token windows, measured on the bf16 weights that are saved.

The checkpoint saved is the one with the lowest validation loss among the evaluations (every
100 steps and at the end): the model is small but the corpus smaller, so it overfits late in
the run. The bundled checkpoint was made in two steps, preparing the data with CPython 3.11.7
and then training on one H200 (torch 2.11):

    python scripts/train_default_model.py --prepare-only --data .default_model_data
    python scripts/train_default_model.py --data .default_model_data --device cuda \
        --steps 800 --time-budget 250 --out OUT/default_model

Corpus: 578 training files (9.5 MB, 2.63M tokens), 31 validation files (385 kB, 114k tokens).
The budget allowed all 800 steps (~0.25 s each, 197 s of training, 26.2M tokens = 10 epochs);
validation loss 4.67 / 3.87 / 3.59 / 3.42 / 3.36 / 3.40 / 3.45 / 3.51 at steps 100 ... 800, so
the step-500 weights (16.4M tokens seen) were saved: final validation loss 3.362 nats/token =
1.43 bits/byte on the bf16 weights, training loss ~1.9 there. The full record is
hyla/assets/default_model/training_info.json. Without `--data`, the data is prepared from the
running interpreter into a temporary folder first. A CI-sized run on the CPU (a few seconds):

    python scripts/train_default_model.py --smoke --out /tmp/smoke_model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hyla.models.config import KimiLinearConfig  # noqa: E402
from hyla.models.kimi_linear import KimiLinearForCausalLM  # noqa: E402
from hyla.models.memory import FP32_TENSORS  # noqa: E402

DEFAULT_OUT = ROOT / "hyla" / "assets" / "default_model"
EOT = "<|endoftext|>"
SPECIAL_TOKENS = [EOT, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__pycache__"}
VAL_EVERY = 20  # every 20th file (sorted order) is validation

# Sizes: the bundled model and the smoke run.
PRESETS = {
    "default": dict(vocab=4096, hidden=256, blocks=2, heads=4, head_dim=64, mlp=384, kv_lora=128, rope=32,
                    seq_len=512, batch=64, lr=3e-3, warmup=100, steps=800, eval_every=100, max_files=None),
    "smoke": dict(vocab=384, hidden=64, blocks=1, heads=2, head_dim=16, mlp=128, kv_lora=32, rope=8,
                  seq_len=64, batch=4, lr=3e-3, warmup=4, steps=12, eval_every=6, max_files=24),
}


# ---- corpus and tokenizer ---------------------------------------------------------------------

def stdlib_sources(max_files: int | None = None) -> tuple[Path, list[Path]]:
    """The running interpreter's stdlib *.py files (exclusions in the module docstring), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata") or not path.is_file():
            continue
        files.append(rel)
    files.sort(key=lambda p: p.as_posix())
    return root, files[:max_files] if max_files else files


def read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with the special tokens first (<|endoftext|> = 0); encodes with a leading BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B",
                                                       special_tokens=[(EOT, tok.token_to_id(EOT))])
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT,
            "pad_token": EOT, "unk_token": None, "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE}


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """One uint16 stream: each document as [<|endoftext|>, tokens...] (the post-processor's BOS)."""
    encs = tok.encode_batch(texts)
    return np.concatenate([np.asarray(e.ids, dtype=np.uint16) for e in encs])


def prepare(data: Path, preset: dict) -> dict:
    """Write tokenizer.json, tokenizer_config.json, train.bin, val.bin and corpus.json into `data`."""
    root, files = stdlib_sources(preset["max_files"])
    train, val, skipped = [], [], []
    for i, rel in enumerate(files):
        text = read_source(root / rel)
        if text is None:
            skipped.append(rel.as_posix())
            continue
        (val if i % VAL_EVERY == 0 else train).append((rel.as_posix(), text))
    tok = train_tokenizer([t for _, t in train], preset["vocab"])
    data.mkdir(parents=True, exist_ok=True)
    tok.save(str(data / "tokenizer.json"))
    (data / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    info = {"source": "CPython standard library *.py (sysconfig stdlib path)",
            "python_version": platform.python_version(), "python_implementation": platform.python_implementation(),
            "excluded_dirs": sorted(EXCLUDED_DIRS), "val_rule": f"file index % {VAL_EVERY} == 0 (sorted paths)",
            "skipped_unreadable": skipped, "tokenizer_vocab_size": tok.get_vocab_size()}
    for name, split in (("train", train), ("val", val)):
        ids = encode_documents(tok, [t for _, t in split])
        ids.tofile(data / f"{name}.bin")
        info[name] = {"files": len(split), "bytes": sum(len(t.encode("utf-8")) for _, t in split),
                      "tokens": int(ids.size)}
    info["val_files"] = [p for p, _ in val]
    (data / "corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


# ---- model ------------------------------------------------------------------------------------

def model_config(preset: dict, vocab_size: int, eot_id: int) -> dict:
    """config.json for transformers' KimiLinearConfig and hyla (official key names)."""
    n = 4 * preset["blocks"]
    full = [4 * b + 4 for b in range(preset["blocks"])]  # 1-based: every 4th layer is MLA
    kda = [i for i in range(1, n + 1) if i not in full]
    heads, head_dim = preset["heads"], preset["head_dim"]
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "bfloat16",
        "vocab_size": vocab_size, "hidden_size": preset["hidden"], "intermediate_size": preset["mlp"],
        "num_hidden_layers": n, "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "initializer_range": 0.02, "bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id,
        "layer_types": ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)],
        "mlp_layer_types": ["dense"] * n, "first_k_dense_replace": n,
        "linear_attn_config": {"kda_layers": kda, "full_attn_layers": full, "num_heads": heads,
                               "head_dim": head_dim, "short_conv_kernel_size": 4},
        "num_attention_heads": heads, "num_key_value_heads": heads, "q_lora_rank": None,
        "kv_lora_rank": preset["kv_lora"], "qk_nope_head_dim": head_dim, "qk_rope_head_dim": preset["rope"],
        "v_head_dim": head_dim, "mla_use_nope": True, "attention_bias": False,
    }


def init_weights(model: KimiLinearForCausalLM, seed: int) -> None:
    """normal(0, 0.02); o_proj / down_proj scaled by 1/sqrt(2L); FLA's A_log and dt_bias init."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
            elif p.ndim == 1:  # norm weights
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def save_checkpoint(model, config: dict, data: Path, out: Path) -> None:
    """config.json + model.safetensors (bf16, FP32_TENSORS in fp32, hyla's = the official names) +
    the tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        keep = any(name.endswith(s) for s in FP32_TENSORS)
        tensors[name] = t.detach().to("cpu", torch.float32 if keep else torch.bfloat16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors creates it owner-only
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((data / name).read_bytes())


# ---- training ---------------------------------------------------------------------------------

def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def batch_windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, seq_len + 1] windows of `tokens` beginning at `starts`."""
    return tokens[starts[:, None] + torch.arange(seq_len + 1, device=tokens.device)]


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, seq_len: int, batch: int, max_windows: int | None = None) -> float:
    """Mean cross-entropy (nats / token) over non-overlapping windows of `tokens`."""
    seq_len = min(seq_len, tokens.numel() - 1)  # a tiny (smoke) validation split: one short window
    n = (tokens.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    starts = torch.arange(n, device=tokens.device) * seq_len
    total, count = 0.0, 0
    for i in range(0, n, batch):
        w = batch_windows(tokens, starts[i:i + batch], seq_len)
        logits = model(w[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    return total / count


def bf16_roundtrip(model):
    """A copy whose weights are what the bf16 checkpoint holds (computing in fp32)."""
    twin = type(model)(model.config).to(model.device)
    with torch.no_grad():
        for (name, p), q in zip(model.state_dict().items(), twin.state_dict().values()):
            keep = any(name.endswith(s) for s in FP32_TENSORS)
            q.copy_(p if keep else p.to(torch.bfloat16))
    return twin.eval()


def next_token_loss(model, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """w: [B, T + 1] windows -> (mean next-token cross-entropy, {}): the plain LM objective."""
    logits = model(w[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten()), {}


class KimiRecipe:
    """What `train` needs from a model family: its config.json, the trainable model, the init
    and the loss. This one: the bundled Kimi-Linear model."""

    def config(self, preset: dict, vocab_size: int, eot_id: int) -> dict:
        return model_config(preset, vocab_size, eot_id)

    def build(self, config: dict):
        return KimiLinearForCausalLM(KimiLinearConfig.from_hf_dict(config))

    def init(self, model, seed: int) -> None:
        init_weights(model, seed)

    def loss(self, model, w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return next_token_loss(model, w)


def train(args, preset: dict, data: Path, out: Path, recipe=None) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    corpus = json.loads((data / "corpus.json").read_text())
    torch.manual_seed(args.seed)
    train_ids = torch.from_numpy(np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int64)).to(device)
    val_ids = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int64)).to(device)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    recipe = recipe or KimiRecipe()
    config = recipe.config(preset, tok.get_vocab_size(), tok.token_to_id(EOT))
    model = recipe.build(config)
    recipe.init(model, args.seed)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith("A_log")]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and not n.endswith("A_log"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=preset["lr"], betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    seq_len, bsz, warmup = preset["seq_len"], preset["batch"], preset["warmup"]
    total = args.steps or preset["steps"]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"device {device}, {n_params:,} parameters, train {train_ids.numel():,} tokens, "
          f"val {val_ids.numel():,} tokens, batch {bsz} x {seq_len}", flush=True)

    log, t0, step, timed_from = [], time.perf_counter(), 0, None
    best = (math.inf, 0, None)  # (val loss, step, state): the checkpoint saved is the best evaluated
    while step < total:
        if args.time_budget and step == 2:
            _sync(device)
            timed_from = time.perf_counter()
        if args.time_budget and step == 10 and total > 10:  # fix the schedule before warmup ends
            _sync(device)
            per_step = (time.perf_counter() - timed_from) / 8
            left = args.time_budget - (time.perf_counter() - t0)
            total = max(warmup + 1, step + 1, step + int(0.97 * left / per_step))  # 3%: the periodic evaluations
            if args.steps:
                total = min(total, args.steps)
            print(f"{per_step * 1e3:.0f} ms/step -> {total} steps in the {args.time_budget:.0f} s budget", flush=True)
        lr = lr_at(step, total, preset["lr"], warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - seq_len - 1, (bsz,), device=device, generator=gen)
        w = batch_windows(train_ids, starts, seq_len)
        loss, parts = recipe.loss(model, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % max(1, preset["eval_every"] // 4) == 0 or step == total:
            elapsed = time.perf_counter() - t0
            line = (f"step {step}/{total} loss {loss.item():.4f} lr {lr:.2e} gnorm {gnorm.item():.2f} "
                    f"tok/s {step * bsz * seq_len / elapsed:,.0f} t {elapsed:.0f}s"
                    + "".join(f" {k} {v:.4f}" for k, v in parts.items()))
            if step % preset["eval_every"] == 0 or step == total:
                model.eval()
                val = evaluate(model, val_ids, seq_len, bsz)
                model.train()
                line += f" val {val:.4f}"
                log.append({"step": step, "train_loss": round(loss.item(), 4), "val_loss": round(val, 4),
                            **{k: round(v, 4) for k, v in parts.items()}})
                if val < best[0]:
                    best = (val, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            print(line, flush=True)
    train_time = time.perf_counter() - t0
    model.load_state_dict(best[2])
    model.eval()
    final = evaluate(bf16_roundtrip(model), val_ids, seq_len, bsz)
    val_bytes, val_tokens = corpus["val"]["bytes"], corpus["val"]["tokens"]
    info = {
        "corpus": {k: corpus[k] for k in ("source", "python_version", "python_implementation", "excluded_dirs",
                                          "val_rule", "train", "val")},
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "special_tokens": SPECIAL_TOKENS},
        "model": {"parameters": n_params, "layers": config["layer_types"], "hidden_size": config["hidden_size"],
                  "intermediate_size": config["intermediate_size"], "saved_dtype": "bfloat16"},
        "training": {"seed": args.seed, "steps": total, "batch": bsz, "seq_len": seq_len,
                     "tokens_seen": total * bsz * seq_len,
                     "epochs": round(total * bsz * seq_len / train_ids.numel(), 2), "peak_lr": preset["lr"],
                     "warmup_steps": warmup, "schedule": "linear warmup, cosine to 10%", "optimizer":
                     "AdamW(0.9, 0.95), wd 0.1 on matrices, clip 1.0", "precision": "fp32",
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "train_seconds": round(train_time, 1),
                     "saved_step": best[1], "tokens_seen_at_saved_step": best[1] * bsz * seq_len,
                     "reproduce": f"--steps {total} --seed {args.seed}" + (" --smoke" if args.smoke else "")},
        "final_val_loss": round(final, 4),
        "final_val_bits_per_byte": round(final * val_tokens / val_bytes / math.log(2), 4),
        "log": log,
    }
    print(f"final validation loss {final:.4f} nats/token ({info['final_val_bits_per_byte']:.3f} bits/byte) "
          f"after {total} steps, {info['training']['tokens_seen']:,} tokens, {train_time:.0f}s", flush=True)
    save_checkpoint(model, config, data, out)
    (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved to {out}", flush=True)
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None, recipe=None, default_out: Path = DEFAULT_OUT) -> dict | None:
    """The command line; `recipe` / `default_out`: another model family's (scripts/train_mtp_model.py)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="prepared data folder (prepared here if it lacks corpus.json)")
    parser.add_argument("--out", type=Path, help=f"checkpoint folder (default {default_out}; required with --smoke)")
    parser.add_argument("--prepare-only", action="store_true", help="build corpus + tokenizer, do not train")
    parser.add_argument("--smoke", action="store_true", help="tiny corpus, model and step count (CPU, seconds)")
    parser.add_argument("--steps", type=int, help="training steps (default: the preset's; an upper bound "
                        "with --time-budget)")
    parser.add_argument("--time-budget", type=float, help="seconds of training: fixes --steps after 10 timed steps")
    parser.add_argument("--device", help="cpu / cuda (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    preset = PRESETS["smoke" if args.smoke else "default"]
    if args.smoke and args.out is None:
        parser.error("--smoke needs --out (it must not overwrite the bundled model)")
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp)
        if not (data / "corpus.json").is_file():
            info = prepare(data, preset)
            print(f"prepared {data}: Python {info['python_version']} stdlib, train {info['train']}, "
                  f"val {info['val']}", flush=True)
        if args.prepare_only:
            return None
        return train(args, preset, data, args.out or default_out, recipe)


if __name__ == "__main__":
    main()
