"""Load an HF-format checkpoint: config.json + safetensors (single or sharded).

The family is chosen by config.json's `model_type` (FAMILIES): "kimi_linear" (Kimi-Linear) or
"qwen3_next" (Qwen3-Next). Tensor names are the official ones (what the released checkpoints hold
and what transformers' `save_pretrained` writes); hyla's modules carry the same names, so loading
is a checked copy. The only alias: transformers writes a Kimi-Linear *dense* layer's MLP under
`block_sparse_moe.` (it renames every `mlp.` when saving), while the released checkpoint uses
`mlp.`; both are accepted. Tensors of parts a family does not build (Qwen3-Next's `mtp.*`
multi-token-prediction head) are skipped, as transformers skips them.

Everything is validated from the safetensors headers before any weight memory is allocated: a
missing or unexpected tensor, or a shape mismatch, fails with a ValueError naming it. Pickle
checkpoints (`*.bin`, `*.pt`) are never read.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open

from hyla.models.base import HybridForCausalLM
from hyla.models.config import KimiLinearConfig, read_config_json
from hyla.models.kimi_linear import KimiLinearForCausalLM
from hyla.models.memory import FP32_TENSORS
from hyla.models.qwen3_next import Qwen3NextForCausalLM
from hyla.models.qwen3_next_config import Qwen3NextConfig

# model_type -> (config class, model class)
FAMILIES = {
    "kimi_linear": (KimiLinearConfig, KimiLinearForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
}

_DENSE_ALIAS = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "float64": torch.float64}


def load_config(path) -> KimiLinearConfig | Qwen3NextConfig:
    """The config of the checkpoint at `path` (a directory holding config.json, or the file),
    parsed by the class its `model_type` names."""
    d = read_config_json(path)
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; hyla supports {sorted(FAMILIES)}")
    return FAMILIES[model_type][0].from_hf_dict(d)


def resolve_dtype(dtype, config) -> torch.dtype:
    """dtype argument (torch.dtype, its name, or None = the checkpoint's dtype, else fp32)."""
    if dtype is None:
        dtype = config.dtype or "float32"
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def weight_files(path: str) -> dict[str, str]:
    """{tensor name: safetensors file} from model.safetensors or model.safetensors.index.json."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no `weight_map`")
        files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not os.path.isfile(shard):
                raise ValueError(f"shard {os.path.basename(shard)} named in {index} does not exist")
        return files
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    pickles = [n for n in sorted(os.listdir(path)) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    hint = f" (found {pickles}: pickle checkpoints are not loaded, convert them to safetensors)" if pickles else ""
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}{hint}")


def _canonical(name: str, expected: dict) -> str:
    if name in expected:
        return name
    m = _DENSE_ALIAS.match(name)
    if m and f"{m[1]}.mlp.{m[2]}" in expected:
        return f"{m[1]}.mlp.{m[2]}"
    return name


def _keeps_fp32(name: str) -> bool:
    return any(name.endswith(suffix) for suffix in FP32_TENSORS)


def _plan(files: dict[str, str], expected: dict[str, torch.Size], optional: set[str],
          ignored: tuple[str, ...] = ()) -> dict[str, str]:
    """Map every checkpoint tensor to a model tensor, checking names and shapes from the headers.
    Tensors whose names start with one of `ignored` are skipped. Returns {checkpoint name: model name}."""
    files = {name: file for name, file in files.items() if not name.startswith(ignored)}
    plan, shapes = {}, {}
    for file in sorted(set(files.values())):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                if files.get(name) == file:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    missing_in_files = sorted(set(files) - set(shapes))
    if missing_in_files:
        raise ValueError(f"tensors listed in the index are absent from their shard: {missing_in_files[:5]}")
    extra = []
    for name, shape in shapes.items():
        target = _canonical(name, expected)
        if target not in expected:
            extra.append(name)
            continue
        if target in plan.values():
            raise ValueError(f"checkpoint holds tensor {target} twice (under two names)")
        if tuple(expected[target]) != shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {list(shape)}, model expects "
                             f"{list(expected[target])}")
        plan[name] = target
    if extra:
        raise ValueError(f"unexpected tensors in checkpoint ({len(extra)}): {sorted(extra)[:8]}")
    missing = sorted(set(expected) - set(plan.values()) - optional)
    if missing:
        raise ValueError(f"missing tensors in checkpoint ({len(missing)}): {missing[:8]}")
    return plan


def load_model(path, dtype=None, device=None) -> HybridForCausalLM:
    """Build the model described by `path`/config.json (the family its `model_type` names) and
    fill it from its safetensors.

    dtype: torch dtype (or name) of the weights; None = the checkpoint's `dtype`, else fp32.
    A few small tensors (FP32_TENSORS) stay fp32. device: where to put the model (default cpu).
    Returns the model in eval mode with gradients disabled."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path} does not exist")
    config = load_config(path)
    model_cls = FAMILIES[config.model_type][1]
    dtype = resolve_dtype(dtype, config)
    device = torch.device("cpu" if device is None else device)
    with torch.device("meta"):
        model = model_cls(config)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    files = weight_files(path)
    plan = _plan(files, expected, optional, getattr(model_cls, "ignored_checkpoint_prefixes", ()))

    model.to(dtype)
    for name, t in model.state_dict(keep_vars=True).items():
        if _keeps_fp32(name):
            t.data = t.data.float()
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty re-creates parameters: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for file in sorted(set(files.values())):
            with safe_open(file, "pt", device="cpu") as f:
                for name in f.keys():
                    if files.get(name) == file and name in plan:  # not ignored (mtp.*)
                        targets[plan[name]].copy_(f.get_tensor(name))
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return model
