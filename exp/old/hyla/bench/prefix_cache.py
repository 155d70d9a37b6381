"""`hyla bench prefix-cache`: hyla's hybrid prefix cache against vLLM align, SGLang and Marconi on
the same generated traces, and hyla's measured TTFT with and without the cache on the CPU.

    python -m hyla.bench prefix-cache              # full traces + TTFT (~20 s on 2 idle cores)
    python -m hyla.bench prefix-cache --quick      # CI-sized traces, no TTFT (a few seconds)

Part 1 simulates every policy on traces (a)-(d) of `cache_sim.traces` (one request at a time,
the same requests for every policy) at three cache sizes relative to the trace's working set
W = KV of every distinct token of the trace + one state checkpoint per request (W/16, W/4, W),
and unbounded (nothing evicted: the admission rules alone), all priced with the reference
model of `cache_sim.costs`. Per policy and size it prints the token hit rate (prompt tokens
served from the cache / prompt tokens) and the prefill tokens saved; "states/req" is how many
checkpoints the policy admits per request when nothing is evicted. Marconi's alpha is tuned as
Marconi does it: by replaying requests already seen (the first half of the trace) with each
alpha of a grid and keeping the best.

Part 2 runs hyla.LLM (the bundled model if present, else a tiny random checkpoint) over a
short version of trace (a), one request at a time, with and without enable_prefix_caching,
and reports the median time from add_request to the first token (LLMEngine.step loops).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from hyla.bench.cache_sim.costs import Costs, reference_costs
from hyla.bench.cache_sim.hyla_policy import HylaPolicy
from hyla.bench.cache_sim.marconi_policy import MarconiPolicy
from hyla.bench.cache_sim.radix import TokenTree
from hyla.bench.cache_sim.sglang_policy import SglangPolicy
from hyla.bench.cache_sim.traces import Trace, make_traces, shared_system_prompts
from hyla.bench.cache_sim.vllm_policy import VllmAlignPolicy

SIZES = (("W/16", 1 / 16), ("W/4", 1 / 4), ("W", 1.0), ("inf", None))  # inf: nothing is ever evicted
UNBOUNDED = 2**62
ALPHAS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
POLICY_NAMES = ("hyla", "vllm-align", "vllm-align+pmu64", "sglang", "marconi")


def make_policy(name: str, capacity: int, costs: Costs, alpha: float = 0.0, vllm_block_size: int | None = None):
    if name == "hyla":
        return HylaPolicy(capacity, costs)
    if name == "vllm-align":
        return VllmAlignPolicy(capacity, costs, block_size=vllm_block_size)
    if name == "vllm-align+pmu64":
        return VllmAlignPolicy(capacity, costs, block_size=vllm_block_size, match_unit=64)
    if name == "sglang":
        return SglangPolicy(capacity, costs)
    if name == "marconi":
        return MarconiPolicy(capacity, costs, alpha)
    raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")


def working_set(trace: Trace, costs: Costs) -> tuple[int, int]:
    """(W in bytes, distinct tokens): KV of every distinct fed token + one state per request."""
    tree = TokenTree()
    for r in trace.requests:
        tree.node_at((r.prompt + r.output)[:len(r.prompt) + len(r.output) - 1])
    return tree.kv_tokens * costs.kv_bytes_per_token + len(trace.requests) * costs.state_bytes, tree.kv_tokens


def replay(policy, requests) -> list[int]:
    return [policy.serve(r.prompt, r.output) for r in requests]


def tune_alpha(trace: Trace, capacity: int, costs: Costs) -> float:
    """Marconi's bootstrapping: replay the requests seen so far (the first half) with each alpha."""
    seen = trace.requests[:len(trace.requests) // 2]
    scores = {a: sum(replay(MarconiPolicy(capacity, costs, a), seen)) for a in ALPHAS}
    return max(ALPHAS, key=lambda a: (scores[a], -a))


def simulate(traces: list[Trace], costs: Costs, policies=POLICY_NAMES, sizes=SIZES,
             vllm_block_size: int | None = None) -> dict:
    results = {}
    for trace in traces:
        w, distinct = working_set(trace, costs)
        prompt_tokens = sum(len(r.prompt) for r in trace.requests)
        entry = {"title": trace.title, "requests": len(trace.requests), "prompt_tokens": prompt_tokens,
                 "distinct_tokens": distinct, "working_set_bytes": w,
                 "sizes": {label: int(w * frac) if frac else UNBOUNDED for label, frac in sizes},
                 "marconi_alpha": {}, "policies": {}}
        for name in policies:
            row = entry["policies"][name] = {}
            for label, capacity in entry["sizes"].items():
                alpha = 0.0
                if name == "marconi" and capacity < UNBOUNDED:
                    alpha = entry["marconi_alpha"][label] = tune_alpha(trace, capacity, costs)
                policy = make_policy(name, capacity, costs, alpha, vllm_block_size)
                hits = replay(policy, trace.requests)
                row[label] = {"hit_tokens": sum(hits), "hit_rate": sum(hits) / prompt_tokens,
                              "states_per_request": policy.stats["states_admitted"] / len(trace.requests),
                              "per_request": hits}
        results[trace.key] = entry
    return results


def goal_check(results: dict) -> dict:
    """hyla >= every other policy everywhere, and >= 3x vllm-align on (a)."""
    misses = []
    for key, entry in results.items():
        pols = entry["policies"]
        if "hyla" not in pols:
            continue
        for label in entry["sizes"]:
            mine = pols["hyla"][label]["hit_rate"]
            for name, row in pols.items():
                if name != "hyla" and row[label]["hit_rate"] > mine:
                    misses.append({"trace": key, "size": label, "policy": name, "hyla": mine,
                                   "other": row[label]["hit_rate"],
                                   "tokens": pols["hyla"][label]["hit_tokens"] - row[label]["hit_tokens"]})
    ratio = {}
    if "a" in results and {"hyla", "vllm-align"} <= set(results["a"]["policies"]):
        pols = results["a"]["policies"]
        for label in results["a"]["sizes"]:
            v = pols["vllm-align"][label]["hit_tokens"]
            ratio[label] = pols["hyla"][label]["hit_tokens"] / v if v else float("inf")
    return {"hyla_ge_all": not misses, "misses": misses, "a_hyla_over_vllm_align": ratio,
            "a_at_least_3x_vllm_align": bool(ratio) and all(v >= 3 for v in ratio.values())}


def _size(label: str, nbytes: int) -> str:
    return "unbounded" if label == "inf" else f"{label} = {nbytes / 2**30:.2f} GiB"


def print_tables(results: dict) -> None:
    for key, entry in results.items():
        gib = entry["working_set_bytes"] / 2**30
        print(f"\n({key}) {entry['title']}")
        print(f"    {entry['requests']} requests, {entry['prompt_tokens']:,} prompt tokens; W = {gib:.2f} GiB "
              f"(KV of {entry['distinct_tokens']:,} distinct tokens + one state per request)")
        head = "".join(f"  {_size(label, b):>22}" for label, b in entry["sizes"].items())
        print(f"{'':18}{head}")
        print(f"{'policy':18}" + "".join(f"  {'hit rate':>9} {'saved':>12}" for _ in entry["sizes"]) + "   states/req")
        for name, row in entry["policies"].items():
            cells = "".join(f"  {c['hit_rate']:>9.1%} {c['hit_tokens']:>12,}" for c in row.values())
            states = row[list(entry["sizes"])[-1]]["states_per_request"]
            print(f"{name:18}{cells}   {states:>10.2f}")
        if entry["marconi_alpha"]:
            print("    marconi alpha (tuned on the first half): "
                  + ", ".join(f"{k} {v:g}" for k, v in entry["marconi_alpha"].items()))
    goal = goal_check(results)
    if goal["a_hyla_over_vllm_align"]:
        print("\n(a) hyla / vllm-align prefill tokens saved (goal >= 3x): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in goal["a_hyla_over_vllm_align"].items()))
    if goal["misses"]:
        print("hyla below another policy (trace, size, policy, hyla vs other):")
        for m in goal["misses"]:
            print(f"    ({m['trace']}) {m['size']:5} {m['policy']:17} {m['hyla']:6.1%} vs {m['other']:6.1%} "
                  f"({(m['hyla'] - m['other']) * 100:+.2f} pp, {m['tokens']:+,} tokens)")
    else:
        print("hyla >= every other policy on every trace at every size")


# ---- TTFT on the CPU ------------------------------------------------------------------------------

def _tiny_random_model(root: str) -> str:
    """A small random Kimi-Linear checkpoint written with hyla's own classes (official names)."""
    import torch
    from safetensors.torch import save_file

    from hyla.models import KimiLinearConfig, KimiLinearForCausalLM

    config = {
        "model_type": "kimi_linear", "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 4, "first_k_dense_replace": 4, "num_attention_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "eos_token_id": 0,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 2, "head_dim": 64,
                               "short_conv_kernel_size": 4},
    }
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig.from_hf_dict(config))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    path = Path(root) / "tiny-kimi"
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def default_model(tmp: str) -> str:
    try:
        from hyla.models import default_model_path

        path = default_model_path()
        if path and (Path(path) / "config.json").is_file():
            return str(path)
    except ImportError:
        pass
    bundled = Path(__file__).resolve().parents[1] / "assets" / "default_model"
    if (bundled / "config.json").is_file():
        return str(bundled)
    return _tiny_random_model(tmp)


