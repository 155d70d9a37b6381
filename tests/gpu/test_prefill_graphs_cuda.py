"""Prefill steps with their spans replayed as CUDA graphs (hyla.engine.prefill_graphs) on CUDA
(skipped without): captured graphs against model.forward_batch, in fp32 (the same kernels over
more rows: a GEMM's tiles may change with the row count, so a few fp32 ulps) and in bf16 with
online block-FP8 weights (the FP8 GEMM's tile table is keyed by rows: bf16 rounding), pools
included, with every static buffer refilled with NaN between steps; then greedy tokens through
the engine, fp32, with and without it."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from hyla import LLM, SamplingParams  # noqa: E402
from hyla.bench.random_models import random_checkpoint, random_model  # noqa: E402
from hyla.engine.prefill_graphs import PrefillGraphs  # noqa: E402
from tests.models.test_prefill_program import pool_pairs, step_pairs, with_garbage  # noqa: E402


@pytest.mark.parametrize("name,dtype,quantization,tol", [
    ("tiny-kimi-moe", torch.float32, None, 1e-4), ("tiny-kimi-moe", torch.bfloat16, "fp8", 3e-2),
    ("tiny-qwen3-next-moe", torch.float32, None, 1e-4), ("tiny-qwen3-next-moe", torch.bfloat16, "fp8", 3e-2)])
def test_captured_spans_equal_forward_batch(name, dtype, quantization, tol):
    model = random_model(name, dtype=dtype, device="cuda", quantization=quantization)
    graphs = PrefillGraphs(model, 64, buckets=[16, 48, 64])
    assert graphs.capture_all() == 3 * graphs.program.num_spans
    for got, want, pool, ref_pool in step_pairs(model, with_garbage(graphs)):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"  {name} {dtype} {quantization or ''}: hidden rel err {err:.2e}")
        assert err <= tol
        for ta, tb in pool_pairs(pool, ref_pool):
            assert ((ta.float() - tb.float()).norm() / tb.float().norm().clamp_min(1e-30)).item() <= tol


def test_engine_greedy_tokens_with_prefill_graphs(tmp_path):
    path = str(random_checkpoint(tmp_path, "tiny-kimi-moe"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (37, 9, 100, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=160, max_num_batched_tokens=64, enable_prefix_caching=True)
    want = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, prefill_graph_max_tokens=64, **kw)
    assert llm.engine.runner.prefill_graphs.graphs  # captured at startup
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
