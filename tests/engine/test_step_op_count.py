"""How many ops one engine step dispatches (scripts/count_step_ops.py: a CPU proxy for the
kernels a step's CUDA graph replays, which bound a tiny model's step time on the GPU), for the
bundled qwen3.5-mtp in bf16: a plain decode step and MTP's fused greedy step (k = 3), per part.
Upper bounds a few ops above today's counts, so that a change adding kernels to the decode or
MTP path is noticed; and no per-step arange / zeros / bitwise_not / any inside the graphs (the
constants and per-step tables are built once). The attention layers take their GPU route (two
fused ops, hyla.ops.paged_attention), as the script makes them."""


import pytest

from hyla import SamplingParams
from tests.scripts import load_script


@pytest.fixture(scope="module")
def counter():
    return load_script("count_step_ops")


@pytest.fixture(scope="module")
def counts(counter):
    from hyla.bench.spec import FREE
    from hyla.models.hub import resolve_model

    model = str(resolve_model("qwen3.5-mtp"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = counter.measure(counter.build(model, None, "bfloat16"), FREE[0], params, fused=False)
    mtp = counter.measure(counter.build(model, 3, "bfloat16"), FREE[0], params, fused=True)
    return plain, mtp


def _n(step, part):
    return sum(step[part].values())


def test_plain_decode_step_op_count(counter, counts):
    plain, _ = counts
    # 91 for the forward and its logits, 5 for the argmax beside them (a greedy batch's draws)
    assert _n(plain, "decode forward") <= 96, plain["decode forward"]
    assert _n(plain, "outside graph") <= 9, plain["outside graph"]


def test_fused_mtp_step_op_count(counter, counts):
    plain, mtp = counts
    parts = {p: _n(mtp, p) for p in mtp if not p.startswith("_")}
    assert set(parts) >= {"verify forward", "acceptance", "head catch-up", "draft step 1", "draft step 2"}, parts
    assert parts["verify forward"] <= 94, parts
    assert parts["acceptance"] <= 6, parts
    # a head pass: about one decoder layer, its input / output norms and the lm_head
    assert parts["head catch-up"] <= 21 and parts["draft step 1"] <= 17 and parts["draft step 2"] <= 18, parts
    assert counter.total(mtp) <= 162, parts
    assert counter.total(mtp) <= 1.62 * counter.total(plain), parts


def test_no_per_step_index_tables_in_the_graphs(counts):
    for step, parts in zip(counts, (["decode forward"], ["verify forward", "acceptance", "head catch-up",
                                                         "draft step 1", "draft step 2"])):
        for part in parts:
            ops = step[part]
            assert not {"arange", "zeros", "zeros_like", "ones_like", "full", "bitwise_not", "any"} & set(ops), \
                (part, ops)
