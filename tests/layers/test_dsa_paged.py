"""DSA over the engine's pages (hyla.layers.dsa_paged): the all-at-once decode / verify path
equals the per-sequence walk on the same pages (a full and a shared indexed layer, padded block
tables, contexts from 0 to past the top-k budget), and decode steps and chunked prefills in
query blocks equal the full-sequence model position by position."""

import copy

import torch

from hyla.contract import ForwardBatch
from hyla.models.glm5_next import Glm5NextForCausalLM
from hyla.models.glm5_next_config import Glm5NextConfig
from tests.oracles.glm5_next_checkpoint import TEXT

K, I = "linear_attention", "indexed_attention"


def _model() -> Glm5NextForCausalLM:
    d = dict(TEXT, model_type="glm5_next_text", num_hidden_layers=3, layer_types=[I, K, I],
             indexer_types=["full", "full", "shared"], mlp_layer_types=["dense"] * 3, hc_mult=2, index_kpool=4,
             index_topk=8)
    torch.manual_seed(0)
    model = Glm5NextForCausalLM(Glm5NextConfig.from_hf_dict(d)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "compress" in name or "k_norm.bias" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    return model


def _pages(lens, page_size=16):
    tables, nxt = [], 0
    for n in lens:
        k = -(-n // page_size)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    return tables


def _step(model, cache, ids, seq_lens, ctx, tables, accepted=None):
    batch = ForwardBatch.build(seq_lens, ctx, tables, torch.arange(len(seq_lens)) if accepted is None else
                               torch.arange(len(seq_lens) * 4).view(-1, 4), num_accepted_tokens=accepted)
    with torch.no_grad():
        return model.forward_batch(ids, batch, cache)


def test_uniform_path_equals_the_per_sequence_walk():
    model = _model()
    gen = torch.Generator().manual_seed(1)
    # 47 tokens of context: 11 complete pools, 2 kept; verify needs context for every sequence
    for width, accepted, contexts in ((1, None, [0, 5, 31, 47]), (3, torch.ones(4, dtype=torch.long), [1, 6, 29, 47])):
        prompt = [torch.randint(3, 256, (n,), generator=gen) for n in contexts]
        tables = _pages([n + width for n in contexts])
        tables[0] = tables[0] + [-1]  # a padded table
        cache = model.allocate_cache(num_slots=16, num_pages=20, page_size=16, dtype=torch.float64)
        live = [n for n in contexts if n]
        rows = [i for i, n in enumerate(contexts) if n]
        _step(model, cache, torch.cat([prompt[i] for i in rows]), live, [0] * len(live), [tables[i] for i in rows])
        new = torch.randint(3, 256, (4 * width,), generator=gen)
        outs = []
        for uniform in (True, False):
            c = copy.deepcopy(cache)
            for layer in model.model.layers:
                layer.self_attn.uniform_path = uniform
            outs.append(_step(model, c, new, [width] * 4, contexts, tables, accepted))
        for layer in model.model.layers:
            layer.self_attn.uniform_path = True
        assert torch.allclose(outs[0], outs[1], atol=1e-10), (width, (outs[0] - outs[1]).abs().max())


def test_decode_steps_equal_the_full_sequence_model():
    """Prefill two prompts, then 24 decode steps: every step's logits equal the full-sequence
    model's at that position (pools completed during decode are pooled, scored and kept)."""
    model = _model()
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (37, 9)]
    steps = 24
    tables = _pages([len(s) + steps for s in seqs])
    cache = model.allocate_cache(num_slots=4, num_pages=12, page_size=16, dtype=torch.float64)
    h = _step(model, cache, torch.tensor(seqs[0] + seqs[1]), [len(s) for s in seqs], [0, 0], tables)
    last = torch.tensor([len(seqs[0]) - 1, len(seqs[0]) + len(seqs[1]) - 1])
    logits = model.compute_logits(h[last])
    for step in range(steps):
        for n, s in enumerate(seqs):
            with torch.no_grad():
                want = model(torch.tensor([s]))[0, -1]
            assert torch.allclose(logits[n], want, atol=1e-9), (step, n, (logits[n] - want).abs().max())
        nxt = [int(torch.randint(3, 256, (1,), generator=gen)) for _ in seqs]
        ctx = [len(s) for s in seqs]
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = model.compute_logits(_step(model, cache, torch.tensor(nxt), [1, 1], ctx, tables))


def test_chunked_prefill_in_query_blocks_equals_the_full_sequence_model():
    """Two prompts prefilled in three chunks, 8-query blocks: every position's logits equal the
    full-sequence model's (the selection mask there, gathered position lists here)."""
    model = _model()
    for layer in model.model.layers:
        layer.self_attn.prefill_block = 8
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 256, (n,), generator=gen) for n in (70, 41)]
    tables = _pages([70, 41])
    cache = model.allocate_cache(num_slots=4, num_pages=12, page_size=16, dtype=torch.float64)
    with torch.no_grad():
        want = [model(s[None])[0] for s in seqs]
    done = [0, 0]
    for chunk in ((30, 17), (25, 0), (15, 24)):
        live = [n for n in range(2) if chunk[n]]
        ids = torch.cat([seqs[n][done[n]:done[n] + chunk[n]] for n in live])
        h = _step(model, cache, ids, [chunk[n] for n in live], [done[n] for n in live], [tables[n] for n in live])
        got = model.compute_logits(h)
        o = 0
        for n in live:
            assert torch.allclose(got[o:o + chunk[n]], want[n][done[n]:done[n] + chunk[n]], atol=1e-9), (chunk, n)
            o += chunk[n]
            done[n] += chunk[n]
