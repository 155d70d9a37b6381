"""Small helpers shared by engine tests: deterministic token lists and a near-copy draft model."""

import shutil

import torch
from safetensors.torch import load_file, save_file


def rand_tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    """n token ids in 3..vocab-1 (ids 0-2 are the tiny checkpoints' special tokens)."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def noisy_lm_head_copy(src, dst, scale: float = 0.02, seed: int = 5):
    """Copy checkpoint `src` to `dst` with noise on its LM head: a draft model that agrees with
    the target often but not always (partial acceptance). Returns dst."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    w = tensors["lm_head.weight"]
    tensors["lm_head.weight"] = w + scale * torch.randn(w.shape, generator=torch.Generator().manual_seed(seed))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
