"""GPU benchmark of the Triton kernels, side by side with fla in the same run.

    python -m hyla.bench kernels [--vs fla] [--quick] [--tune] [--out FILE]

Measures the device's two ceilings first (device-to-device copy bandwidth, counting bytes read
plus written; a bf16 8192^3 matmul), then:
  - prefill: chunk_kda / chunk_gated_delta_rule, bf16 q/k/v/beta, L2 norm of q/k in the kernel,
    final state out; precomputed fp32 log-decays and the fused-gate variants (raw bf16 gate input
    with A_log, dt_bias; KDA gate v1 softplus and v2 safe gate, lower_bound=-5);
    (B, T, H, D) in {(1, 32768, 32, 128), (8, 4096, 32, 128), (32, 1024, 32, 128)}, then the
    released models' head layouts (RELEASED_LAYOUTS: 64 KDA heads; GDN 16 k / 32 v heads);
  - decode: fused_recurrent_kda over an fp32 state pool with random slot indices, N sequences of
    one token, H = 32, D = 128, timed as CUDA-graph replays (how a serving engine runs decode).
    hyla's pool is K-last, the layout its engine allocates (hyla.contract.state_pool); fla's is
    its own contiguous [slots, H, K, V], on which hyla is timed too (same values in both).
Every time is a `triton.testing.do_bench` median after warm-up, on fresh random inputs (never
zeros). The roofline floor of a prefill is max(FLOPs / matmul rate, bytes / copy bandwidth) with
bytes = inputs read once + outputs written once. hyla's output is compared with fla's in the same
run (relative difference of o) so a fast wrong kernel cannot pass unnoticed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform

import torch
import torch.nn.functional as F

from hyla.contract import as_k_last

PREFILL_SHAPES = [(1, 32768, 32, 128), (8, 4096, 32, 128), (32, 1024, 32, 128)]
# The released models' head layouts, at 32K tokens, each with its model's gate (B, T, H, D, HV):
# GLM-5-Next's 64 KDA heads with the safe gate, Qwen3-Next / Qwen3.5's GDN with 16 k-heads and
# 32 v-heads (GVA). (Kimi-Linear's 32 KDA heads with gate v1 are PREFILL_SHAPES' first row.)
RELEASED_LAYOUTS = [((1, 32768, 64, 128, 64), ("kda", "fused-v2")), ((1, 32768, 16, 128, 32), ("gdn", "fused-v1"))]
DECODE_N = [1, 8, 32, 64, 128, 256, 512]
# (persistent, value block, warps, programs per SM) timed by --tune for decode (K-last pool)
DECODE_CONFIGS = [(False, bv, nw, 0) for bv, nw in ((8, 1), (16, 1), (16, 2), (32, 1), (32, 2))] + [
    (True, bv, nw, pps) for bv, nw, pps in ((16, 1, 8), (16, 1, 16), (8, 1, 16))]
CHUNK = 64


def _bench(fn, graph=False):
    import triton.testing as tt

    if graph:
        return tt.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _ceilings():
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, measured here."""
    n = 1 << 29  # 2 GiB of fp32 each way: far past L2
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    t = _bench(lambda: y.copy_(x))
    copy_bw = 2 * n * 4 / (t * 1e-3)
    x = y = None  # free 4 GiB before the matmul operands
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = _bench(lambda: a @ b)
    return copy_bw, 2 * m ** 3 / (t * 1e-3)


