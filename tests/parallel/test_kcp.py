"""KCP over real gloo process groups (world sizes 2 and 4) against single-process chunk ops.

One ``torch.multiprocessing.spawn`` per world size runs every case; workers save what they
measured and the parent asserts, so a failure names the case and the rank.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from hyla.ops import chunk_gated_delta_rule, chunk_kda, segment_affine
from hyla.parallel import (
    add_incoming,
    balanced_slice_lengths,
    chunk_gated_delta_rule_cp,
    chunk_kda_cp,
    local_pass,
    first_pass,
    count_comm_bytes,
    kcp_comm_bytes,
    scan_summaries,
    simulate_kcp,
    softmax_cp_comm_bytes,
)


def make_inputs(B, T, H, K, V, *, gate="kda", hv=None, seed=0, dtype=torch.float64):
    """Fresh random inputs for the whole sequence: q, k [B, T, H, K]; v [B, T, HV, V];
    g [B, T, HV, K] or [B, T, HV] (log-decay, mild so state crosses slice boundaries);
    beta [B, T, HV]; h0 [B, HV, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    hv = hv or H
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, hv, V)
    g_shape = (B, T, hv, K) if gate == "kda" else (B, T, hv)
    g = -F.softplus(r(*g_shape) - 3.0)
    beta = torch.rand(B, T, hv, generator=gen, dtype=torch.float64)
    h0 = r(B, hv, K, V)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, h0))


# name -> (gate, lengths per world size, B, H, HV, K, V, dtype, with initial state, extra kwargs)
CASES = {
    "kda_uneven_h0": ("kda", {2: [77, 223], 4: [50, 130, 7, 113]}, 2, 2, 2, 16, 24, torch.float64, True, {}),
    "kda_empty_slice": ("kda", {2: [0, 150], 4: [63, 0, 65, 1]}, 1, 1, 1, 16, 16, torch.float64, True, {}),
    "kda_no_h0_grouped": ("kda", {2: [100, 156], 4: [1, 64, 65, 126]}, 1, 1, 2, 24, 16, torch.float64, False, {}),
    "gdn_uneven_h0_l2norm": ("gdn", {2: [90, 171], 4: [33, 100, 64, 64]}, 2, 2, 4, 16, 32, torch.float64, True,
                             {"use_qk_l2norm_in_kernel": True, "scale": 0.3}),
    "kda_fp32": ("kda", {2: [80, 176], 4: [64, 64, 64, 64]}, 1, 2, 2, 32, 32, torch.float32, True, {}),
}


def _run_case(name, rank, world):
    gate, lengths, B, H, HV, K, V, dtype, with_h0, kw = CASES[name]
    lengths = lengths[world]
    q, k, v, g, beta, h0 = make_inputs(B, sum(lengths), H, K, V, gate=gate, hv=HV, seed=len(name), dtype=dtype)
    h0 = h0 if with_h0 else None
    s = sum(lengths[:rank])
    e = s + lengths[rank]
    cp_op, op = (chunk_kda_cp, chunk_kda) if gate == "kda" else (chunk_gated_delta_rule_cp, chunk_gated_delta_rule)
    with count_comm_bytes() as counter:
        o, final = cp_op(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=h0, **kw)
    o_ref, final_ref = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()

    return {
        "o_err": rel(o, o_ref[:, s:e]) if e > s else 0.0,
        "o_shape": tuple(o.shape), "o_dtype": o.dtype, "o_finite": bool(torch.isfinite(o).all()),
        "final_err": rel(final, final_ref), "final": final,
        "bytes": counter.bytes_sent, "calls": counter.calls,
        "want_bytes": kcp_comm_bytes(B, HV, K, V, torch.float64 if dtype == torch.float64 else torch.float32),
        "local_T": e - s,
    }