def _time_to_first_token(engine, rid: str, prompt: list[int], params) -> tuple[float, int]:
    """(ms from add_request to the first step() that returns a token for rid, prompt tokens the
    cache served); the request then runs to its end, alone."""
    before = engine.get_metrics()["prefix_cache_hit_tokens"]
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if ttft is None and o.request_id == rid and o.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
    return ttft * 1e3, engine.get_metrics()["prefix_cache_hit_tokens"] - before


def measure_ttft(model: str, n_requests: int = 16, n_systems: int = 2, system_len=(400, 1000),
                 question_len=(16, 64), seed: int = 0, repeat: int = 3) -> dict:
    """TTFT of hyla.LLM over a short trace (a), one request at a time, with and without the prefix
    cache. The two engines take turns request by request, so that load from other processes on a
    shared machine hits both alike; the trace is served `repeat` times (the cached engine starts
    empty each time) and each request keeps its fastest time."""
    from hyla import LLM, SamplingParams
    from hyla.models import KimiLinearConfig

    vocab = KimiLinearConfig.from_file(Path(model) / "config.json").vocab_size
    trace = shared_system_prompts(lambda prompt: (), n_requests, n_systems, system_len, question_len, seed, vocab)
    prompts = [list(r.prompt) for r in trace.requests]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def engine(caching: bool):
        llm = LLM(model, enable_prefix_caching=caching, max_model_len=2048)
        llm.generate([[7 + i for i in range(24)]], params, use_tqdm=False)  # warm-up, not timed
        return llm.engine

    off = engine(False)
    runs = {"off": [], "on": []}
    for r in range(repeat):
        engines = {"off": off, "on": engine(True)}
        for mode, e in engines.items():
            runs[mode].append([])
        for i, prompt in enumerate(prompts):
            for mode, e in engines.items():
                runs[mode][-1].append(_time_to_first_token(e, f"ttft-{r}-{i}", prompt, params))
    out = {"model": model, "requests": n_requests, "prompt_tokens": sum(map(len, prompts)), "repeat": repeat,
           "title": f"{n_requests} requests over {n_systems} system prompts of {system_len[0]}-{system_len[1]} tokens"}
    for mode, passes in runs.items():
        ttfts = [min(p[i][0] for p in passes) for i in range(n_requests)]
        out[mode] = {"ttft_ms": ttfts, "median_ms": statistics.median(ttfts), "mean_ms": statistics.mean(ttfts),
                     "hit_tokens": sum(h for _, h in passes[0])}
    out["speedup_median"] = out["off"]["median_ms"] / out["on"]["median_ms"]
    return out


