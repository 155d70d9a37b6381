"""transformers on hyla's weights: the peer of the GPU benches, in the same run, same tensors.

    hf = build_peer(model, config_dict)        # KimiLinearForCausalLM / Qwen3NextForCausalLM

The transformers model is built on the meta device, then every one of its tensors is pointed at
hyla's (storage shared, nothing copied: the 48B shape does not fit twice in one GPU) where the
layout is the same. Only these are new tensors (all small, except the experts of the old layout):

- Kimi-Linear (transformers' conversion_mapping "kimi_linear"): `self_attn.conv1d.weight`
  [3D, 1, W] = cat(q_conv1d, k_conv1d, v_conv1d) (copied); `self_attn.forget_gate.{f_a_proj,
  f_b_proj, dt_bias, A_log}` = hyla's `self_attn.*` (shared); an MoE layer's `mlp.` = hyla's
  `block_sparse_moe.` (shared); a dense layer's `mlp.` is `mlp.` in both;
- routed experts, both families: `experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and
  `experts.down_proj` [E, H, I] are shared with hyla's stacked tensors of the same names; a hyla
  with per-expert modules (`experts.{e}.w1/w3/w2` Kimi, `experts.{e}.gate_proj/up_proj/down_proj`
  Qwen3-Next) is stacked on the fly (copied);
- Qwen3-Next's router `mlp.gate.weight`: hyla keeps it fp32, transformers multiplies it with the
  activations in their dtype, so it is cast to the model dtype (a copy; the identity in fp32).

Non-persistent buffers (Qwen3-Next's rotary inverse frequencies) are rebuilt on the device; any
tensor still on meta afterwards is an error. The experts run `experts_implementation`
("grouped_mm" by default: `torch.nn.functional.grouped_mm` on CUDA, its loop fallback on CPU),
set on the config and again with `set_experts_implementation` (transformers 5.17 and 5.24 both
take it so). The linear-attention kernels are flash-linear-attention's (`fla`) when it imports,
otherwise transformers' torch fallbacks (it logs a warning); the short conv is the
`causal_conv1d` package's when installed, otherwise a torch conv1d.

Decode (`decode_step_ms`): the cache is filled by prefilling random token ids, in chunks of
sequences (each its own DynamicCache, concatenated along the batch afterwards) so a large
batch x context prefill stays within memory; one decode forward is then timed (CUDA events,
median), and before every timed step the cache is put back to the prefilled context (attention
keys / values by reference: a decode step concatenates new tensors; linear states by copy:
they are updated in place).
"""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

from hyla.bench.floor import median_ms
from hyla.models.config import TransformersNames

_CONFIG_SKIP = ("architectures", "model_type", "dtype", "torch_dtype")


def hf_config(config_dict: dict, dtype: torch.dtype, experts_implementation: str | None = "grouped_mm",
              names: TransformersNames | None = None):
    """transformers' config for a hyla config.json dict (same keys, less names.config_drop)."""
    import transformers

    drop = _CONFIG_SKIP + (names.config_drop if names is not None else ())
    kw = {k: v for k, v in config_dict.items() if k not in drop}
    if experts_implementation is not None:
        kw["experts_implementation"] = experts_implementation
    config = transformers.AutoConfig.for_model(config_dict["model_type"], **kw)
    config.dtype = dtype
    return config


def _stack(sd: dict, prefix: str, names: tuple[str, ...], num_experts: int) -> torch.Tensor:
    """Old per-expert layout -> [E, sum of rows, cols]: cat of `names` per expert, stacked."""
    return torch.stack([torch.cat([sd[f"{prefix}{e}.{n}.weight"] for n in names]) for e in range(num_experts)])


def _source(name: str, sd: dict, names: TransformersNames, num_experts: int) -> torch.Tensor | None:
    """The hyla tensor (shared) or a new one (copied) that transformers' tensor `name` holds;
    `names`: the family's naming differences (its config's TRANSFORMERS_NAMES)."""
    candidates = [name] + [name.replace(theirs, ours) for theirs, ours in names.renames]
    for cand in candidates:
        if cand in sd:
            return sd[cand]
    if names.fused_conv and name.endswith(".conv1d.weight"):
        base = name[: -len("conv1d.weight")]
        return torch.cat([sd[f"{base}{p}_conv1d.weight"] for p in "qkv"])
    m = re.match(r"^(.*\.)experts\.(gate_up_proj|down_proj)$", name)
    if m:
        for prefix in dict.fromkeys(c[: -len(m[2])] for c in candidates):  # hyla's experts module
            if f"{prefix}0.{names.expert_pieces[m[2]][0]}.weight" in sd:
                return _stack(sd, prefix, names.expert_pieces[m[2]], num_experts)
    return None


