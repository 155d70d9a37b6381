"""Producer-side FP8 activations (hyla.ops.fp8_activation) compiled for the GPU (skipped without
one): the CPU tests run these kernels in Triton's interpreter only.

- Every producer (the RMSNorm kernel's styles, KDA's low-rank gated norm, the SwiGLU activation)
  asked for fp8_output writes codes and scales bit for bit the CUDA quantiser's of its own output,
  and the output itself is unchanged (head-wise gated rows up to GATED_FP8_MAX_D; wider ones write
  none: hyla.ops.triton.norm's docstring says why).
- The tiny FP8 models of tests/models/test_fp8_producers.py on CUDA: logits with the producers
  marked equal the unmarked model's bit for bit, eager; and greedy tokens through `LLM` (CUDA
  graphs, inference mode: the path a served model takes) equal with and without the marks.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from hyla.ops import fp8_activation  # noqa: E402
from hyla.ops.triton import fp8_gemm, gated_act, norm  # noqa: E402
from tests.models.test_fp8_producers import IDS, fp8_config_dir  # noqa: E402,F401 (fixture)

SIZES = [(1, 2304), (3, 128), (17, 256), (33, 2304), (64, 2048)]


def _randn(*shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()


def _producers(R, D, seed):
    x, res, w = _randn(R, D, seed=seed, scale=3.0), _randn(R, D, seed=seed + 1), _randn(D, seed=seed + 2)
    x[0, :128] = 0.0
    gate = _randn(R, 2 * D, seed=seed + 3, scale=2.0)[:, D:]
    gu = _randn(R, 2 * D, seed=seed + 4, scale=3.0)
    H, r = 2, 24
    xh = torch.stack([x, _randn(R, D, seed=seed + 5, scale=3.0)], dim=1)[:, None]  # [R, 1, H, D]
    g_in, w_up = _randn(R, 1, r, seed=seed + 6), _randn(H * D, r, seed=seed + 7, scale=r ** -0.5)
    return {
        "rounded": lambda f: norm.rms_norm_rounded(x, w, 1e-5, f),
        "zero_centred": lambda f: norm.rms_norm_zero_centred(x, w, 1e-6, f),
        "add_rounded": lambda f: norm.add_rms_norm(x, res, w, 1e-6, False, f)[0],
        "add_zero_centred": lambda f: norm.add_rms_norm(x, res, w, 1e-6, True, f)[0],
        "gated_sigmoid": lambda f: norm.gated_rms_norm(x, gate, w, 1e-5, "sigmoid", f),
        "silu_gated": lambda f: norm.silu_gated_rms_norm(x, gate, w, 1e-6, f),
        "lowrank_gated": lambda f: norm.lowrank_gated_rms_norm(xh, g_in, w_up, w, 1e-5, "sigmoid", f),
        "silu_mul": lambda f: gated_act.silu_mul(gu[:, :D], gu[:, D:], f),
    }


@pytest.mark.parametrize("R, D", SIZES)
@pytest.mark.parametrize("producer", ["rounded", "zero_centred", "add_rounded", "add_zero_centred", "gated_sigmoid",
                                      "silu_gated", "lowrank_gated", "silu_mul"])
def test_producers_write_the_quantisers_bits_on_cuda(producer, R, D):
    run = _producers(R, D, seed=R * 10 + D)[producer]
    plain = run(False)
    y = run(True)
    assert torch.equal(y, plain)
    carried = fp8_activation.lookup(y.reshape(-1, D))
    if producer in ("gated_sigmoid", "silu_gated", "lowrank_gated") and D > norm.GATED_FP8_MAX_D:
        assert carried is None  # wide head-wise rows leave the quantisation to the consumer
        return
    assert carried is not None
    q, s = carried
    rq, rs = fp8_gemm.per_token_group_quant(y.reshape(-1, D))
    assert torch.equal(s, rs)
    assert torch.equal(q.float(), rq.float())


def _unmark(model) -> None:
    for m in model.modules():
        if hasattr(m, "fp8_output"):
            m.fp8_output = False


@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
def test_marked_models_equal_unmarked_on_cuda(fp8_config_dir, family, monkeypatch):  # noqa: F811
    from hyla import LLM, SamplingParams
    from hyla.models import load_model

    path = fp8_config_dir(family)
    model = load_model(path, random_weights=True, fp8_weights="fp8", dtype=torch.bfloat16, device="cuda")
    assert any(getattr(m, "fp8_output", False) for m in model.modules())
    with torch.no_grad():
        got = model(IDS.cuda())
        _unmark(model)
        want = model(IDS.cuda())
    assert torch.equal(got, want)
    del model

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 17, 5, 9], [3, 4]]
    llm = LLM(model=str(path), dtype="bfloat16", load_format="dummy", seed=0)
    marked = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    torch.cuda.empty_cache()
    import hyla.models.loader as loader

    monkeypatch.setattr(loader, "mark_fp8_producers", lambda model: None)  # the same weights (seeded), unmarked
    llm = LLM(model=str(path), dtype="bfloat16", load_format="dummy", seed=0)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert marked == plain
