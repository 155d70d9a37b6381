"""Weight bytes of a model with FP8 weights, from its config alone (no checkpoint read, nothing
allocated): the family's model is built on the meta device, its FP8 modules chosen by
hyla.models.fp8's rule (what `quantization="fp8"` builds, and for a released FP8 config the
modules its modules_to_not_convert leaves), and every tensor counted at its loaded size: 1 byte
per FP8 weight plus 4 per 128 x 128 block scale, the tensors the loader keeps in fp32 at 4, the
rest in the model dtype. A loaded model's own count is HybridForCausalLM.weight_bytes()."""

from __future__ import annotations

import torch

from hyla.models.fp8 import Fp8Config
from hyla.models.fp8_loading import LoadPlan, convert_model
from hyla.models.loader import _keeps_fp32, family_classes


def fp8_weight_bytes(config, fp8: Fp8Config, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of `config`'s weights loaded with FP8 modules (tied tensors once)."""
    model_cls = family_classes(config.model_type)[1]
    with torch.device("meta"):
        model = model_cls(config)
    plan = LoadPlan(fp8, prequantized=False, modules=True, target_of=lambda name: None, device=torch.device("meta"))
    convert_model(model, plan, [])
    family_fp32 = getattr(model_cls, "fp32_tensors", ())
    seen = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.dtype in (torch.float8_e4m3fn, torch.float32) and (t.element_size() == 1 or name.endswith("_scale_inv")):
            size = t.element_size()
        elif _keeps_fp32(name) or name.endswith(family_fp32):
            size = 4
        else:
            size = torch.empty((), dtype=dtype).element_size()
        seen[id(t)] = t.numel() * size
    return sum(seen.values())
