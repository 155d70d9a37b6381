"""MTP speculation over 2 ranks (gloo, fp32): the checkpoint's `mtp.*` head (its own shard, as
released checkpoints store it) sharded like the target's attention layers, its steps run on both
ranks in lockstep, rank 0's drafts broadcast. Greedy output == plain greedy on one process token
for token (logprobs within tolerance) with the prefix cache on, k = 2, both rollbacks; the drafts
are the ones the same head proposes on one process; each rank holds half of the head's heads
(and experts' width) and counts half of its KV per page."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyla import LLM, SamplingParams
from tests.oracles.qwen3_5_checkpoint import add_mtp_shard, build_qwen3_5_checkpoint
from tests.oracles.qwen3_next_checkpoint import build_qwen3_next_checkpoint
from tests.parallel.tp_cases import assert_same, generate, prompts, rank_bytes

SCALE = 3.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


def _echo_head(path) -> None:
    """Make the head draft mostly the token the target just produced (fc passes the target's
    normed hidden state on), so that a target repeating itself accepts some drafts; unlike
    test_mtp_spec's head, the fed token's embedding, the attention and the MLP still add
    (smaller) random terms, so the drafts depend on the sharded layer computing what the whole
    one does and on every rank feeding it the same drafts."""
    file = path / "model-mtp.safetensors"
    t = load_file(file)
    hid = t["mtp.norm.weight"].shape[0]
    t["mtp.fc.weight"] = torch.cat([t["mtp.fc.weight"][:, :hid], torch.eye(hid)], dim=1)
    for name in t:
        if name.endswith(("pre_fc_norm_hidden.weight", "mtp.norm.weight")):
            t[name] = torch.zeros_like(t[name])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = 0.3 * t[name]
    save_file(t, file, metadata={"format": "pt"})


def _repetitive_target(path, scale: float) -> None:
    """Scale the target's token embeddings (and make lm_head their copy): the residual stream is
    then mostly the input token's embedding and the target often repeats its last token, which
    the echo head drafts: partial acceptance, whatever the random layers do."""
    file = path / "model.safetensors"
    t = load_file(file)
    embed = next(name for name in t if name.endswith("embed_tokens.weight"))
    t[embed] = scale * t[embed]
    if "lm_head.weight" in t:
        t["lm_head.weight"] = t[embed].clone()
    save_file(t, file, metadata={"format": "pt"})


def _checkpoint(root, family: str, scale: float = SCALE):
    path = (build_qwen3_next_checkpoint(root, "moe") if family == "qwen3_next"
            else build_qwen3_5_checkpoint(root, family.split("-")[1], "text"))
    if not (path / "model-mtp.safetensors").is_file():
        _repetitive_target(path, scale)
        add_mtp_shard(path)
        _echo_head(path)
    return path


def _recorded(llm: LLM) -> list:
    """Every proposal the engine's drafter makes from now on: (token ids so far, drafts)."""
    drafter, seen = llm.engine.spec.drafter, []
    propose = drafter.propose

    def record(seqs, ks, generator=None):
        out = propose(seqs, ks, generator)
        seen.extend((list(s.token_ids), d) for s, (d, _) in zip(seqs, out) if d)
        return out

    drafter.propose = record
    return seen


def _halved(full: dict, rank: dict, names: list[str], dims: list[int]) -> None:
    for name, dim in zip(names, dims):
        want = list(full[name])
        want[dim] //= 2
        assert list(rank[name]) == want, name


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tp-mtp")