def _set_tensor(root: nn.Module, name: str, t: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = root.get_submodule(mod_name)
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(t, requires_grad=False)
    elif attr in mod._buffers:
        mod._buffers[attr] = t
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of transformers' model")


def _rebuild_meta_buffers(hf, device) -> None:
    """Modules whose non-persistent buffers stayed on meta (rotary embeddings): rebuilt on device."""
    for name, mod in list(hf.named_modules()):
        if not any(b.is_meta for b in mod.buffers(recurse=False)):
            continue
        if "Rotary" not in type(mod).__name__:
            raise RuntimeError(f"transformers module {name} ({type(mod).__name__}) has meta buffers that "
                               "hyla cannot rebuild")
        with torch.device(device):
            new = type(mod)(hf.config)
        parent, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(parent) if parent else hf, attr, new)


def build_peer(model, config_dict: dict, experts_implementation: str = "grouped_mm"):
    """transformers' model of `config_dict` whose tensors are hyla `model`'s (see the module
    docstring). Eval mode, no gradients."""
    import transformers

    names = type(model.config).TRANSFORMERS_NAMES
    config = hf_config(config_dict, model.dtype, experts_implementation, names)
    with torch.device("meta"):
        hf = getattr(transformers, names.model_class)(config)
    if experts_implementation is not None and hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation(experts_implementation)
    sd = model.state_dict()
    num_experts = getattr(model.config, "num_experts", 0)
    # parts hyla does not build (a vision tower): allocated uninitialised, never run by a text forward
    unused = tuple(getattr(type(model), "ignored_checkpoint_prefixes", ()))
    missing, unbuilt = [], set()
    with torch.no_grad():
        for name, want in hf.state_dict(keep_vars=True).items():
            t = _source(name, sd, names, num_experts)
            if t is None and name.startswith(unused):
                unbuilt.add(next(p for p in unused if name.startswith(p)).rstrip("."))
                continue
            if t is None:
                missing.append(name)
                continue
            if tuple(t.shape) != tuple(want.shape):
                raise ValueError(f"{name}: hyla's tensor has shape {list(t.shape)}, transformers' {list(want.shape)}")
            if names.router_in_model_dtype and name.endswith(".mlp.gate.weight"):
                t = t.to(model.dtype)
            _set_tensor(hf, name, t)
    if missing:
        raise ValueError(f"no hyla tensor for {len(missing)} transformers tensors: {missing[:6]}")
    for name in sorted(unbuilt):
        hf.get_submodule(name).to_empty(device=model.device)
    if config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    _rebuild_meta_buffers(hf, model.device)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"transformers tensors still on meta: {left[:6]}")
    return hf.eval().requires_grad_(False)


def peer_versions() -> str:
    """transformers' version and whether its fast kernels' packages are there."""
    import importlib.util

    import transformers

    fla = "absent (torch fallbacks)"
    try:
        import fla as fla_mod  # a namespace folder named fla has no __version__: absent

        fla = getattr(fla_mod, "__version__", fla)
    except ImportError:
        pass
    except Exception as err:  # noqa: BLE001
        fla = f"fails to import ({type(err).__name__}: {err})"
    conv = "present" if importlib.util.find_spec("causal_conv1d") is not None else "absent (torch conv1d)"
    return f"transformers {transformers.__version__}, fla {fla}, causal_conv1d {conv}"


def kernels_bound(hf) -> str:
    """Which implementation transformers bound for each kernel-backed function of `hf`'s modeling
    module (fla's recurrences, causal_conv1d's convs): 'package' or 'torch' (its fallback)."""
    import sys

    out = []
    for name, fn in vars(sys.modules[type(hf).__module__]).items():
        if not inspect.isfunction(fn) or fn.__closure__ is None:
            continue
        try:
            found = inspect.getclosurevars(fn).nonlocals
        except (TypeError, ValueError):
            continue
        if "is_new_implementation" in found and "package" in found:
            out.append(f"{name}: {found['package'] if found['is_new_implementation'] else 'torch'}")
    return ", ".join(out) or "none found"


# ---- the decode step -----------------------------------------------------------------------

