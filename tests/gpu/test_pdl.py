"""Programmatic dependent launch (hyla.ops.triton.pdl) changes when a kernel starts, never what
it computes: with it on, every family's greedy decode through the engine (CUDA graphs, overlapped
steps) gives the same tokens and bit-equal logprobs as with it off. Skipped without a GPU of
compute capability 9.0 or later."""

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs a CUDA GPU of compute capability >= 9.0", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from hyla import LLM, SamplingParams  # noqa: E402
from hyla.bench.shape import write_shape  # noqa: E402
from hyla.models import default_model_path  # noqa: E402
from hyla.models.hub import resolve_model  # noqa: E402
from hyla.ops.triton import pdl  # noqa: E402

PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13], list(range(40, 73))]


def _decode(model: str, on: bool, monkeypatch, **kw) -> list[tuple[list[int], list[float]]]:
    monkeypatch.setattr(pdl, "_ENABLED", on)
    assert pdl.pdl_launch(torch.device("cuda"))["PDL"] is on
    llm = LLM(model, device="cuda", dtype="bfloat16", memory_budget=1 << 30, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("name", ["default", "qwen3.5-mtp", "tiny-kimi-moe", "tiny-qwen3-next-moe", "tiny-kimi-moe-fp8"])
def test_pdl_changes_no_output(name, tmp_path, monkeypatch):
    if name == "default":
        model, kw = str(default_model_path()), {}
    elif name == "qwen3.5-mtp":
        model, kw = str(resolve_model(name)), {}
    else:  # random weights of a tiny MoE shape (seeded: the same both times), "-fp8": in block FP8
        shape = name.removesuffix("-fp8")
        model, kw = str(write_shape(tmp_path / shape, shape)), {"load_format": "dummy"}
        if name.endswith("-fp8"):
            kw["quantization"] = "fp8"
    off = _decode(model, False, monkeypatch, **kw)
    on = _decode(model, True, monkeypatch, **kw)
    assert on == off
