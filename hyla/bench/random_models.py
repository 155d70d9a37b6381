"""Random-weight models of the named shapes (hyla.models.presets) written as checkpoints for the
benches that load files; the shapes and in-memory random models are hyla.models.presets' (re-exported
here for the benches and tests that import them from this module)."""

from __future__ import annotations

import json
from pathlib import Path

from hyla.models.presets import (  # noqa: F401  (re-exported)
    GLM_5_3_FLASH,
    KIMI_LINEAR_48B,
    QWEN3_5_35B,
    QWEN3_NEXT_80B,
    RANDOM_CONFIGS,
    model_config,
    random_config_dict,
    random_model,
)


def random_checkpoint(root, name: str, seed: int = 0) -> Path:
    """Write random config `name` as an fp32 HF checkpoint under root/random-<name>-<seed> (small
    shapes only: the offline CPU comparison, where both engines load the same file)."""
    from safetensors.torch import save_file

    path = Path(root) / f"random-{name}-{seed}"
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        model = random_model(name, seed=seed)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(dict(random_config_dict(name), dtype="float32"), indent=2))
    return path