def _prefill_inputs(B, T, H, D, gate, variant, gen, HV=None):
    """q, k with H heads; v, beta and the gate with HV (default H; HV > H is GVA)."""
    HV = HV or H
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, D).bfloat16(), r(B, T, H, D).bfloat16(), r(B, T, HV, D).bfloat16()
    beta = torch.rand(B, T, HV, device="cuda", generator=gen).bfloat16()
    gshape = (B, T, HV, D) if gate == "kda" else (B, T, HV)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    if variant == "gate":
        g = F.logsigmoid(r(*gshape))  # fp32 log-decays, as a gate projection + activation produces
    else:
        g = r(*gshape).bfloat16()  # raw gate projection
        A_log = torch.empty(HV, device="cuda").uniform_(0, math.log(16), generator=gen)  # per value head
        dt = torch.empty(D * HV if gate == "kda" else HV, device="cuda").uniform_(0.001, 0.1, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt + torch.log(-torch.expm1(-dt)))
        if variant == "fused-v2":
            kw["lower_bound"] = -5.0
    return q, k, v, g, beta, kw


def _prefill_floor(B, T, H, D, g, copy_bw, mm_rate, HV=None):
    """(floor ms, bytes, flops): bytes = q, k (H heads), v, g, beta in + o, final state out (HV)."""
    HV = HV or H
    tok = B * T * HV
    nbytes = B * T * D * 2 * (2 * H + 2 * HV) + g.numel() * g.element_size() + tok * 2 + B * HV * D * D * 4
    # per token-head: Gram blocks (lower triangles) C*D, WY solve C/2*(K+V), state 3*K*V + C/2*V
    macs = tok * (CHUNK * D + CHUNK // 2 * 2 * D + 3 * D * D + CHUNK // 2 * D)
    flops = 2 * macs
    return max(nbytes / copy_bw, flops / mm_rate) * 1e3, nbytes, flops


def _fla_fns():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    from fla.ops.kda import chunk_kda as fla_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_kda_decode

    return fla_kda, fla_gdn, fla_kda_decode


def _fla_prefill_kwargs(gate, kw):
    out = dict(kw)
    if gate == "kda" and out.get("lower_bound") is not None:
        out["safe_gate"] = True  # fla's bounded-gate fast path (M=16 tensor cores)
    return out


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# Launch configurations timed by --tune (changes from the defaults): the Gram kernel's warps and
# channel slices, the factor kernel's slice width, a fused gate's activation in the kernels or
# launched first.
PREFILL_CONFIGS = [
    dict(),
    dict(intra_warps=8),
    dict(slice_k=16),
    dict(factor_slice=32),
    dict(factor_slice=64),
    dict(precompute_gate=False),
    dict(precompute_gate=True),
    dict(low_precision_inverse=False),
    dict(low_precision_inverse=True),
    dict(gram_maxnreg=168),
    dict(gram_maxnreg=128),
    dict(factor_maxnreg=128),
]


def _tune_prefill(q, k, v, g, beta, gate, kw):
    from hyla.ops.triton.chunk import chunk_fwd

    out = []
    for cfg in PREFILL_CONFIGS:
        try:
            t = _bench(lambda: chunk_fwd(q, k, v, g, beta, gate=gate, **kw, **cfg))
        except Exception as err:  # noqa: BLE001 - a config that does not compile
            print(f"    {cfg}: failed ({type(err).__name__})")
            continue
        print(f"    {cfg}: {t:.3f} ms", flush=True)
        out.append(dict(cfg, ms=t))
    return out


def run_prefill(shapes, variants, copy_bw, mm_rate, vs_fla, tune=False, layouts=(), launch=None):
    """Every variant at every shape, then the `layouts` cells ((B, T, H, D, HV), (gate, variant)).
    launch: extra launch parameters of hyla's chunk_fwd (an A / B of an option), hyla's side only."""
    from hyla.ops import triton as ht

    fla = _fla_fns() if vs_fla else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    cells = [(shape, gv) for shape in shapes for gv in variants] + list(layouts)
    for (B, T, H, D, *hv), (gate, variant) in cells:
        HV = hv[0] if hv else H
        q, k, v, g, beta, kw = _prefill_inputs(B, T, H, D, gate, variant, gen, HV)
        ours = ht.chunk_kda if gate == "kda" else ht.chunk_gated_delta_rule
        row = dict(op=f"chunk_{gate}", B=B, T=T, H=H, HV=HV, D=D, variant=variant)
        if tune and (variant == "gate" or (B, T) == tuple(shapes[0][:2])):
            row["configs"] = _tune_prefill(q, k, v, g, beta, gate, kw)
            row["best_config"] = min(row["configs"], key=lambda c: c["ms"])
        mine = {**kw, **(launch or {})}
        o, _ = ours(q, k, v, g, beta, **mine)
        row["hyla_ms"] = _bench(lambda: ours(q, k, v, g, beta, **mine))
        if fla:
            fn = fla[0] if gate == "kda" else fla[1]
            fkw = _fla_prefill_kwargs(gate, kw)
            o_f, _ = fn(q, k, v, g, beta, **fkw)
            row["fla_ms"] = _bench(lambda: fn(q, k, v, g, beta, **fkw))
            row["ratio"] = row["fla_ms"] / row["hyla_ms"]
            row["rel_diff_vs_fla"] = _rel(o, o_f)
        row["floor_ms"], row["bytes"], row["flops"] = _prefill_floor(B, T, H, D, g, copy_bw, mm_rate, HV)
        rows.append(row)
        print("  " + _prefill_line(row), flush=True)
        q = k = v = g = beta = o = None
        torch.cuda.empty_cache()
    return rows


def run_decode(ns, copy_bw, vs_fla, H=32, D=128, tune=False):
    from hyla.ops import triton as ht

    fla = _fla_fns() if vs_fla else None
    gen = torch.Generator(device="cuda").manual_seed(1)
    slots = 2 * max(ns)
    pool_kv = torch.randn(slots, H, D, D, device="cuda", generator=gen)  # fla's layout
    pool = as_k_last(pool_kv)  # hyla's engine layout
    rows = []
    for N in ns:
        q, k, v = (torch.randn(N, 1, H, D, device="cuda", generator=gen).bfloat16() for _ in range(3))
        g = F.logsigmoid(torch.randn(N, 1, H, D, device="cuda", generator=gen))
        beta = torch.rand(N, 1, H, device="cuda", generator=gen).bfloat16()
        idx = torch.randperm(slots, device="cuda", generator=gen)[:N].to(torch.int32)
        nbytes = N * H * D * D * 4 * 2 + N * H * D * (2 * 3 + 4 + 2) + N * H * 2
        row = dict(op="fused_recurrent_kda", N=N, H=H, D=D)
        if tune and N in (64, 256, 512):
            from hyla.ops.triton.recurrent import recurrent_fwd

            row["configs"] = []
            for persistent, bv, nw, pps in DECODE_CONFIGS:
                t = _bench(lambda: recurrent_fwd(q, k, v, g, beta, gate="kda", initial_state=pool,
                                                 ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                                                 block_v=bv, num_warps=nw, persistent=persistent,
                                                 programs_per_sm=pps or None), graph=True)
                frac = nbytes / (t * 1e-3) / copy_bw
                print(f"    N={N} persistent={persistent} BV={bv} warps={nw} programs/SM={pps}: "
                      f"{t * 1e3:.1f} us ({100 * frac:.0f}% copy)", flush=True)
                row["configs"].append(dict(persistent=persistent, block_v=bv, num_warps=nw, programs_per_sm=pps,
                                           us=t * 1e3, frac_copy=frac))
        call = lambda: ht.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool,  # noqa: E731
                                              ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
        row["hyla_ms"] = _bench(call, graph=True)
        row["hyla_gbs"] = nbytes / (row["hyla_ms"] * 1e-3) / 1e9
        row["hyla_frac_copy"] = nbytes / (row["hyla_ms"] * 1e-3) / copy_bw
        row["hyla_kv_ms"] = _bench(lambda: ht.fused_recurrent_kda(q, k, v, g, beta, initial_state=pool_kv,
                                                                   ssm_state_indices=idx, use_qk_l2norm_in_kernel=True),
                                   graph=True)
        row["hyla_kv_frac_copy"] = nbytes / (row["hyla_kv_ms"] * 1e-3) / copy_bw
        if fla:
            f = lambda: fla[2](q=q, k=k, v=v, g=g, beta=beta, initial_state=pool_kv,  # noqa: E731
                               inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
            p0 = pool_kv.clone()
            pool.copy_(p0)  # the same start values in both layouts
            o_h, _ = call()
            o_f, _ = f()
            pool.copy_(p0)
            pool_kv.copy_(p0)
            del p0
            row["rel_diff_vs_fla"] = _rel(o_h, o_f)
            row["fla_ms"] = _bench(f, graph=True)
            row["fla_gbs"] = nbytes / (row["fla_ms"] * 1e-3) / 1e9
            row["fla_frac_copy"] = nbytes / (row["fla_ms"] * 1e-3) / copy_bw
            row["ratio"] = row["fla_ms"] / row["hyla_ms"]
        rows.append(row)
        print("  " + _decode_line(row), flush=True)
    return rows


def profile_kernels(shape, gate, variant, vs_fla):
    """Per-kernel GPU time of one prefill call (torch.profiler), hyla and fla: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    from hyla.ops import triton as ht

    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, g, beta, kw = _prefill_inputs(*shape, gate, variant, gen)
    calls = [("hyla", lambda: (ht.chunk_kda if gate == "kda" else ht.chunk_gated_delta_rule)(q, k, v, g, beta, **kw))]
    if vs_fla:
        fla = _fla_fns()
        fkw = _fla_prefill_kwargs(gate, kw)
        calls.append(("fla", lambda: (fla[0] if gate == "kda" else fla[1])(q, k, v, g, beta, **fkw)))
    for name, fn in calls:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        print(f"  profile {name} chunk_{gate} {variant} {shape} (3 calls):")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
            print(f"    {e.device_time_total / 3 / 1e3:8.3f} ms/call  {e.key[:90]}")


def _prefill_line(r):
    heads = f"H{r['H']}" + (f"/{r['HV']}" if r.get("HV", r["H"]) != r["H"] else "")
    s = f"{r['op']:<24} {r['B']:>2}x{r['T']:<6} {heads:<6} {r['variant']:<9} hyla {r['hyla_ms']:7.3f} ms"
    if "fla_ms" in r:
        s += f"  fla {r['fla_ms']:7.3f} ms  x{r['ratio']:.2f}  diff {r['rel_diff_vs_fla']:.1e}"
    return s + f"  floor {r['floor_ms']:.3f} ms"


def _decode_line(r):
    s = (f"decode N={r['N']:<4} hyla {r['hyla_ms'] * 1e3:7.1f} us {r['hyla_gbs']:6.0f} GB/s "
         f"({100 * r['hyla_frac_copy']:.0f}% copy; [K,V] pool {r['hyla_kv_ms'] * 1e3:.1f} us, "
         f"{100 * r['hyla_kv_frac_copy']:.0f}%)")
    if "fla_ms" in r:
        s += (f"  fla {r['fla_ms'] * 1e3:7.1f} us {r['fla_gbs']:6.0f} GB/s ({100 * r['fla_frac_copy']:.0f}%)"
              f"  x{r['ratio']:.2f}  diff {r['rel_diff_vs_fla']:.1e}")
    return s


def markdown(meta, prefill, decode):
    out = [f"Command: `{meta['command']}`  ",
           f"Device: {meta['device']} ({meta['sms']} SMs); torch {meta['torch']}, triton {meta['triton']}, "
           f"fla {meta.get('fla', '-')}; {meta['date']}  ",
           f"Measured ceilings: copy {meta['copy_tbs']:.2f} TB/s (read + write), "
           f"bf16 matmul {meta['mm_tflops']:.0f} TFLOP/s", "",
           "| op | B x T x heads (k / v) | variant | hyla ms | fla ms | fla / hyla | floor ms | hyla / floor | o diff vs fla |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in prefill:
        heads = f"{r['H']}" + (f" / {r['HV']}" if r.get("HV", r["H"]) != r["H"] else "")
        out.append(f"| {r['op']} | {r['B']} x {r['T']} x {heads} | {r['variant']} | {r['hyla_ms']:.3f} | "
                   f"{r.get('fla_ms', float('nan')):.3f} | {r.get('ratio', float('nan')):.2f}x | "
                   f"{r['floor_ms']:.3f} | {r['hyla_ms'] / r['floor_ms']:.1f}x | "
                   f"{r.get('rel_diff_vs_fla', float('nan')):.1e} |")
    out += ["", "| decode N | hyla us (K-last pool) | hyla GB/s | % copy BW | hyla us ([K, V] pool) | % copy BW "
            "| fla us | fla GB/s | % copy BW | fla / hyla |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in decode:
        out.append(f"| {r['N']} | {r['hyla_ms'] * 1e3:.1f} | {r['hyla_gbs']:.0f} | {100 * r['hyla_frac_copy']:.0f}% | "
                   f"{r['hyla_kv_ms'] * 1e3:.1f} | {100 * r['hyla_kv_frac_copy']:.0f}% | "
                   f"{r.get('fla_ms', float('nan')) * 1e3:.1f} | {r.get('fla_gbs', float('nan')):.0f} | "
                   f"{100 * r.get('fla_frac_copy', float('nan')):.0f}% | {r.get('ratio', float('nan')):.2f}x |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m hyla.bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vs", choices=["fla", "none"], default="none", help="run fla 0.6's kernels side by side")
    ap.add_argument("--quick", action="store_true", help="one prefill shape, three decode sizes")
    ap.add_argument("--only", choices=["prefill", "decode", "layouts"],
                    help="run one half, or only the released head layouts' prefill cells")
    ap.add_argument("--tune", action="store_true", help="also time kernel configurations")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of one large prefill")
    ap.add_argument("--out", help="write the markdown table and JSON rows to FILE(.md/.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("hyla bench kernels needs a CUDA GPU")
    import triton

    meta = dict(command="python -m hyla.bench kernels" + (" " + " ".join(argv) if argv else ""),
                device=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count,
                torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                date=datetime.date.today().isoformat())
    if args.vs == "fla":
        import fla

        meta["fla"] = getattr(fla, "__version__", "?")
    copy_bw, mm_rate = _ceilings()
    meta["copy_tbs"], meta["mm_tflops"] = copy_bw / 1e12, mm_rate / 1e12
    print(f"{meta['device']}: copy {meta['copy_tbs']:.2f} TB/s, bf16 matmul {meta['mm_tflops']:.0f} TFLOP/s",
          flush=True)
    shapes = PREFILL_SHAPES[:1] if args.quick else PREFILL_SHAPES
    variants = [("kda", "gate"), ("kda", "fused-v1"), ("kda", "fused-v2"), ("gdn", "gate"), ("gdn", "fused-v1")]
    ns = [1, 64, 256] if args.quick else DECODE_N
    with torch.inference_mode():
        if args.profile:
            for i, (gate, variant) in enumerate(variants):
                profile_kernels(shapes[0], gate, variant, args.vs == "fla" and variant in ("gate", "fused-v1"))
        only_layouts = args.only == "layouts"
        prefill = [] if args.only == "decode" else run_prefill(
            [] if only_layouts else shapes, [] if only_layouts else variants, copy_bw, mm_rate,
            args.vs == "fla", tune=args.tune, layouts=() if args.quick else RELEASED_LAYOUTS)
        decode = [] if args.only in ("prefill", "layouts") else run_decode(ns, copy_bw, args.vs == "fla", tune=args.tune)
    table = markdown(meta, prefill, decode)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(table + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(dict(meta=meta, prefill=prefill, decode=decode), f, indent=1)
    print()
    print(table)


if __name__ == "__main__":
    main()
