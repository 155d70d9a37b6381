"""A checkpoint's generation_config.json: the sampling defaults its authors tuned, and its EOS ids.

vLLM's rules, which hyla follows:
- the sampling defaults are the file's `temperature`, `top_p`, `top_k`, `min_p`,
  `repetition_penalty` and `max_new_tokens` (as `max_tokens`); they apply to every request that
  leaves the parameter unset (server) or passes no SamplingParams (`LLM.generate`), unless the
  engine runs with generation_config="vllm" (then there are none);
- every id of its `eos_token_id` (one id or a list) ends a request, beside config.json's, in
  either mode: they are where the checkpoint's turns end (GLM lists three, Qwen two).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class GenerationDefaults:
    """sampling: {SamplingParams field: value} for requests that leave the field unset;
    eos_token_ids: the file's EOS ids."""

    sampling: dict = field(default_factory=dict)
    eos_token_ids: list[int] = field(default_factory=list)


def token_ids(value, where: str) -> list[int]:
    """An `eos_token_id` field (None, one id, or a list of ids) as a list; ValueError naming
    `where` for anything else."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(values)


def _number(key: str, value, file: str):
    if key in ("top_k", "max_new_tokens"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise ValueError(f"{file}: `{key}` must be a {'integer' if key in ('top_k', 'max_new_tokens') else 'number'}, "
                         f"got {value!r}")
    return value


def read_generation_config(directory: str, mode: str = "auto") -> GenerationDefaults:
    """The defaults of `directory`/generation_config.json (none when the file is absent).
    mode: "auto" (the file's sampling defaults and EOS ids) or "vllm" (its EOS ids only).
    A file that is not a JSON object, or a field of the wrong type, is a ValueError naming it."""
    if mode not in ("auto", "vllm"):
        raise ValueError(f"generation config mode must be 'auto' or 'vllm', got {mode!r}")
    file = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(file):
        return GenerationDefaults()
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} does not hold a JSON object")
    eos = token_ids(raw.get("eos_token_id"), file)
    if mode == "vllm":
        return GenerationDefaults(eos_token_ids=eos)
    sampling = {SAMPLING_KEYS[key]: _number(key, raw[key], file)
                for key in SAMPLING_KEYS if raw.get(key) is not None}
    return GenerationDefaults(sampling, eos)
