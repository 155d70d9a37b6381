"""The FP8 checkpoint format (fine-grained, block-quantised FP8: Qwen3-Next-80B-A3B-FP8, the
Qwen3.5 / GLM FP8 releases, DeepSeek-V3's layout) and hyla's online FP8 quantisation.

config.json:

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

Tensors of a converted module `<m>`: `<m>.weight` float8_e4m3fn [out, in] and
`<m>.weight_scale_inv` (fp32, or bf16 in some releases) [ceil(out/128), ceil(in/128)]; the weight
is fp8 value x the scale of its 128 x 128 block, the last row / column block partial
(hyla.ops.fp8 holds the arithmetic: `block_quantize`, `block_dequantize`). Routed experts are
stored per expert (`experts.{e}.gate_proj / up_proj / down_proj` or Kimi's w1 / w3 / w2), each
with its own scales. Unconverted modules (`modules_to_not_convert`, norms, embeddings, routers,
usually lm_head) are stored in bf16 without scales.

`modules_to_not_convert` entries match a module name as transformers matches them
(transformers.quantizers.quantizers_utils.should_convert_module): from the start up to a module
boundary ("model.layers.1" skips "model.layers.1.mlp", not "model.layers.11"), as a regex with
the same boundary ("model.layers.*.mlp.gate" skips "model.layers.3.mlp.gate", not
"...mlp.gate_proj"), or as a suffix ("lm_head").

Which modules hyla converts when it quantises a bf16 checkpoint itself (`quantization="fp8"`,
vLLM's name): every linear projection (nn.Linear) and the routed experts, shared experts
included, except those `modules_to_not_convert` names and except `lm_head`; embeddings, norms,
routers (not nn.Linear in hyla), convolutions and other small parameters never are. A released
checkpoint is read as it is: a module is FP8 where its tensors have scales.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hyla.ops.fp8 import BLOCK, FP8_DTYPE, FP8_MAX, block_dequantize, block_quantize, scale_shape

__all__ = ["Fp8Config", "parse_fp8_config", "is_fp8", "skipped", "QUANTIZATIONS", "check_quantization", "quantization_config_of",
           "block_quantize", "block_dequantize", "scale_shape", "BLOCK", "FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX",
           "ONLINE_DEFAULT_SKIPS"]

QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization / --quantization values besides None
SCALE_SUFFIX = "_scale_inv"  # `<m>.weight` -> `<m>.weight_scale_inv`
_FMTS = ("e4m3",)
_ACTIVATION_SCHEMES = ("dynamic",)
_SCALE_FMTS = ("float", "ue8m0")  # ue8m0: power-of-two values, still stored as float tensors here
# hyla's own online quantisation keeps the output head in the model dtype (transformers and
# the released FP8 checkpoints do the same)
ONLINE_DEFAULT_SKIPS = ("lm_head",)


@dataclass(frozen=True)
class Fp8Config:
    """A validated FP8 `quantization_config` (only the values hyla runs: e4m3 weights, 128 x 128
    blocks, dynamic activation scales)."""

    weight_block_size: tuple[int, int] = (BLOCK, BLOCK)
    modules_to_not_convert: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"

    def to_dict(self) -> dict:
        """The config.json form (what a converter writes next to the quantised tensors)."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme,
                "weight_block_size": list(self.weight_block_size),
                "modules_to_not_convert": list(self.modules_to_not_convert)}


def is_fp8(quantization_config) -> bool:
    """True for a `quantization_config` whose quant_method is "fp8" (validated by parse_fp8_config)."""
    return isinstance(quantization_config, dict) and quantization_config.get("quant_method") == "fp8"


def parse_fp8_config(q: dict) -> Fp8Config:
    """config.json's `quantization_config` -> Fp8Config. ValueError naming the field for a bad or
    unsupported value: quant_method (must be "fp8"), fmt (e4m3 only), activation_scheme (dynamic
    only: static activation scales are not supported), weight_block_size ([128, 128] only: the
    kernels' block), scale_fmt, modules_to_not_convert (a list of strings)."""
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {type(q).__name__}")
    if q.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method must be 'fp8' for FP8 weights, got "
                         f"{q.get('quant_method')!r}")
    fmt = q.get("fmt", "e4m3")
    if fmt not in _FMTS:
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported: hyla reads FP8 weights in {_FMTS}")
    scheme = q.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() not in _ACTIVATION_SCHEMES:
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported: hyla quantises "
                         f"activations at run time ({_ACTIVATION_SCHEMES}), static activation scales are not read")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be a list of two integers, got {block!r} "
                         "(per-tensor FP8 scales are not supported)")
    if tuple(block) != (BLOCK, BLOCK):
        raise ValueError(f"quantization_config.weight_block_size {list(block)} is not supported: hyla's FP8 "
                         f"kernels use [{BLOCK}, {BLOCK}] blocks")
    scale_fmt = q.get("scale_fmt", "float")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"quantization_config.scale_fmt {scale_fmt!r} is not supported; use one of {_SCALE_FMTS}")
    skip = q.get("modules_to_not_convert", q.get("ignored_layers")) or []
    if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"quantization_config.modules_to_not_convert must be a list of module names, got {skip!r}")
    return Fp8Config((BLOCK, BLOCK), tuple(skip), scheme.lower())


def skipped(module_name: str, patterns) -> bool:
    """Whether `module_name` matches one of `patterns` (modules_to_not_convert): a prefix ending at
    a module boundary, a regex with the same boundary, or a suffix (see the module docstring)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for key in patterns:
        if module_name.endswith(key):
            return True
        try:
            if re.match(rf"(?:{key}){boundary}", module_name):
                return True
        except re.error:  # a plain name with regex metacharacters: the prefix / suffix rules only
            if module_name == key or module_name.startswith(key + "."):
                return True
    return False


def quantization_config_of(raw: dict) -> dict | None:
    """config.json's `quantization_config` (top level, or a multimodal config's text_config)."""
    q = raw.get("quantization_config")
    if q is None and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
    return q


def check_quantization(quantization, checkpoint_quantization: dict | None) -> Fp8Config | None:
    """The FP8 config the weights are loaded with, or None (the checkpoint's own dtype).
    quantization: None or "fp8" (vLLM's `--quantization`); checkpoint_quantization: config.json's
    `quantization_config`. An FP8 checkpoint is FP8 with None or "fp8"; "fp8" on an unquantised
    checkpoint quantises it online (no modules_to_not_convert beyond lm_head); "fp8" on another
    format (Kimi K3's MXFP4) and any other value are ValueErrors."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    if checkpoint_quantization:
        if not isinstance(checkpoint_quantization, dict):
            raise ValueError(f"quantization_config must be a JSON object, got {checkpoint_quantization!r}")
        if is_fp8(checkpoint_quantization):
            return parse_fp8_config(checkpoint_quantization)
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} does not apply to a checkpoint quantised with "
                             f"quant_method {checkpoint_quantization.get('quant_method')!r}")
        return None
    if quantization == "fp8":
        return Fp8Config(modules_to_not_convert=ONLINE_DEFAULT_SKIPS)
    return None