def _worker(rank, world, port, out_dir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        results = {name: _run_case(name, rank, world) for name in CASES}
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("world", [2, 4])
def test_kcp_matches_single_process_on_gloo(world, tmp_path):
    # the rendezvous store lives here, on a port the OS picks and this process holds (no window
    # in which a parallel test could take it); the ranks connect to it as clients
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    mp.spawn(_worker, args=(world, store.port, str(tmp_path)), nprocs=world, join=True)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for name, (_, lengths, B, H, HV, K, V, dtype, _, _) in CASES.items():
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        for rank, res in enumerate(per_rank):
            r = res[name]
            where = f"{name}, rank {rank} of {world}"
            assert r["o_shape"] == (B, lengths[world][rank], HV, V), where
            assert r["o_dtype"] == dtype and r["o_finite"], where
            assert r["o_err"] <= tol, f"{where}: output rel err {r['o_err']:.3e}"
            assert r["final_err"] <= tol, f"{where}: final state rel err {r['final_err']:.3e}"
            # One all-gather of B*HV*(K^2 + K*V) summary elements, whatever T_local (0 included).
            assert r["calls"] == 1, where
            itemsize = 8 if dtype == torch.float64 else 4
            assert r["bytes"] == r["want_bytes"] == B * HV * (K * K + K * V) * itemsize, where
            # Every rank scans the same gathered summaries: the final state is bit-identical.
            assert torch.equal(r["final"], per_rank[0][name]["final"]), where


# --- single process: the scan, the simulation, the formulas, argument checks -------------------


def test_simulation_matches_chunk_ops():
    for gate, op in (("kda", chunk_kda), ("gdn", chunk_gated_delta_rule)):
        q, k, v, g, beta, h0 = make_inputs(1, 200, 2, 16, 20, gate=gate, hv=4, seed=3)
        o, final, M_all, S_all, incoming = simulate_kcp(q, k, v, g, beta, [30, 0, 101, 69], gate=gate,
                                                         initial_state=h0)
        o_ref, final_ref, ck = op(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  checkpoint_positions=[[30, 30, 131]])
        assert (o - o_ref).abs().max() <= 1e-12
        assert (final - final_ref).abs().max() <= 1e-12
        assert torch.allclose(incoming[0], h0, rtol=0, atol=0)
        assert (incoming[1:] - ck[0][:, None]).abs().max() <= 1e-12
        assert M_all.shape == (4, 1, 4, 16, 16) and S_all.shape == (4, 1, 4, 16, 20)


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("T", [0, 1, 77])
def test_local_pass_gives_outputs_and_summary_in_one_pass(gate, T):
    """o_zero + P @ S_in equals the chunk op from S_in, and (M, S~) equals segment_affine, for
    an arbitrary incoming state S_in: the identity each rank relies on."""
    q, k, v, g, beta, s_in = make_inputs(2, T, 2, 12, 18, gate=gate, hv=4, seed=T + 11)
    op = chunk_kda if gate == "kda" else chunk_gated_delta_rule
    o_zero, P, M, S = local_pass(q, k, v, g, beta, gate=gate, scale=0.3, use_qk_l2norm_in_kernel=True)
    assert o_zero.shape == (2, T, 4, 18) and P.shape == (2, T, 4, 12)
    M_ref, S_ref = segment_affine(k, v, g, beta, gate=gate, use_qk_l2norm_in_kernel=True)
    assert (M - M_ref).abs().max() <= 1e-12 and (S - S_ref).abs().max() <= 1e-12
    if T:
        o_ref, _ = op(q, k, v, g, beta, scale=0.3, initial_state=s_in, use_qk_l2norm_in_kernel=True)
        assert (add_incoming(o_zero, P, s_in) - o_ref).abs().max() <= 1e-12


@pytest.mark.parametrize("gate", ["kda", "gdn"])
@pytest.mark.parametrize("T,with_h0", [(0, True), (0, False), (45, True), (77, False)])
def test_first_slice_runs_the_plain_pass_and_sends_its_final_state(gate, T, with_h0):
    """Rank 0's summary is (0, its final state from the known incoming state), so the scan hands
    rank 1 that state; its outputs are the chunk op's own."""
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 12, 18, gate=gate, hv=4, seed=T + 5)
    h0 = h0 if with_h0 else None
    op = chunk_kda if gate == "kda" else chunk_gated_delta_rule
    o, M, S = first_pass(q, k, v, g, beta, gate=gate, initial_state=h0, scale=0.3)
    assert o.shape == (2, T, 4, 18) and M.shape == (2, 4, 12, 12) and not M.any()
    want = h0 if h0 is not None else torch.zeros(2, 4, 12, 18, dtype=torch.float64)
    if T:
        o_ref, want = op(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True)
        assert (o - o_ref).abs().max() <= 1e-12
    assert (S - want).abs().max() <= 1e-12
    incoming, _ = scan_summaries(torch.stack([M, M]), torch.stack([S, S]), h0)
    assert (incoming[1] - want).abs().max() <= 1e-12


@pytest.mark.parametrize("tokens,world,cost", [(131072, 2, 1.5), (524288, 4, 1.5), (524288, 8, 1.4), (1000, 3, 1.5),
                                               (100, 4, 2.0), (0, 2, 1.5), (64, 1, 1.5)])
