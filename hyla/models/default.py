"""The bundled models, selectable by name (`hyla serve --model <name>`, `LLM("<name>")`).

- "default" (hyla/assets/default_model): a small Kimi-Linear trained on Python. KDA : NoPE-MLA
  3:1, dense MLPs, ~7M parameters in bf16, a 4096-token byte-level BPE tokenizer; trained by
  scripts/train_default_model.py on the CPython standard library's sources. `hyla serve` and
  `hyla generate` use it when no `--model` is given.
- "qwen3.5-mtp" (hyla/assets/mtp_model): a small Qwen3.5 (Gated DeltaNet : gated attention 3:1)
  with a jointly trained MTP head, for `speculative_config={"method": "mtp", ...}`; trained by
  scripts/train_mtp_model.py on the same corpus with the same tokenizer.

Each folder's training_info.json holds the corpus, steps, seed and validation loss.
"""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_MODELS = {"default": _ASSETS / "default_model", "qwen3.5-mtp": _ASSETS / "mtp_model"}


def bundled_model_path(name: str) -> str:
    """Directory of the bundled checkpoint `name` (config.json, model.safetensors, tokenizer
    files, training_info.json). Raises FileNotFoundError if the install lacks it."""
    path = BUNDLED_MODELS[name]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the bundled model {name!r} is missing from {path} "
                                "(reinstall hyla, or pass a checkpoint directory)")
    return str(path)


def default_model_path() -> str:
    """Directory of the bundled default model (see bundled_model_path)."""
    return bundled_model_path("default")
