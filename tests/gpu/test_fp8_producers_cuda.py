"""Producer-side FP8 activations (hyla.ops.fp8_activation) in whole models on the GPU (skipped
without one; the producer kernels themselves are checked on CUDA by tests/ops/test_fp8_activation.py,
which runs them compiled wherever there is a GPU).

- The tiny FP8 models of tests/models/test_fp8_producers.py on CUDA: logits with the producers
  marked equal the unmarked model's bit for bit, eager; and greedy tokens through `LLM` (CUDA
  graphs, inference mode: the path a served model takes) equal with and without the marks.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from tests.models.test_fp8_producers import IDS, fp8_config_dir, unmark  # noqa: E402,F401 (fixture)


@pytest.mark.parametrize("family", ["kimi", "qwen3_next"])
def test_marked_models_equal_unmarked_on_cuda(fp8_config_dir, family, monkeypatch):  # noqa: F811
    from hyla import LLM, SamplingParams
    from hyla.models import load_model

    path = fp8_config_dir(family)
    model = load_model(path, random_weights=True, fp8_weights="fp8", dtype=torch.bfloat16, device="cuda")
    assert any(getattr(m, "fp8_output", False) for m in model.modules())
    with torch.no_grad():
        got = model(IDS.cuda())
        unmark(model)
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
