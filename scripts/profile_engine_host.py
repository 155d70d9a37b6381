"""Where an engine step's host time goes, plain decoding vs MTP speculation, without added syncs.

    python scripts/profile_engine_host.py --model qwen3.5-mtp --k 2 3 --tokens 128 [--cprofile 30]

Configurations: plain decoding (steps overlapped), "sync" (plain with async_scheduling off),
"eager" (plain without CUDA graphs: what a step costs when its graph is not replayed), "3 sizes"
(plain with decode graphs for batch 1, 2, 4 only: a few dozen graphs captured, not ~1000),
"no timer" (plain without the device timer's events around each execute), MTP at each k. For each: decode one free-text prompt once (graph capture), then again with only
perf_counter around engine.step (each step ends at its own readback, so no sync is added): the
prefill step, the mean later step, tokens/s with and without the prefill. With --cprofile N, a
third decode under cProfile prints the N functions with the most own time (host hot spots).
With --sections, a decode with perf_counter around the engine's host-side stages (SECTIONS)
prints each one's inclusive time per engine step: wall time without cProfile's inflation.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import pstats
import time

from hyla import LLM, SamplingParams
from hyla.bench.spec import FREE
from hyla.models.hub import resolve_model


def _timed_decode(llm: LLM, prompt: str, params: SamplingParams) -> dict:
    engine = llm.engine
    inner, times = engine.step, []

    def timed(*a, **kw):
        t = time.perf_counter()
        out = inner(*a, **kw)
        times.append(time.perf_counter() - t)
        return out

    engine.step = timed
    start = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)
    total = time.perf_counter() - start
    del engine.step
    n = len(out[0].outputs[0].token_ids)
    later = times[1:]
    return {"tokens": n, "steps": len(times), "total_ms": 1e3 * total, "first_ms": 1e3 * times[0],
            "step_ms": 1e3 * sum(later) / max(1, len(later)), "outside_ms": 1e3 * (total - sum(times)),
            "tok_s": n / total, "decode_tok_s": (n - 1) / max(1e-9, sum(later))}


def _hot_spots(llm: LLM, prompt: str, params: SamplingParams, top: int, key: str = "tottime") -> str:
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params, use_tqdm=False)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
    return buf.getvalue()


SECTIONS = [  # "module:owner.attr" of the host-side stages of a step (inclusive times)
    "hyla.engine.llm_engine:LLMEngine.step",
    "hyla.engine.scheduler:Scheduler.schedule",
    "hyla.engine.spec.mtp.overlap:OverlapChain.launch_after",
    "hyla.engine.spec.mtp.fused:FusedVerify.collect",
    "hyla.engine.spec.decoder:SpecDecoder._verify_extended",
    "hyla.engine.spec.mtp.fused:DerivedExtension.fill",
    "hyla.engine.spec.mtp.fused:_Extension.fill",
    "hyla.engine.spec.mtp.fused:DeriveGraphs.run",
    "hyla.engine.spec.mtp.fused:fill_long",
    "hyla.engine.spec.mtp.fused:FusedVerify.extension",
    "hyla.engine.spec.mtp.fused:Flight.__init__",
    "hyla.engine.cuda_graph_verify:CUDAGraphRunner.replay_verify",
    "hyla.engine.cuda_graph_verify:CUDAGraphRunner.verify_rows",
    "hyla.engine.cuda_graph_verify:CUDAGraphRunner.replay_commit",
    "hyla.engine.cuda_graph:DecodeGraphs.run_decode",
    "hyla.engine.cuda_graph:DecodeGraphs.run_fed",
    "hyla.engine.cuda_graph:DecodeGraphs.prepare",
    "hyla.engine.cuda_graph:_MetaStage.fill",
    "hyla.engine.overlap:DecodeOverlap.launch",
    "hyla.engine.sampler:PendingSample.__init__",
    "hyla.engine.sampler:PendingSample.result",
    "hyla.engine.llm_engine:LLMEngine._emit",
    "hyla.engine.model_runner:ModelRunner.execute",
    "hyla.engine.sampler:sample",
    "hyla.engine.llm_engine:sample",
    "hyla.engine.llm_engine:LLMEngine._emit_verified",
    "hyla.engine.llm_engine:LLMEngine.append_tokens",
    "hyla.engine.spec.decoder:SpecDecoder.step",
    "hyla.engine.spec.decoder:SpecDecoder.commit",
    "hyla.engine.sequence:Sequence.check_stop",
    "hyla.engine.sequence:Sequence.to_output",
]


def _sections(llm: LLM, prompt: str, params: SamplingParams) -> str:
    """Inclusive wall time per engine step of each stage in SECTIONS that exists (wrapped with
    perf_counter for one decode, then unwrapped)."""
    spent: dict[str, list] = {}
    undo = []
    for spec in SECTIONS:
        module, path = spec.split(":")
        owner = importlib.import_module(module)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name, None)
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:
            continue
        acc = spent.setdefault(path, [0.0, 0])

        def wrapped(*a, _fn=fn, _acc=acc, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                _acc[0] += time.perf_counter() - t
                _acc[1] += 1
        setattr(owner, attr, wrapped)
        undo.append((owner, attr, fn))
    try:
        llm.generate([prompt], params, use_tqdm=False)
    finally:
        for owner, attr, fn in reversed(undo):
            setattr(owner, attr, fn)
    steps = max(1, spent.get("LLMEngine.step", [0, 1])[1])
    lines = [f"{'stage':<36} {'us/step':>8} {'calls/step':>10}"]
    for path, (total, calls) in spent.items():
        if calls:
            lines.append(f"{path:<36} {1e6 * total / steps:>8.1f} {calls / steps:>10.2f}")
    return "\n".join(lines)


def _replay_ms(llm: LLM, reps: int = 200) -> dict[str, float]:
    """Mean GPU time (ms) of one replay of each batch-1 graph the engine captured (decode,
    verify), replayed back to back: what a step costs when the host never waits on it. The
    states they write are garbage afterwards: the engine is discarded after this."""
    import torch

    graphs = llm.engine.runner.graphs
    found = {f"decode {key}": g for key, (g, _) in graphs.graphs.items() if key[0] == 1 and g is not None}
    found.update({f"verify {key}": v[0] for key, v in graphs.verify_graphs.items() if key[0] == 1 and v[0] is not None})
    out = {}
    for name, graph in found.items():
        graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        out[name] = 1e3 * (time.perf_counter() - t) / reps
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-mtp")
    p.add_argument("--k", type=int, nargs="+", default=[2, 3])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--cprofile", type=int, default=0, help="print the N functions with most own time")
    p.add_argument("--sections", action="store_true", help="time the host-side stages of a step")
    p.add_argument("--replay", action="store_true", help="time the batch-1 graphs replayed back to back")
    p.add_argument("--prefill", type=int, default=0,
                   help="print the N functions with most cumulative time of a prefill (max_tokens=1)")
    args = p.parse_args(argv)
    model = resolve_model(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    opts = dict(device=args.device, enable_prefix_caching=False, memory_budget=1 << 30)
    # (label, speculative_config, engine options): "sync" reads each step's draws before the
    # next step is queued; "eager" and "3 sizes" tell a graph that is not replayed, or a cost
    # of many captured graphs, from host work
    configs = [("plain", None, {}), ("sync", None, {"async_scheduling": False}),
               ("eager", None, {"enforce_eager": True}), ("3 sizes", None, {"cuda_graph_sizes": [1, 2, 4]}),
               ("no timer", None, {})]
    configs += [(f"mtp k={k}", {"method": "mtp", "num_speculative_tokens": k, "rollback": "slots"}, {})
                for k in args.k]
    rows = []
    for label, spec, extra in configs:
        llm = LLM(model, speculative_config=spec, **opts, **extra)
        if label == "no timer":
            llm.engine.runner.execute_time.measure = contextlib.nullcontext
        graphs = llm.engine.runner.graphs
        print(f"## {label}: {len(graphs.graphs) if graphs is not None else 0} decode graphs at startup")
        for prompt in FREE:
            llm.generate([prompt], params, use_tqdm=False)  # warm-up: every graph bucket
        stats = [_timed_decode(llm, prompt, params) for prompt in FREE]
        rows.append((label, {key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}))
        for flight in (llm.engine.chain, llm.engine.overlap):  # MTP's chain, plain decode's overlap
            if flight is not None:
                print(f"## {label}: {flight.launched} steps launched in flight ({type(flight).__name__})")
        if args.cprofile:
            print(f"## {label}\n" + _hot_spots(llm, FREE[0], params, args.cprofile))
        if args.sections:
            print(f"## {label}: host stages\n" + _sections(llm, FREE[0], params))
        if args.replay and graphs is not None:  # (eager: no graphs)
            for name, ms in _replay_ms(llm).items():
                print(f"## {label}: graph {name}: {ms:.3f} ms per replay")
        if args.prefill:
            one = SamplingParams(temperature=0.0, max_tokens=1)
            print(f"## {label}: prefill\n" + _hot_spots(llm, FREE[0], one, args.prefill, "cumulative"))
        del llm
    print(f"{'config':<9} {'steps':>6} {'prefill ms':>11} {'step ms':>8} {'outside ms':>11} "
          f"{'tok/s':>8} {'decode tok/s':>13}")
    for label, r in rows:
        print(f"{label:<9} {r['steps']:>6.1f} {r['first_ms']:>11.3f} {r['step_ms']:>8.3f} {r['outside_ms']:>11.3f} "
              f"{r['tok_s']:>8.1f} {r['decode_tok_s']:>13.1f}")


if __name__ == "__main__":
    main()
