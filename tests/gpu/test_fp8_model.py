"""The tiny released-layout FP8 checkpoints of tests/models/test_fp8.py loaded on CUDA (skipped
without): FP8 modules whose GEMMs and fused MoE run the Triton kernels.

- Against the same W8A8 arithmetic on the CPU (the FP8 modules run by the torch definitions,
  fp32 both sides): the two differ in fp32 summation order only, which can move an activation's
  e4m3 code by one step where a value sits on a rounding boundary; bound 1e-2 relative L2 on the
  logits (measured value printed).
- Against the dequantised model in bf16 on CUDA (the accuracy the quantisation issue reports):
  W8A8 rounds every activation entering an FP8 GEMM to e4m3 (tests/models/test_fp8.py's
  docstring: ~0.1 relative on these random 4-layer models, bound 0.25); the relative error and
  the greedy tokens' agreement over 16 steps are printed.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from hyla.models import load_model  # noqa: E402
from tests.models.test_fp8 import IDS, _fp8_module_names, checkpoints  # noqa: E402,F401 (fixture)


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
def test_fp8_checkpoint_on_cuda(checkpoints, family, monkeypatch):  # noqa: F811
    from hyla import LLM, SamplingParams

    src, dst, deq = checkpoints(family)
    model = load_model(dst, dtype=torch.float32, device="cuda")
    assert _fp8_module_names(model)
    cpu = load_model(dst, dtype=torch.float32, fp8_weights="fp8")
    err = rel(model(IDS.cuda()), cpu(IDS))
    print(f"  {family}: FP8 on CUDA (Triton) vs the CPU's W8A8 definition, fp32: rel err {err:.2e}")
    assert err <= 1e-2

    bf16, ref = load_model(dst, dtype=torch.bfloat16, device="cuda"), load_model(deq, dtype=torch.bfloat16, device="cuda")
    err = rel(bf16(IDS.cuda()), ref(IDS.cuda()))
    del model, bf16, ref
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [row.tolist() for row in IDS]
    tokens = [[o.outputs[0].token_ids for o in LLM(model=str(p), dtype="bfloat16").generate(prompts, params, use_tqdm=False)]
              for p in (dst, deq)]
    same = sum(a == b for x, y in zip(*tokens) for a, b in zip(x, y))
    print(f"  {family}: FP8 vs dequantised, bf16 on CUDA: logits rel err {err:.2e}; greedy tokens equal "
          f"{same} of {sum(len(x) for x in tokens[0])}")
    assert err < 0.25


def test_trained_bundled_model_fp8_on_cuda():
    """The issue's accuracy target on trained weights: the bundled model quantised online, its
    FP8 modules on CUDA (Triton / cuBLAS, bf16) against the same FP8 weights dequantised in bf16
    on CUDA, within 3e-2 relative on the logits (the CPU's W8A8 definition: 2.2e-2,
    tests/models/test_fp8.py); greedy next tokens' agreement printed."""
    from hyla.models.default import default_model_path
    from tests.models.test_fp8 import trained_ids

    path, ids = default_model_path(), trained_ids().cuda()
    fp8 = load_model(path, dtype=torch.bfloat16, device="cuda", quantization="fp8")
    assert _fp8_module_names(fp8)
    deq = load_model(path, dtype=torch.bfloat16, device="cuda", quantization="fp8", fp8_weights="dequantized")
    with torch.no_grad():
        got, want = fp8(ids), deq(ids)
    err = rel(got, want)
    agree = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
    print(f"  bundled model, FP8 on CUDA vs dequantised, bf16: logits rel err {err:.2e}; next tokens equal {agree:.1%}")
    assert err <= 3e-2
