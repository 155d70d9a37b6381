"""EngineConfig: every engine knob in one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(value, name: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in ("auto",):
        return None
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(f"{name} must be one of {sorted(_DTYPES)} or 'auto', got {value!r}")


@dataclass
class EngineConfig:
    """model: checkpoint directory. dtype / device: model weights (None = checkpoint dtype on CPU,
    bf16 on CUDA; device None = CUDA when available). max_num_seqs: running requests at most
    (clamped to the state slots the budget holds). max_num_batched_tokens: tokens per step
    (prefill chunks + decodes). max_model_len: prompt + output tokens per request (None = the
    model's limit). memory_budget: bytes for KV pages + state slots (None = derived, see
    memory.plan_memory). state_dtype: recurrent state precision (fp32 default, bf16 option).
    enable_prefix_caching: reuse KV pages + state checkpoints across requests (prefix_cache.py);
    checkpoint_interval: also export a state every that many prompt tokens (default off)."""

    model: str
    dtype: torch.dtype | str | None = None
    device: str | torch.device | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    memory_budget: int | None = None
    enable_prefix_caching: bool = False
    speculative_config: dict | None = None
    enforce_eager: bool = False
    seed: int = 0
    state_dtype: torch.dtype | str = torch.float32
    page_size: int = 16
    checkpoint_interval: int | None = None

    def __post_init__(self):
        self.dtype = parse_dtype(self.dtype, "dtype")
        self.state_dtype = parse_dtype(self.state_dtype, "state_dtype") or torch.float32
        if self.state_dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"state_dtype must be float32, bfloat16 or float64, got {self.state_dtype}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.memory_budget is not None and (not isinstance(self.memory_budget, int) or self.memory_budget <= 0):
            raise ValueError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}")
        if self.checkpoint_interval is not None and (not isinstance(self.checkpoint_interval, int)
                                                     or self.checkpoint_interval < 1):
            raise ValueError(f"checkpoint_interval must be a positive integer, got {self.checkpoint_interval!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
