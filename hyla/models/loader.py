"""Load an HF-format checkpoint: config.json + safetensors (single or sharded).

The family is chosen by config.json's `model_type` (FAMILIES, imported lazily): "kimi_linear" (Kimi-Linear) or
"qwen3_next" (Qwen3-Next). Tensor names are the official ones (what the released checkpoints hold
and what transformers' `save_pretrained` writes); hyla's modules carry the same names, so loading
is a checked copy. Aliases: transformers writes a Kimi-Linear *dense* layer's MLP under
`block_sparse_moe.` (it renames every `mlp.` when saving) and keeps MoE blocks under `mlp.` in
memory, while the released checkpoint has the reverse; both spellings are accepted. Routed
experts are stacked (hyla.layers.moe.StackedExperts: `experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); the per-expert tensors of the released checkpoints
(`experts.{e}.w1/w3/w2`, `experts.{e}.gate_proj/up_proj/down_proj`) are copied straight into
their slices, one tensor at a time, so loading never holds a second copy of the experts; the
fused tensors under those two names load as they are. Tensors of parts a family does not build (Qwen3-Next's `mtp.*`
multi-token-prediction head) are skipped, as transformers skips them.

FP8 weights (hyla.models.fp8): a checkpoint whose quantization_config is FP8, or any checkpoint
with `quantization="fp8"`, loads through hyla.models.fp8_loading: its (weight, weight_scale_inv)
pairs into FP8 modules on CUDA (the expert pairs slice by slice into the stacked FP8 experts, the
scales cut with their weights under tensor parallelism), dequantised into the ordinary model
elsewhere; bf16 weights are quantised as they are read.

Everything is validated from the safetensors headers before any weight memory is allocated: a
missing or unexpected tensor, or a shape mismatch, fails with a ValueError naming it. Pickle
checkpoints (`*.bin`, `*.pt`) are never read.
"""

from __future__ import annotations

import json
import os
import re

import torch
from hyla.models.mxfp4 import logical_weight_map, pack_at_load, safe_open  # safetensors', MXFP4 pairs read as `.weight`

import importlib

from hyla.models.base import HybridForCausalLM
from hyla.models.config import read_config_json
from hyla.models.hub import resolve_model
from hyla.models.memory import FP32_TENSORS
from hyla.models.fp8 import SCALE_SUFFIX as FP8_SCALE
from hyla.models.fp8 import check_quantization, quantization_config_of
from hyla.models.fp8_loading import (Fp8Shard, LoadPlan, check_fp8_weights, convert_model, fp8_modules_on,
                                     init_random_fp8_, mark_fp8_producers)
from hyla.models.random_init import init_random_

