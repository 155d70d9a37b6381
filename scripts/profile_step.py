"""Where a prefill and a decode step spend GPU time: the kernels of one call, by total time.

    python scripts/profile_step.py --random-config kimi-linear-48b-a3b --layers 4 --prefill 8192 --decode-batch 1 64
    python scripts/profile_step.py --random-config qwen3-next-80b-a3b --layers 4 --quantization fp8 --decode-batch 1

Random bf16 weights on the device (hyla.bench.random_models; with --quantization fp8 block-FP8
weights drawn on the device, as `hyla bench throughput -q fp8` draws them); one warm-up call, then one call
under torch.profiler (hyla.bench.floor.kernel_profile): kernel count, summed kernel time, the
top kernels. A hint for what to fuse next, not a benchmark figure.
"""

from __future__ import annotations

import argparse

import torch

from hyla.bench import floor as fl
from hyla.bench.random_models import RANDOM_CONFIGS, random_model
from hyla.bench.step_bench import make_runner
from hyla.contract import ForwardBatch
from hyla.engine.step_plan import StepPlan


def op_profile(fn, top: int) -> str:
    """GPU time by the torch op that launched it (self device time, summed over calls)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.self_device_time_total, e.count, e.key, str(e.input_shapes)[:60]) for e in
            prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0 and e.key.startswith("aten::")]
    rows.sort(reverse=True)
    return "\n".join(f"#   {us / 1e3:7.3f} ms {n:4d}x {key:<28} {shapes}" for us, n, key, shapes in rows[:top])


def host_profile(fn, top: int) -> str:
    """Wall time of a synced call (median of 3) against the host time the torch ops spend
    (self CPU time, summed): where a step waits on the host rather than on kernels."""
    import time

    from torch.profiler import ProfilerActivity, profile

    walls = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(((e.self_cpu_time_total, e.count, e.key) for e in prof.key_averages()), reverse=True)
    lines = [f"wall {sorted(walls)[1]:.2f} ms (synced, median of 3); host time by op (self CPU):"]
    lines += [f"  {us / 1e3:7.3f} ms {n:5d}x {key[:80]}" for us, n, key in rows[:top]]
    return "\n# ".join(lines)


def python_profile(fn, top: int) -> str:
    """Host time by python function (cProfile over one synced call): own time (tottime) and
    time including callees (cumtime), hyla's functions and the libraries' entry points. cProfile
    adds a few microseconds a call, so the ranking matters, not the sum."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        where = filename.split("/hyla/")[-1] if "/hyla/" in filename else filename.split("/")[-1]
        rows.append((tottime, cumtime, calls, f"{where}:{line} {name}"))
    total = sum(r[0] for r in rows)
    own = sorted(rows, reverse=True)[:top]
    cum = sorted((r for r in rows if "/" in r[3].split(" ")[0]),
                 key=lambda r: -r[1])[:top]
    lines = [f"{total * 1e3:.1f} ms under cProfile; by own time:"]
    lines += [f"  {t * 1e3:7.2f} ms {n:6d}x {w[:110]}" for t, _, n, w in own]
    lines += ["by time with callees (hyla's):"]
    lines += [f"  {c * 1e3:7.2f} ms {n:6d}x {w[:110]}" for _, c, n, w in cum]
    return "\n# ".join(lines)


def sync_sites(fn, top: int) -> str:
    """Where a call makes the host wait for the device (torch.cuda sync debug mode): the python
    line of each synchronising call, counted, innermost hyla frame first."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/hyla/" in f.filename or "/scripts/" in f.filename]
        where = frames[-1] if frames else None
        sites[f"{where.filename.split('/hyla/')[-1]}:{where.lineno} {where.line}" if where else f"{filename}:{lineno}"] += 1

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    lines = [f"{sum(sites.values())} synchronising calls:"] + [f"  {n:3d}x {site[:120]}" for site, n in sites.most_common(top)]
    return "\n# ".join(lines)


def gap_profile(fn, min_us: float = 10.0, top: int = 25) -> str:
    """Where the GPU idles during one call: the wall time, the span from the first kernel's start
    to the last one's end, the summed kernel time, and the idle gaps longer than min_us between
    consecutive kernels (largest first, with the kernels on each side). Idle at the start is the
    host building the step before its first launch; gaps inside are syncs or a host that launches
    slower than the GPU runs."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    ks = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.elapsed_us() > 0),
                key=lambda e: e.time_range.start)
    if not ks:
        return "no kernels"
    busy = sum(e.time_range.elapsed_us() for e in ks)
    span = ks[-1].time_range.end - ks[0].time_range.start
    gaps, end = [], ks[0].time_range.end
    for prev, k in zip(ks, ks[1:]):
        end = max(end, prev.time_range.end)
        if k.time_range.start - end > min_us:
            gaps.append((k.time_range.start - end, prev.name, k.name))
    gaps.sort(reverse=True)
    lines = [f"wall {wall:.2f} ms, kernel span {span / 1e3:.2f} ms, kernel time {busy / 1e3:.2f} ms, "
             f"{len(gaps)} gaps > {min_us:.0f} us summing {sum(g[0] for g in gaps) / 1e3:.2f} ms:"]
    lines += [f"  {us:8.1f} us after {a[:50]:<50} before {b[:50]}" for us, a, b in gaps[:top]]
    return "\n# ".join(lines)