def _cache_kwarg(hf) -> str:
    """5.24 names the cache argument `cache` (past_key_values deprecated), 5.17 `past_key_values`."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def _layer_tensors(layer) -> dict:
    """{attribute: tensor or {state index: tensor}} of one transformers cache layer: every tensor
    it holds (keys / values, an indexer's keys, empty NoPE values included) and its dicts of
    tensors (linear layers' conv and recurrent states)."""
    out = {}
    for attr, v in vars(layer).items():
        if isinstance(v, torch.Tensor):
            out[attr] = v
        elif isinstance(v, dict) and any(isinstance(t, torch.Tensor) for t in v.values()):
            out[attr] = {k: t for k, t in v.items() if isinstance(t, torch.Tensor)}
    return out


def _merge(caches: list):
    """Concatenate per-chunk caches along the batch (dim 0) into the first one. A zero-dim tensor
    is a per-layer counter shared by the batch (transformers 5.25's `cumulative_length_linear`,
    the tokens a linear layer has seen): equal chunks agree on it, so it is kept as it is."""
    first = caches[0]
    for i, layer in enumerate(first.layers):
        parts = [_layer_tensors(c.layers[i]) for c in caches]
        for attr, v in parts[0].items():
            if isinstance(v, torch.Tensor) and v.dim() == 0:
                if any(not torch.equal(p[attr], v) for p in parts):
                    raise ValueError(f"cache chunks disagree on the per-layer counter {attr!r}: "
                                     "merge chunks of equal token counts only")
            elif isinstance(v, torch.Tensor):
                setattr(layer, attr, torch.cat([p[attr] for p in parts]))
            else:
                store = getattr(layer, attr)
                for k in v:
                    store[k] = torch.cat([p[attr][k] for p in parts])
    return first


@torch.inference_mode()
def _snapshot(cache) -> list[dict]:
    snap = []
    for layer in cache.layers:
        entry = {}
        for attr, v in _layer_tensors(layer).items():
            # keys / values: a decode step concatenates new tensors (kept by reference); linear
            # states and zero-dim counters (transformers 5.25) are updated in place (cloned)
            if isinstance(v, torch.Tensor):
                entry[attr] = v.clone() if v.dim() == 0 else v
            else:
                entry[attr] = {k: t.clone() for k, t in v.items()}
        snap.append(entry)
    return snap


@torch.inference_mode()
def _restore(cache, snap: list[dict]) -> None:
    for layer, entry in zip(cache.layers, snap):
        for attr, v in entry.items():
            if isinstance(v, torch.Tensor):
                setattr(layer, attr, v.clone() if v.dim() == 0 else v)
                continue
            store = getattr(layer, attr)
            for k, saved in v.items():
                if isinstance(store.get(k), torch.Tensor) and store[k].shape == saved.shape:
                    store[k].copy_(saved)
                else:
                    store[k] = saved.clone()


def prefilled_cache(hf, ids: torch.Tensor, chunk_tokens: int = 65536):
    """A DynamicCache holding ids [B, T] (prefilled in chunks of max(1, chunk_tokens // T) sequences)."""
    from transformers import DynamicCache

    kw = _cache_kwarg(hf)
    per = max(1, chunk_tokens // ids.shape[1])
    caches = []
    with torch.inference_mode():
        for s in range(0, ids.shape[0], per):
            cache = DynamicCache(config=hf.config)
            hf(input_ids=ids[s:s + per], use_cache=True, logits_to_keep=1, **{kw: cache})
            caches.append(cache)
    return _merge(caches) if len(caches) > 1 else caches[0]


def decode_step_ms(hf, batch: int, context: int, vocab: int, repeat: int = 5, seed: int = 0) -> float:
    """Median ms of one transformers decode forward of `batch` sequences at `context` tokens."""
    device = next(hf.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, context), generator=gen).to(device)
    step = torch.randint(3, vocab, (batch, 1), generator=gen).to(device)
    cache = prefilled_cache(hf, ids)
    del ids
    snap = _snapshot(cache)
    kw = _cache_kwarg(hf)

    def run():
        with torch.inference_mode():
            hf(input_ids=step, use_cache=True, **{kw: cache})
    return median_ms(run, repeat, setup=lambda: _restore(cache, snap), device=device)


def prefill_ms(hf, tokens: int, vocab: int, repeat: int = 3, seed: int = 0) -> float:
    """Median ms of one transformers forward of one `tokens`-long prompt (a fresh cache each)."""
    device = next(hf.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(3, vocab, (1, tokens), generator=gen).to(device)

    def run():
        with torch.inference_mode():
            hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    return median_ms(run, repeat, device=device)


def hf_moe_block(hf, hyla_prefix: str) -> nn.Module:
    """transformers' MoE block matching hyla's block at `hyla_prefix`."""
    return hf.get_submodule(hyla_prefix.replace(".block_sparse_moe", ".mlp"))


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()