# model_type -> ("module:ConfigClass", "module:ModelClass"). A new family adds a line here and its
# own files; the classes are imported on first use, so one family's import never pays for another's.
FAMILIES = {
    "kimi_linear": ("hyla.models.config:KimiLinearConfig", "hyla.models.kimi_linear:KimiLinearForCausalLM"),
    "qwen3_next": ("hyla.models.qwen3_next_config:Qwen3NextConfig", "hyla.models.qwen3_next:Qwen3NextForCausalLM"),
    "glm5_next": ("hyla.models.glm5_next_config:Glm5NextConfig", "hyla.models.glm5_next:Glm5NextForCausalLM"),
    "kimi_k3": ("hyla.models.kimi_k3_config:KimiK3Config", "hyla.models.kimi_k3:KimiK3ForCausalLM"),
    "qwen3_5_text": ("hyla.models.qwen3_5_config:Qwen3_5Config", "hyla.models.qwen3_5:Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("hyla.models.qwen3_5_config:Qwen3_5MoeConfig", "hyla.models.qwen3_5:Qwen3_5ForCausalLM"),
    "qwen3_5": ("hyla.models.qwen3_5_config:Qwen3_5Config", "hyla.models.qwen3_5:Qwen3_5MultimodalForCausalLM"),
    "qwen3_5_moe": ("hyla.models.qwen3_5_config:Qwen3_5MoeConfig",
                    "hyla.models.qwen3_5:Qwen3_5MultimodalForCausalLM"),
}


def _resolve(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def family_classes(model_type: str) -> tuple[type, type]:
    """(config class, model class) of a `model_type`; ValueError naming the supported ones."""
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; hyla supports {sorted(FAMILIES)}")
    config_ref, model_ref = FAMILIES[model_type]
    return _resolve(config_ref), _resolve(model_ref)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "float64": torch.float64}


def load_config(path, revision: str | None = None):
    """The config of the checkpoint at `path` (a directory holding config.json, the file, a
    bundled model's name or a Hub id: hyla.models.hub.resolve_model), parsed by the class its
    `model_type` names."""
    d = read_config_json(resolve_model(path, revision))
    return family_classes(d.get("model_type"))[0].from_hf_dict(d)


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
        return logical_weight_map(files)
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    pickles = [n for n in sorted(os.listdir(path)) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    hint = f" (found {pickles}: pickle checkpoints are not loaded, convert them to safetensors)" if pickles else ""
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}{hint}")


def _canonical(name: str, expected: dict) -> str:
    """The model tensor a checkpoint name fills: itself, or its spelling with `block_sparse_moe.`
    and `mlp.` swapped (transformers writes one where the released Kimi checkpoint has the other)."""
    for candidate in (name, name.replace(".block_sparse_moe.", ".mlp.", 1), name.replace(".mlp.", ".block_sparse_moe.", 1)):
        if candidate in expected:
            return candidate
    return name


def _keeps_fp32(name: str) -> bool:
    return any(name.endswith(suffix) for suffix in FP32_TENSORS)


# A per-expert checkpoint tensor fills one slice of the stacked expert tensors
# (hyla.layers.moe.StackedExperts): Kimi names w1 (gate) / w3 (up) / w2 (down), Qwen
# gate_proj / up_proj / down_proj. Piece index: (expert, half) of gate_up_proj [E, 2I, H]
# (half 0 = gate rows, 1 = up rows) or (expert, None) of down_proj [E, H, I].
# An FP8 checkpoint's per-expert `.weight_scale_inv` fills the same slice of the stacked
# `..._scale_inv` tensor (hyla.layers.fp8_moe.Fp8StackedExperts).
_EXPERT_PIECE = re.compile(r"^(?P<moe>.+)\.experts\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)"
                           r"\.weight(?P<scale>_scale_inv)?$")
_PIECE_OF = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1),
             "up_proj": ("gate_up_proj", 1), "w2": ("down_proj", None), "down_proj": ("down_proj", None)}

Target = tuple  # (model tensor name, None for the whole tensor or (expert, half) for one slice)