def print_ttft(t: dict) -> None:
    model = os.path.relpath(t["model"])
    model = t["model"] if model.startswith("..") else model
    print(f"\nTTFT on the CPU: hyla.LLM({model}), short trace (a): {t['title']}, one request at a time, "
          f"best of {t['repeat']} per request")
    print(f"{'':14}{'median TTFT':>13}{'mean TTFT':>12}{'prompt tokens from cache':>28}")
    for mode in ("off", "on"):
        m = t[mode]
        share = m["hit_tokens"] / t["prompt_tokens"]
        print(f"{'cache ' + mode:14}{m['median_ms']:>10.0f} ms{m['mean_ms']:>9.0f} ms"
              f"{m['hit_tokens']:>17,} ({share:5.1%})")
    print(f"median TTFT speed-up with the cache: {t['speedup_median']:.2f}x")


# ---- entry point ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="hyla bench prefix-cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized traces; skips the TTFT run unless --ttft")
    p.add_argument("--ttft", action=argparse.BooleanOptionalAction, default=None,
                   help="measure TTFT with / without the cache on the CPU (default: on, off with --quick)")
    p.add_argument("--model", default=None, help="checkpoint for the TTFT run (default: the bundled model)")
    p.add_argument("--traces", default="abcd", help="which traces to run, e.g. 'ac'")
    p.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), choices=POLICY_NAMES)
    p.add_argument("--vllm-block-size", type=int, default=None,
                   help="override vLLM's attention block size (default: the page-unification rule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    import torch

    costs = reference_costs()
    print(f"# hyla bench prefix-cache{' --quick' if args.quick else ''}  "
          f"{datetime.date.today()}  python {platform.python_version()}  torch {torch.__version__}  "
          f"{os.cpu_count()} CPUs ({platform.machine()})")
    for line in costs.describe():
        print(f"# {line}")
    t0 = time.perf_counter()
    traces = make_traces(quick=args.quick, seed=args.seed, keys=args.traces)
    results = simulate(traces, costs, args.policies, vllm_block_size=args.vllm_block_size)
    print_tables(results)
    print(f"# simulation: {time.perf_counter() - t0:.1f} s")
    report = {"reference": costs.__dict__, "traces": results, "goal": goal_check(results), "ttft": None}
    if args.ttft if args.ttft is not None else not args.quick:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            report["ttft"] = measure_ttft(args.model or default_model(tmp), seed=args.seed)
            print_ttft(report["ttft"])
            print(f"# TTFT run: {time.perf_counter() - t0:.1f} s, torch threads {torch.get_num_threads()}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=float))
    return report


if __name__ == "__main__":
    main()
