"""Random weights for a built model (vLLM's load_format="dummy"; the benchmarks' released shapes).

Every matrix, embedding and stacked expert tensor ~ N(0, std); norm weights 1 + N(0, 0.02)
(zero-centred norms N(0, 0.02)); A_log and dt_bias ~ U(-1, 1); the router's
e_score_correction_bias ~ N(0, 0.02). Filled in place on the model's device: never zeros (a
forward over zeros hides bugs), never a full-size fp32 copy.
"""

from __future__ import annotations

import torch


def _norm_kind(module: torch.nn.Module) -> str | None:
    name = type(module).__name__
    if "Norm" not in name:
        return None
    return "zero" if "ZeroCentred" in name else "one"


@torch.no_grad()
def init_random_(model: torch.nn.Module, std: float, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer of `model` in place (see the module docstring)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    norms = {}
    for mname, module in model.named_modules():
        kind = _norm_kind(module)
        if kind is not None:
            for pname, _ in module.named_parameters(recurse=False):
                norms[f"{mname}.{pname}" if mname else pname] = kind
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("A_log", "dt_bias")):
            t.uniform_(-1.0, 1.0, generator=gen)
        elif name in norms:
            t.normal_(0.0, 0.02, generator=gen)
            if norms[name] == "one":
                t.add_(1.0)
        elif name.endswith("e_score_correction_bias"):
            t.normal_(0.0, 0.02, generator=gen)
        elif t.is_floating_point() and t.element_size() > 1:  # FP8 codes: drawn by fp8_loading.init_random_fp8_
            t.normal_(0.0, std, generator=gen)