def kernel_sequence(model, fn) -> str:
    """The kernels of one call in launch order, each under the decoder layer that launched it
    (each layer's forward is wrapped in a record_function range; a kernel belongs to the range
    whose GPU annotation holds its start). For counting kernels per layer, not for timing."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    layers = model.model.layers
    patched = []
    for i, layer in enumerate(layers):
        label = f"layer{i}:{type(getattr(layer, 'token_mixer', layer)).__name__}"
        for name in ("forward", "forward_residual"):
            if hasattr(layer, name):
                def wrapped(*a, _f=getattr(layer, name), _label=label, **kw):
                    with record_function(_label):
                        return _f(*a, **kw)
                setattr(layer, name, wrapped)
                patched.append((layer, name))
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    finally:
        for layer, name in patched:
            delattr(layer, name)
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    notes = [e for e in events if e.name.startswith("layer")]
    kernels = sorted((e for e in events if not e.name.startswith("layer")), key=lambda e: e.time_range.start)
    lines, per_layer = [], {}
    for k in kernels:
        owner = next((n.name for n in notes if n.time_range.start <= k.time_range.start <= n.time_range.end), "global")
        per_layer[owner] = per_layer.get(owner, 0) + 1
        lines.append(f"{owner:<28} {k.name[:110]}")
    head = [f"{n:4d} {owner}" for owner, n in per_layer.items()]
    return "\n".join(["# kernels per layer:"] + head + ["# in launch order:"] + lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--random-config", default="kimi-linear-48b-a3b", choices=sorted(RANDOM_CONFIGS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--decode-batch", type=int, nargs="*", default=[1, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--kernel-list", default=None, help="write the first decode batch's kernels in launch order, "
                   "by layer, to this file")
    p.add_argument("--quantization", "-q", choices=["fp8"], default=None, help="block-FP8 weights")
    args = p.parse_args()
    model = random_model(args.random_config, dtype=torch.bfloat16, device="cuda", layers=args.layers,
                         quantization=args.quantization)
    b_max = max(args.decode_batch or [1])
    runner = make_runner(model, b_max, args.context, prefill_tokens=args.prefill)
    T = args.prefill
    prompt = torch.randint(3, model.config.vocab_size, (T,)).tolist()
    table = list(range(-(-(T + 1) // 16)))
    run = lambda: runner.execute(StepPlan(token_ids=prompt, seq_lens=[T], context_lens=[0],  # noqa: E731
                                          block_tables=[table], state_slots=[0], logit_rows=[[T - 1]]))
    run()
    print(f"# {args.random_config}, {args.layers} layers: prefill of {T} tokens: {fl.kernel_profile(run, args.top)}")
    print(f"# prefill by torch op:\n{op_profile(run, args.top)}")
    print(f"# prefill on the host: {host_profile(run, args.top)}")
    print(f"# prefill in python: {python_profile(run, 2 * args.top)}")
    print(f"# prefill syncs: {sync_sites(run, args.top)}")
    print(f"# prefill idle: {gap_profile(run, top=args.top)}")
    pages = -(-(args.context + 1) // 16)
    for b in args.decode_batch:
        tables = [list(range(i * pages, (i + 1) * pages)) for i in range(b)]
        batch = ForwardBatch.build([1] * b, [args.context] * b, tables, list(range(b)), device=model.device)
        ids = torch.randint(3, model.config.vocab_size, (b,), device=model.device)

        def eager():
            batch._memo.clear()
            with torch.inference_mode():
                return model.compute_logits(model.forward_batch(ids, batch, runner.cache))
        eager()
        print(f"# decode batch {b}, context {args.context}: {fl.kernel_profile(eager, args.top)}")
        if args.kernel_list and b == args.decode_batch[0]:
            with open(args.kernel_list, "w") as f:
                f.write(kernel_sequence(model, eager) + "\n")


if __name__ == "__main__":
    main()
