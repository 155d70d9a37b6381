"""Block Attention Residuals: the softmax mix against its formula, the bank's block schedule,
and the fp32 mix of bf16 streams."""

import torch

from hyla.layers.attn_residual import BlockResidualStream, mix_blocks, residual_scorer

torch.set_num_threads(1)


def _scorer(h: int, seed: int):
    norm, proj = residual_scorer(h, 1e-5)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(h, generator=gen))
        proj.weight.copy_(torch.randn(1, h, generator=gen))
    return norm.double(), proj.double()


def test_mix_equals_its_formula():
    h, gen = 24, torch.Generator().manual_seed(0)
    bank = [torch.randn(3, 5, h, generator=gen, dtype=torch.float64) * (j + 1) for j in range(3)]
    running = torch.randn(3, 5, h, generator=gen, dtype=torch.float64)
    norm, proj = _scorer(h, 1)
    got = mix_blocks(bank, running, norm, proj)
    rows = bank + [running]
    w = norm.weight * proj.weight[0]
    scores = torch.stack([(v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)) @ w for v in rows])  # [R, 3, 5]
    p = torch.softmax(scores, dim=0)
    want = sum(p[j, ..., None] * rows[j] for j in range(4))
    assert got.shape == running.shape and (got - want).abs().max() <= 1e-12
    assert mix_blocks([], running, norm, proj) is running  # one row: softmax weight exactly 1


def test_bank_snapshots_at_block_starts():
    h = 8
    norm, proj = _scorer(h, 2)
    emb = torch.randn(4, h, dtype=torch.float64)
    stream = BlockResidualStream(emb, block_size=2)
    deltas = [torch.randn(4, h, dtype=torch.float64) for _ in range(10)]
    for layer in range(5):  # attention then MLP, as a decoder layer does
        stream.attention_input(layer, norm, proj)
        stream.add(deltas[2 * layer])
        stream.add(deltas[2 * layer + 1])
    # blocks start at layers 0, 2, 4: bank = [emb, layers 0-1's outputs, layers 2-3's outputs]
    assert len(stream.bank) == 3 and torch.equal(stream.bank[0], emb)
    assert torch.allclose(stream.bank[1], sum(deltas[0:4]))
    assert torch.allclose(stream.bank[2], sum(deltas[4:8]))
    assert torch.allclose(stream.running, deltas[8] + deltas[9])


def test_bf16_streams_mix_in_fp32():
    h, gen = 64, torch.Generator().manual_seed(3)
    bank = [torch.randn(6, h, generator=gen).bfloat16() for _ in range(2)]
    running = torch.randn(6, h, generator=gen).bfloat16()
    norm, proj = _scorer(h, 4)
    got = mix_blocks(bank, running, norm.bfloat16(), proj.bfloat16())
    want = mix_blocks([b.double() for b in bank], running.double(), norm.bfloat16().double(),
                      proj.bfloat16().double())
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()  # one bf16 rounding of the result