def test_balanced_slice_lengths_equalise_the_ranks_passes(tokens, world, cost):
    lengths = balanced_slice_lengths(tokens, world, extended_cost=cost)
    assert len(lengths) == world and sum(lengths) == tokens and min(lengths) >= 0
    assert all(n % 64 == 0 for n in lengths[:-1])
    if tokens >= 64 * 8 * world:  # whole chunks leave at most one chunk of imbalance per rank
        times = [lengths[0]] + [cost * n for n in lengths[1:]]
        assert max(times) - min(times) <= 64 * cost * world, lengths
        assert lengths[0] > lengths[1]  # the plain pass takes more tokens
    with pytest.raises(ValueError, match="extended_cost"):
        balanced_slice_lengths(10, 2, extended_cost=0.5)
    with pytest.raises(ValueError, match="world"):
        balanced_slice_lengths(10, 0)


def test_direct_sum_is_wrong_and_scan_is_exact():
    """Seed 003 §4.10.5: adding segment states is wrong by O(1) (0.978 there), the scan is exact
    (1.1e-16). Same setup as scripts/kcp_demo.py."""
    from hyla.viz.plots import direct_sum_vs_scan

    r = direct_sum_vs_scan(T=64, n_segments=4, K=16, V=16, chunk_size=16, seed=0)
    assert r["direct_max"] > 0.5 and r["direct_rel"] > 0.5
    assert r["scan_max"] <= 1e-15 and r["scan_rel"] <= 1e-15
    assert r["scan_incoming_max"] <= 1e-15 and r["output_rel"] <= 1e-15


def test_scan_summaries_is_the_sequential_composition():
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(3, 2, 1, 4, 4, generator=gen, dtype=torch.float64) * 0.5
    S = torch.randn(3, 2, 1, 4, 5, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, 1, 4, 5, generator=gen, dtype=torch.float64)
    incoming, final = scan_summaries(M, S, h0)
    state = h0
    for r in range(3):
        assert torch.equal(incoming[r], state)
        state = M[r] @ state + S[r]
    assert torch.equal(final, state)
    incoming, _ = scan_summaries(M, S)
    assert torch.equal(incoming[0], torch.zeros_like(h0))
    with pytest.raises(ValueError, match="S_all"):
        scan_summaries(M, S[..., :3, :])
    with pytest.raises(ValueError, match="initial_state"):
        scan_summaries(M, S, h0[:1])


def test_comm_byte_formulas():
    # Seed 003 §4.10.4: batch = heads = 1, dk = dv = 16 -> 2048 bytes in fp32, 4096 in fp64.
    assert kcp_comm_bytes(1, 1, 16, 16, torch.float32) == 2048
    assert kcp_comm_bytes(1, 1, 16, 16, torch.float64) == 4096
    assert kcp_comm_bytes(2, 8, 128, 64, 2) == 2 * 8 * (128 * 128 + 128 * 64) * 2
    assert softmax_cp_comm_bytes(1, 8, 128, 128, 1000, torch.bfloat16) == 1000 * 8 * 256 * 2
    assert softmax_cp_comm_bytes(1, 8, 128, 128, 2000) == 2 * softmax_cp_comm_bytes(1, 8, 128, 128, 1000)
    with pytest.raises(ValueError, match="heads"):
        kcp_comm_bytes(1, 0, 16, 16)
    with pytest.raises(ValueError, match="dtype"):
        kcp_comm_bytes(1, 1, 16, 16, "fp32")
    with pytest.raises(ValueError, match="tokens_per_rank"):
        softmax_cp_comm_bytes(1, 1, 16, 16, -1)


def test_bad_arguments_fail_before_any_collective():
    q, k, v, g, beta, h0 = make_inputs(1, 10, 2, 8, 8)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda_cp(q, k, v, g, beta, initial_state=h0[..., :4])
    with pytest.raises(ValueError, match="g"):
        chunk_kda_cp(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="g"):
        chunk_gated_delta_rule_cp(q, k, v, g, beta)  # a KDA gate passed to GDN
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_cp(q, k, v, g, beta[:, :5])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_cp(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_cp(q, k, v, g, beta, chunk_size=24)  # chunk_kda would reject it after the all-gather
    with pytest.raises(ValueError, match="lengths"):
        simulate_kcp(q, k, v, g, beta, [4, 5])
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        chunk_kda_cp(q, k, v, g, beta)