def _target(name: str, expected: dict) -> tuple[Target | None, tuple | None]:
    """(target, the shape it must have) for a checkpoint tensor, or (None, None) if unknown."""
    whole = _canonical(name, expected)
    if whole in expected:
        return (whole, None), tuple(expected[whole])
    m = _EXPERT_PIECE.match(name)
    if not m:
        return None, None
    stacked, half = _PIECE_OF[m["proj"]]
    target = _canonical(f"{m['moe']}.experts.{stacked}{m['scale'] or ''}", expected)
    if target not in expected:
        return None, None
    E, rows, cols = expected[target]
    e = int(m["e"])
    if e >= E:
        return None, None
    return (target, (e, half)), (rows // 2 if half is not None else rows, cols)


def _plan(files: dict[str, str], expected: dict[str, torch.Size], optional: set[str],
          ignored: tuple[str, ...] = (), shard=None, view=None, packed_experts: bool = False) -> dict[str, Target]:
    """Map every checkpoint tensor to a model tensor or a slice of one, checking names and shapes
    from the headers. Tensors whose names start with one of `ignored` are skipped. shard: a
    tensor-parallel plan (hyla.parallel.tensor.ShardPlan): names and shapes are this rank's
    (`rename`, `shape`), tensors of other ranks' experts skipped. view: fn(open file) -> the file
    as the load sees it (hyla.models.fp8_loading.Fp8View), None for the file itself.
    packed_experts: MXFP4 routed experts shown as packed rows (hyla.models.mxfp4). Returns
    {checkpoint name: (model name, slice)}."""
    files = {name: file for name, file in files.items() if not name.startswith(ignored)}
    plan, shapes = {}, {}
    view = view or (lambda f: f)
    for file in sorted(set(files.values())):
        with safe_open(file, "pt", packed_experts=packed_experts) as raw:
            f = view(raw)
            for name in f.keys():
                if files.get(name) == file:
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    missing_in_files = sorted(set(files) - set(shapes))
    if missing_in_files:
        raise ValueError(f"tensors listed in the index are absent from their shard: {missing_in_files[:5]}")
    local = {name: name for name in shapes}  # this rank's name -> the checkpoint's
    if shard is not None:
        local = {shard.rename(name): name for name in shapes}
        local.pop(None, None)
        shapes = {name: shard.shape(ckpt, shapes[ckpt]) for name, ckpt in local.items()}
    extra, filled = [], {}
    for name, shape in shapes.items():
        target, want = _target(name, expected)
        if target is None:
            extra.append(name)
            continue
        if target in filled or (target[1] is not None and (target[0], None) in filled):
            raise ValueError(f"checkpoint holds tensor {target[0]}{'' if target[1] is None else target[1]} "
                             f"twice (under two names)")
        if want != shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {list(shape)}, model expects {list(want)}")
        plan[local[name]] = filled[target] = target
    if extra:
        raise ValueError(f"unexpected tensors in checkpoint ({len(extra)}): {sorted(extra)[:8]}")
    missing = []
    pieces: dict[str, set] = {}
    for name, index in filled:
        if index is not None:
            pieces.setdefault(name, set()).add(index)
    for name, shape in expected.items():
        if name in optional or (name, None) in filled:
            continue
        halves = (0, 1) if name.endswith(("gate_up_proj", "gate_up_proj_scale_inv")) else (None,)
        have = pieces.get(name, set())
        gaps = [(e, h) for e in range(shape[0]) for h in halves if (e, h) not in have] if have else [None]
        if gaps:
            missing.append(name if gaps == [None] else f"{name} (experts {sorted({e for e, _ in gaps})[:8]})")
    if missing:
        raise ValueError(f"missing tensors in checkpoint ({len(missing)}): {missing[:8]}")
    return plan


def _copy_into(t: torch.Tensor, index: tuple | None, value: torch.Tensor) -> None:
    """Copy a checkpoint tensor into model tensor t, or into its (expert, half) slice."""
    if index is None:
        t.copy_(value)
        return
    e, half = index
    dst = t[e] if half is None else t[e].chunk(2, dim=0)[half]
    dst.copy_(value)


def _fill(model: torch.nn.Module, files: dict[str, str], plan: dict[str, Target], shard, view=None,
          packed_experts: bool = False) -> None:
    """Copy every planned checkpoint tensor into `model`. Its own function so that the
    name -> parameter map is gone when it returns: held across prepare_for_inference(), it kept
    every replaced expert tensor alive (the weights plus a second copy of every MoE layer)."""
    targets = model.state_dict(keep_vars=True)
    view = view or (lambda f: f)
    with torch.no_grad():
        for file in sorted(set(files.values())):
            with safe_open(file, "pt", device="cpu", packed_experts=packed_experts) as raw:
                f = view(raw)
                for name in f.keys():
                    if files.get(name) == file and name in plan:  # not ignored (mtp.*)
                        target, index = plan[name]
                        value = f.get_tensor(name) if shard is None else shard.read(name, f)
                        _copy_into(targets[target], index, value)


def _fp8_plan(model, fp8_config, files: dict[str, str], expected: dict, shard, device,
              fp8_weights: str) -> LoadPlan:
    """The FP8 load plan (hyla.models.fp8_loading): the meta model's FP8 modules swapped in (on
    CUDA, or as fp8_weights says), checkpoint names mapped to model tensors as `_plan` maps
    them."""
    def target_of(name: str) -> str | None:
        local = shard.rename(name) if shard is not None else name
        target = _target(local, expected)[0] if local is not None else None
        return None if target is None else target[0]

    # a released FP8 checkpoint's scales say which modules are FP8; without files (dummy weights) or
    # quantising online, the config's rule does
    prequantized = any(name.endswith(FP8_SCALE) for name in files)
    fp8 = LoadPlan(fp8_config, prequantized, fp8_modules_on(device, fp8_weights), target_of, device)
    convert_model(model, fp8, list(files))
    return fp8


def load_model(path, dtype=None, device=None, shard=None, random_weights: bool = False,
               revision: str | None = None, quantization: str | None = None, fp8_weights: str = "auto",
               mxfp4_experts: str = "auto") -> HybridForCausalLM:
    """Build the model described by `path`/config.json (the family its `model_type` names) and
    fill it from its safetensors. path: a checkpoint directory, a bundled model's name or a
    Hugging Face Hub id (`org/name` at `revision`: hyla.models.hub.resolve_model).

    dtype: torch dtype (or name) of the weights; None = the checkpoint's `dtype`, else fp32.
    A few small tensors (FP32_TENSORS) stay fp32. device: where to put the model (default cpu).
    shard: one rank's tensor-parallel plan (hyla.parallel.tensor.ShardPlan): the model is built
    from its per-rank config and only this rank's part of each tensor is read.
    random_weights: no safetensors are read (a config.json is enough); every tensor is drawn as
    hyla.models.random_init (benchmarks of released shapes, vLLM's load_format="dummy").
    quantization: None, or "fp8" (vLLM's name) to block-quantise an unquantised checkpoint's
    projections and experts while loading. An FP8 checkpoint (config.json's quantization_config,
    hyla.models.fp8) loads as FP8 with None or "fp8": into FP8 modules on CUDA, dequantised
    elsewhere. Any other value, or "fp8" on another quantised format: ValueError.
    fp8_weights: "auto" (FP8 modules on CUDA, dequantised elsewhere), "fp8" (FP8 modules on any
    device) or "dequantized" (hyla.models.fp8_loading). mxfp4_experts: "auto", "packed",
    "dequantized" or "fp8", how MXFP4 routed experts load (hyla.models.mxfp4).
    Returns the model in eval mode with gradients disabled.

    Peak memory: the weights plus one layer's transient. Nothing here keeps a reference to a
    parameter past the copy, so the tensors that prepare_for_inference() replaces (a MoE layer's
    experts when its shared expert is stacked behind them) are freed layer by layer."""
    path = resolve_model(path, revision)
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path} does not exist")
    config = load_config(path)
    check_fp8_weights(fp8_weights)
    packed_experts = pack_at_load(mxfp4_experts)
    fp8_config = check_quantization(quantization, quantization_config_of(read_config_json(path)))
    if shard is not None:
        config = shard.configure(config)
    config.mxfp4_experts = mxfp4_experts  # read by a family with MXFP4 experts (Kimi K3) as it builds
    model_cls = family_classes(config.model_type)[1]
    dtype = resolve_dtype(dtype, config)
    device = torch.device("cpu" if device is None else device)
    with torch.device("meta"):
        model = model_cls(config)
        if shard is not None:
            shard.prepare(model)
    expected = {name: t.shape for name, t in model.state_dict().items()}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    ignored = getattr(model_cls, "ignored_checkpoint_prefixes", ())
    files, plan, view = ({} if random_weights else weight_files(path)), {}, None
    if fp8_config is not None:
        fp8 = _fp8_plan(model, fp8_config, files, expected, shard, device, fp8_weights)
        files, view = fp8.weight_map(files), fp8.open
        shard = shard if shard is None else Fp8Shard(shard, fp8)
        expected = {name: t.shape for name, t in model.state_dict().items()}  # FP8 modules' tensors
    if not random_weights:
        plan = _plan(files, expected, optional, ignored, shard, view, packed_experts)

    model.to(dtype)
    family_fp32 = getattr(model_cls, "fp32_tensors", ())  # a family's own fp32 tensors (name suffixes)
    for name, t in model.state_dict(keep_vars=True).items():
        if _keeps_fp32(name) or name.endswith(family_fp32):
            t.data = t.data.float()
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty re-creates parameters: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    if random_weights:
        init_random_(model, 0.02, seed=0 if shard is None else shard.rank)
        init_random_fp8_(model, 0.02, seed=0 if shard is None else shard.rank)
    _fill(model, files, plan, shard, view, packed_experts)
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    mark_fp8_producers(model)  # after prepare: it may turn experts into FP8 ones (Kimi K3's MXFP4)
    return model
