"""The bundled default model: a small Kimi-Linear trained on Python (hyla/assets/default_model).

KDA : NoPE-MLA 3:1, dense MLPs, ~7M parameters in bf16, a 4096-token byte-level BPE tokenizer;
trained by scripts/train_default_model.py on the CPython standard library's sources (its
training_info.json holds the corpus, steps, seed and validation loss). `hyla serve` and
`hyla generate` use it when no `--model` is given.
"""

from __future__ import annotations

from pathlib import Path

_DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default_model"


def default_model_path() -> str:
    """Directory of the bundled checkpoint (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json, training_info.json). Raises FileNotFoundError if the install lacks it."""
    if not (_DEFAULT_MODEL / "config.json").is_file():
        raise FileNotFoundError(f"the bundled default model is missing from {_DEFAULT_MODEL} "
                                "(reinstall hyla, or pass a checkpoint with --model)")
    return str(_DEFAULT_MODEL)