@pytest.mark.parametrize("family,rollback,kw", [
    ("qwen3_5-dense", "slots", {}),
    ("qwen3_5-moe", "replay", {}),
    ("qwen3_next", "slots", {"enable_expert_parallel": True}),
], ids=["qwen3_5-dense-slots", "qwen3_5-moe-replay", "qwen3_next-expert_parallel-slots"])
def test_tp2_mtp_equals_tp1_plain(root, family, rollback, kw):
    path = _checkpoint(root, family)
    first = prompts(seed=3, lengths=(40, 1))
    reference = generate(LLM(str(path), dtype="float32", enable_prefix_caching=True), first, params=PARAMS)
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "rollback": rollback}
    one = LLM(str(path), dtype="float32", enable_prefix_caching=True, speculative_config=mtp)
    one_drafts = _recorded(one)
    generate(one, first, [r[0] for r in reference], params=PARAMS)
    full = {name: tuple(t.shape) for name, t in one.engine.spec.drafter.head.state_dict().items()}
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, enable_prefix_caching=True,
              speculative_config=mtp, **kw)
    try:
        drafts = _recorded(llm)
        assert_same(generate(llm, first, [r[0] for r in reference], params=PARAMS), reference)
        m, m1 = llm.get_metrics(), one.get_metrics()
        assert m["prefix_cache_hit_tokens"] > 0
        assert 0 < m["spec_num_accepted_tokens"] < m["spec_num_draft_tokens"]
        assert drafts == one_drafts  # the sharded head proposes what the whole head does
        assert (m["spec_num_draft_tokens"], m["spec_num_accepted_tokens"]) == (
            m1["spec_num_draft_tokens"], m1["spec_num_accepted_tokens"])
        assert not llm.engine.spec.drafter.views and not llm.engine.spec.drafter._seen  # all released

        workers = llm.engine.workers
        workers.call("mtp_shapes", reply=True)
        for shapes in workers.replies:  # each rank: half the query heads, o_proj's half of the columns
            _halved(full, shapes, ["layers.0.self_attn.q_proj.weight", "layers.0.self_attn.o_proj.weight"], [0, 1])
            assert shapes["layers.0.self_attn.k_proj.weight"][0] == llm.engine.model.config.num_key_value_heads * \
                llm.engine.model.config.head_dim
            assert shapes["fc.weight"] == full["fc.weight"]  # replicated
            if family == "qwen3_5-dense":  # 2 KV heads, one per rank; the MLP split along its width
                _halved(full, shapes, ["layers.0.self_attn.k_proj.weight", "layers.0.mlp.gate_proj.weight",
                                       "layers.0.mlp.down_proj.weight"], [0, 0, 1])
            elif family == "qwen3_5-moe":  # experts split along their width, the shared expert too
                _halved(full, shapes, ["layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj",
                                       "layers.0.mlp.shared_expert.gate_proj.weight"], [1, 2, 0])
            else:  # expert parallel: half of the experts, whole
                _halved(full, shapes, ["layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"],
                        [0, 0])
        # a page holds each rank's own share of the head's KV beside the target's layers
        _, page, kv_heads, head_dim = workers.replies[0]["kv"]
        assert kv_heads == llm.engine.model.config.num_key_value_heads
        head_kv = 2 * kv_heads * head_dim * 4  # keys + values, fp32
        assert llm.engine.kv_bytes_per_page == (llm.engine.model.kv_bytes_per_token() + head_kv) * page
        if family == "qwen3_5-dense":
            assert 2 * llm.engine.kv_bytes_per_page == one.engine.kv_bytes_per_page
    finally:
        llm.shutdown()


def test_tp2_mtp_sampling_equals_tp1_mtp(root):
    """Seeded sampling: rank 0 draws every draft from the requests' own generators and the other
    ranks feed its tokens to their head shards, so TP = 2 draws what one process draws (drafts,
    acceptances and tokens; a rank feeding another token would change the next drafts)."""
    path = _checkpoint(root, "qwen3_5-dense")
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=12, ignore_eos=True) for s in range(4)]
    first = prompts(seed=5, lengths=(20, 7, 1))

    def run(llm):
        drafts = _recorded(llm)
        out = [o.outputs[0].token_ids for o in llm.generate(first, params, use_tqdm=False)]
        m = llm.get_metrics()
        return out, drafts, (m["spec_num_draft_tokens"], m["spec_num_accepted_tokens"])

    want = run(LLM(str(path), dtype="float32", speculative_config=mtp))
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, speculative_config=mtp)
    try:
        got = run(llm)
    finally:
        llm.shutdown()
    assert got == want
    assert want[2][1] > 0


def test_tp2_mtp_preemption_chunked_prefill(root):
    """A per-rank budget of 4 state slots and 5 pages (each page: the target's KV and this
    rank's half of the head's): the two long prompts prefill in chunks of 16 tokens together,
    outgrow the pages and are preempted; each rank's head views restart with the recomputation
    and the output stays plain greedy."""
    path = _checkpoint(root, "qwen3_5-dense")
    first = prompts(seed=3, lengths=(40, 1))
    reference = generate(LLM(str(path), dtype="float32", enable_prefix_caching=True), first, params=PARAMS)
    slot, token = rank_bytes(path, 2)
    head_token = 2 * 1 * 32 * 4  # one of the 2 KV heads (dim 32) per rank, keys + values, fp32
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, enable_prefix_caching=True, max_num_seqs=2,
              max_model_len=64, max_num_batched_tokens=16, memory_budget=4 * slot + 5 * 16 * (token + head_token),
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "rollback": "replay"})
    try:
        assert llm.engine.pools.pages.num_pages == 5  # the head's share of a page is counted per rank
        assert_same(generate(llm, first, [r[0] for r in reference], params=PARAMS), reference)
        m = llm.get_metrics()
    finally:
        llm.shutdown()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hit_tokens"] > 0 and m["spec_num_accepted_tokens"] > 0
