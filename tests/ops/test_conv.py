import pytest
import torch
import torch.nn.functional as F

from hyla.ops.conv import causal_conv1d_fn, causal_conv1d_update


def _ref_sequence(x, weight, bias, activation, state):
    """Plain per-token loop. x: [L, D]; state: [D, W-1] -> (y [L, D], final [D, W-1])."""
    W = weight.shape[1]
    window = [state[:, j] for j in range(W - 1)]  # oldest first
    ys = []
    for t in range(x.shape[0]):
        window.append(x[t])
        y = sum(weight[:, j] * window[len(window) - W + j] for j in range(W))
        if bias is not None:
            y = y + bias
        ys.append(F.silu(y) if activation == "silu" else y)
    final = torch.stack(window[len(window) - (W - 1):], dim=1) if W > 1 else state
    y = torch.stack(ys) if ys else x.new_zeros(0, x.shape[1])
    return y, final


def _params(D, W, dtype=torch.float64, bias=True):
    weight = torch.randn(D, W, dtype=dtype)
    return weight, (torch.randn(D, dtype=dtype) if bias else None)


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_state", [False, True])
def test_batched_matches_loop(W, activation, with_state):
    B, T, D = 3, 13, 10
    x = torch.randn(B, T, D, dtype=torch.float64)
    weight, bias = _params(D, W)
    h0 = torch.randn(B, D, W - 1, dtype=torch.float64) if with_state else None
    y, final = causal_conv1d_fn(x, weight, bias, activation, h0, output_final_state=True)
    for b in range(B):
        s = h0[b] if with_state else torch.zeros(D, W - 1, dtype=torch.float64)
        ry, rf = _ref_sequence(x[b], weight, bias, activation, s)
        torch.testing.assert_close(y[b], ry, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(final[b], rf, rtol=0, atol=0)


@pytest.mark.parametrize("W", [1, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_varlen_matches_per_sequence_loop(W, with_state):
    lens = [5, 1, 0, 2, 33, 7]  # shorter than W-1, empty, and long sequences
    D = 12
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    T = int(cu[-1])
    x = torch.randn(1, T, D, dtype=torch.float64)
    weight, bias = _params(D, W)
    N = len(lens)
    h0 = torch.randn(N, D, W - 1, dtype=torch.float64) if with_state else None
    y, final = causal_conv1d_fn(x, weight, bias, "silu", h0, output_final_state=True, cu_seqlens=cu)
    assert y.shape == (1, T, D) and final.shape == (N, D, W - 1)
    for n in range(N):
        s = h0[n] if with_state else torch.zeros(D, W - 1, dtype=torch.float64)
        ry, rf = _ref_sequence(x[0, cu[n]:cu[n + 1]], weight, bias, "silu", s)
        torch.testing.assert_close(y[0, cu[n]:cu[n + 1]], ry, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(final[n], rf, rtol=0, atol=0)


def test_short_sequence_final_state_is_left_padded():
    D, W = 3, 4
    x = torch.randn(1, 2, D, dtype=torch.float64)
    weight, _ = _params(D, W)
    _, f0 = causal_conv1d_fn(x, weight, output_final_state=True)
    assert torch.equal(f0[0, :, 0], torch.zeros(D, dtype=torch.float64))
    assert torch.equal(f0[0, :, 1:], x[0].T)
    h0 = torch.randn(1, D, W - 1, dtype=torch.float64)
    _, f1 = causal_conv1d_fn(x, weight, initial_state=h0, output_final_state=True)
    assert torch.equal(f1[0, :, 0], h0[0, :, 2])
    assert torch.equal(f1[0, :, 1:], x[0].T)


def test_split_resume_equals_one_call():
    B, T, D, W, s = 2, 20, 8, 4, 9
    x = torch.randn(B, T, D, dtype=torch.float64)
    weight, bias = _params(D, W)
    h0 = torch.randn(B, D, W - 1, dtype=torch.float64)
    y, f = causal_conv1d_fn(x, weight, bias, "silu", h0, True)
    y1, f1 = causal_conv1d_fn(x[:, :s], weight, bias, "silu", h0, True)
    y2, f2 = causal_conv1d_fn(x[:, s:], weight, bias, "silu", f1, True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f2, f, rtol=0, atol=0)


def test_low_precision_keeps_dtype():
    x = torch.randn(2, 9, 16).to(torch.bfloat16)
    weight, bias = _params(16, 4, dtype=torch.float32)
    y, f = causal_conv1d_fn(x, weight, bias, "silu", output_final_state=True)
    assert y.dtype == torch.bfloat16 and f.dtype == torch.bfloat16
    ref, _ = causal_conv1d_fn(x.double(), weight.double(), bias.double(), "silu")
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(f, x[:, -3:].transpose(1, 2))


@pytest.mark.parametrize("L", [1, 2, 3])
def test_update_in_place_with_padding_row(L):
    num_slots, D, W = 7, 10, 4
    pool = torch.randn(num_slots, D, W - 1, dtype=torch.float64)
    before = pool.clone()
    idx = torch.tensor([5, -1, 0, 3])
    N = idx.numel()
    x = torch.randn(N, L, D, dtype=torch.float64)
    x[1] = float("nan")  # a padding row's input must not leak anywhere
    weight, bias = _params(D, W)
    y = causal_conv1d_update(x, pool, weight, bias, "silu", conv_state_indices=idx)
    assert y.shape == (N, L, D)
    for n, slot in enumerate(idx.tolist()):
        if slot < 0:
            assert torch.equal(y[n], torch.zeros(L, D, dtype=torch.float64))
            continue
        ry, rf = _ref_sequence(x[n], weight, bias, "silu", before[slot])
        torch.testing.assert_close(y[n], ry, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pool[slot], rf, rtol=0, atol=0)
    untouched = [s for s in range(num_slots) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_update_without_indices_and_single_token_2d():
    N, D, W = 3, 6, 3
    pool = torch.randn(N + 2, D, W - 1, dtype=torch.float64)
    before = pool.clone()
    x = torch.randn(N, D, dtype=torch.float64)
    weight, _ = _params(D, W, bias=False)
    y = causal_conv1d_update(x, pool, weight)
    assert y.shape == (N, D)
    for n in range(N):
        ry, rf = _ref_sequence(x[n:n + 1], weight, None, None, before[n])
        torch.testing.assert_close(y[n], ry[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pool[n], rf, rtol=0, atol=0)
    assert torch.equal(pool[N:], before[N:])


def test_prefill_then_decode_equals_prefill():
    D, W = 8, 4
    cu = torch.tensor([0, 6, 8, 19])  # lengths 6, 2, 11
    x = torch.randn(1, 19, D, dtype=torch.float64)
    nxt = torch.randn(3, 2, D, dtype=torch.float64)
    weight, bias = _params(D, W)
    _, f = causal_conv1d_fn(x, weight, bias, "silu", output_final_state=True, cu_seqlens=cu)
    pool = torch.full((5, D, W - 1), float("nan"), dtype=torch.float64)
    slots = torch.tensor([4, 0, 2])
    pool[slots] = f
    y_dec = causal_conv1d_update(nxt, pool, weight, bias, "silu", conv_state_indices=slots)
    for n in range(3):
        full = torch.cat([x[0, cu[n]:cu[n + 1]], nxt[n]])[None]
        y_full, f_full = causal_conv1d_fn(full, weight, bias, "silu", output_final_state=True)
        torch.testing.assert_close(y_dec[n], y_full[0, -2:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pool[slots[n]], f_full[0], rtol=0, atol=0)


def test_bad_inputs():
    x = torch.randn(1, 8, 6)
    w = torch.randn(6, 4)
    with pytest.raises(ValueError, match="x must be"):
        causal_conv1d_fn(x[0], w)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_fn(x, torch.randn(5, 4))
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d_fn(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fn(x, w, activation="relu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d_fn(x, w, initial_state=torch.randn(1, 6, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_fn(x, w, cu_seqlens=torch.tensor([0, 5, 7]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_fn(x, w, cu_seqlens=torch.tensor([0, 5, 3, 8]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_fn(torch.randn(2, 8, 6), w, cu_seqlens=torch.tensor([0, 8]))
    pool = torch.randn(4, 6, 3)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(torch.randn(2, 1, 6), torch.randn(4, 6, 2), w)
    with pytest.raises(ValueError, match="conv_state_indices"):
        causal_conv1d_update(torch.randn(2, 1, 6), pool, w, conv_state_indices=torch.tensor([0]))
    with pytest.raises(ValueError, match="conv_state_indices"):
        causal_conv1d_update(torch.randn(2, 1, 6), pool, w, conv_state_indices=torch.tensor([0, 4]))


def test_verify_conv_matches_prefill_per_position():
    """causal_conv1d_verify: row n's outputs equal the prefill conv of its tokens from the window
    in read_indices[n], and the window written for token j equals the prefill's final state
    after tokens 0..j; -1 write slots and unowned slots are left alone."""
    from hyla.ops.conv import causal_conv1d_verify

    gen = torch.Generator().manual_seed(4)
    N, L, D, W = 3, 5, 12, 4
    x = torch.randn(N, L, D, generator=gen, dtype=torch.float64)
    weight = torch.randn(D, W, generator=gen, dtype=torch.float64)
    bias = torch.randn(D, generator=gen, dtype=torch.float64)
    pool = torch.randn(20, D, W - 1, generator=gen, dtype=torch.float64)
    read = torch.tensor([4, 0, 9])
    write = torch.tensor([[4, 5, 6, 7, 8], [1, 2, 3, -1, -1], [10, 11, 12, 13, 14]])  # row 0 reuses its slot
    before = pool.clone()
    y = causal_conv1d_verify(x, pool, weight, bias, "silu", read_indices=read, write_indices=write)
    for n in range(N):
        want, _ = causal_conv1d_fn(x[n:n + 1], weight, bias, "silu", initial_state=before[read[n]][None])
        torch.testing.assert_close(y[n], want[0], rtol=1e-12, atol=1e-12)
        for j in range(L):
            if write[n, j] < 0:
                continue
            _, final = causal_conv1d_fn(x[n:n + 1, :j + 1], weight, bias, "silu",
                                        initial_state=before[read[n]][None], output_final_state=True)
            torch.testing.assert_close(pool[write[n, j]], final[0], rtol=0, atol=0)
    untouched = [s for s in range(20) if s not in write[write >= 0].tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    with pytest.raises(ValueError, match="write_indices"):
        causal_conv1d_verify(x, pool, weight, read_indices=read, write_indices=write[:, :2])
    with pytest.raises(ValueError, match="read_indices"):
        causal_conv1d_verify(x, pool, weight, read_indices=read[:2])
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_verify(x, pool[:, :, :2], weight, read_indices=read)
    with pytest.raises(ValueError, match=r"x must be"):
        causal_conv1d_verify(x[0], pool, weight, read_indices=read)


def test_slot_range_check_reads_recorded_host_values():
    """An engine step's state slots carry the host values they were built from
    (ForwardBatch.build): the update's range check reads those, no device value (on CUDA an eager
    step synced three times per KDA layer), and still refuses a slot past the pool."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hyla.contract.batch import ForwardBatch
    from hyla.ops.utils import known_host_values

    batch = ForwardBatch.build(seq_lens=[1, 1], context_lens=[3, 5], block_tables=[[0], [1]], state_slots=[2, 0])
    assert known_host_values(batch.state_slots) == [2, 0]
    weight, bias = _params(6, 4)
    state = torch.zeros(3, 6, 3, dtype=torch.float64)

    class HostReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("is_nonzero", "_local_scalar_dense", "item"):
                HostReads.reads += 1
            return func(*args, **(kwargs or {}))

    with HostReads():
        causal_conv1d_update(torch.randn(2, 6, dtype=torch.float64), state, weight, bias, "silu",
                             conv_state_indices=batch.state_slots)
    assert HostReads.reads == 0
    past = ForwardBatch.build(seq_lens=[1], context_lens=[3], block_tables=[[0]], state_slots=[3]).state_slots
    with pytest.raises(ValueError, match="out of range"):
        causal_conv1d_update(torch.randn(1, 6, dtype=torch.float64), state, weight, bias, "silu", conv_state_indices=past)
    with pytest.raises(ValueError, match="out of range"):  # a tensor without recorded values: read from it
        causal_conv1d_update(torch.randn(1, 6, dtype=torch.float64), state, weight, bias, "silu",
                             conv_state_indices=torch.tensor([3]))


def test_index_range_check_reads_nested_recorded_values():
    """A verify step's [N, 1 + k] slots recorded as nested lists: the range check (shared by the
    conv and recurrent ops) reads every row from the host."""
    from hyla.ops.utils import any_index_at_least, remember_host_values

    slots = remember_host_values(torch.tensor([[0, 1], [2, 3]]), [[0, 1], [2, 3]])
    assert not any_index_at_least(slots, 4) and any_index_at_least(slots, 3)
    assert any_index_at_least(torch.tensor([0, 5]), 5) and not any_index_at_least(torch.tensor([0, 4]), 5)
