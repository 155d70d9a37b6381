"""Speculative decoding benchmark: decode tokens/s with and without speculation.

    python -m hyla.bench spec [--model PATH] [--k 2 4 8] [--max-tokens 128] [--repeats 5] [--profile]

Two prompt sets: repetitive code completion (prompt lookup finds long matches) and free text.
For each: greedy decode without speculation, then with n-gram speculation at each k and both
rollback modes, each prompt alone in turn (batch 1: per-request decode speed, how speculative
speed-ups are usually quoted) and the set at once (a batch keeps stepping until its slowest
request is done); prints tokens/s (prefill included) and its speed-up over no speculation, decode
tokens/s (after every request of a group has its first token: the prefill excluded) and its
speed-up, the mean accepted length and the state memory one request needs (slots: 1 + k full states; replay: one state + the per-token
inputs of the verify window). With --repeats R every configuration runs R rounds, interleaved
(round 1 of each, then round 2 of each, ...), and the medians are printed: a host whose speed
drifts during the run moves a configuration and its baseline together.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import time
from statistics import median

import torch

REPETITIVE = [
    "def test_add(self):\n    self.assertEqual(add(1, 2), 3)\n\n"
    "def test_sub(self):\n    self.assertEqual(sub(3, 2), 1)\n\n"
    "def test_mul(self):\n    self.assertEqual(mul(2, 3), 6)\n\ndef test_div(self):",
    "ITEMS = [\n    ('alpha', 1),\n    ('beta', 2),\n    ('gamma', 3),\n    ('delta', 4),\n    ('epsilon', 5),\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "class Size:\n    def __init__(self, width, height):",
]
FREE = [
    '"""Utilities for reading configuration files.\n\nThe parser accepts',
    "# Copyright notice and license terms follow. This module implements",
    'def main():\n    """Run the command line interface and report',
]


def replay_bytes_per_token(model) -> int:
    """Per verify-window token, what replay keeps per linear-attention layer: k, v (model dtype),
    the decay (fp32, per channel for KDA, per head for Gated DeltaNet), beta (fp32 per head) and
    the pre-conv inputs (model dtype)."""
    c = model.config
    item = torch.finfo(model.dtype).bits // 8
    if c.layer_sizes().linear_kind == "GDN":
        heads = c.linear_num_value_heads
        k_dim, v_dim = c.linear_num_key_heads * c.linear_key_head_dim, heads * c.linear_value_head_dim
        per_layer = (k_dim + v_dim) * item + 2 * heads * 4 + c.conv_dim * item
    else:  # KDA: q, k, v of H x K each
        heads, d = c.linear_num_heads, c.linear_num_heads * c.linear_head_dim
        per_layer = 2 * d * item + d * 4 + heads * 4 + 3 * d * item
    n_linear = sum(1 for t in c.layer_types if t == "linear_attention")
    return per_layer * n_linear


def _release_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _step_kind(args, kwargs, result) -> str:
    """StepProfile's key of a ModelRunner.execute call: a plain step, MTP's fused greedy step
    (verify + head in one graph: a graph extension), a verify in a CUDA graph or eager."""
    if not args[0].is_verify:
        return "plain step"
    if kwargs.get("extension") is not None:
        return "verify (fused graph)"
    return "verify (graph)" if result.in_graph else "verify (eager)"


class StepProfile:
    """Wall time (device-synchronised) of an engine's calls, by kind: plain steps (prefill /
    decode, graph or eager), the whole engine step, and the parts of a speculative step: the
    drafter's propose, the verify forward (in a CUDA graph or eager), the acceptance rule (what
    SpecDecoder.step spends besides the two), the commit (the drafter's bookkeeping, picking the
    slot or the replay) and the engine's own bookkeeping (emitting tokens, stop checks, trimming
    pages: the rest of the speculative step) -- where a speculative step's time goes. With MTP
    head-step graphs, `propose: chained drafts` is the part of propose after the catch-up on the
    greedy fast path (hyla.engine.spec.mtp.drafter, HeadStepGraphs.run_chain); `verify (fused graph)` is MTP's
    fused greedy step (hyla.engine.spec.mtp.fused: the verify, the acceptance, the head's catch-up and
    the next drafts in one graph), after which propose has nothing left to run."""

    def __init__(self, llm):
        self.times: dict[str, list[float]] = {}
        self._wrapped: list[tuple[object, str]] = []
        engine = llm.engine
        self._wrap(engine.runner, "execute", _step_kind)
        self._wrap(engine, "step", "engine step (all)")
        if engine.spec is not None:
            self._wrap(engine, "_spec_step", "spec step (all)")
            self._wrap(engine.spec, "step", "spec: draft+verify+accept")
            self._wrap(engine.spec.drafter, "propose", "propose")
            self._wrap(engine.spec, "commit", "commit")
            graphs = getattr(engine.spec.drafter, "step_graphs", None)  # MTP's head steps in CUDA graphs
            if graphs is not None:
                self._wrap(graphs, "run_chain", "propose: chained drafts")

    def _wrap(self, obj, name, label):
        """Time obj.<name>; label: the key, or a function of (args, kwargs, result) giving it."""
        inner = getattr(obj, name)

        def timed(*a, **k):
            _sync()
            t = time.perf_counter()
            out = inner(*a, **k)
            _sync()
            key = label(a, k, out) if callable(label) else label
            self.times.setdefault(key, []).append(time.perf_counter() - t)
            return out
        setattr(obj, name, timed)
        self._wrapped.append((obj, name))

    def unwrap(self) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)  # the instance attribute shadowed the method

    def total(self, key: str) -> float:
        return sum(self.times.get(key, []))

    def split(self) -> dict[str, float]:
        """A speculative step's mean host time (seconds) by part: propose, verify, accept, commit
        and bookkeeping (the last two of `spec step (all)` besides SpecDecoder.step); {} when no
        speculative step ran."""
        steps = len(self.times.get("spec step (all)", []))
        if not steps:
            return {}
        verify = self.total("verify (graph)") + self.total("verify (eager)") + self.total("verify (fused graph)")
        inner = self.total("spec: draft+verify+accept")
        parts = {"propose": self.total("propose"), "verify": verify,
                 "accept": inner - self.total("propose") - verify, "commit": self.total("commit")}
        parts["bookkeeping"] = self.total("spec step (all)") - inner - parts["commit"]
        return {key: t / steps for key, t in parts.items()}

    def report(self) -> str:
        lines = []
        for key, ts in sorted(self.times.items()):
            lines.append(f"    {key:<26} {len(ts):>6} calls  {1e3 * sum(ts) / len(ts):8.3f} ms mean  "
                         f"{sum(ts):7.3f} s total")
        split = self.split()
        if split:
            lines.append("    per speculative step: " + "  ".join(f"{key} {1e3 * t:.3f} ms" for key, t in split.items())
                         + f"  (sum {1e3 * sum(split.values()):.3f} ms)")
        return "\n".join(lines)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


_REQUEST_IDS = itertools.count()


def _decode_group(engine, group, params) -> tuple[int, float, float]:
    """Decode one group of prompts at once on the engine -> (tokens emitted, seconds from adding
    the requests to the last output, seconds after every request had its first token: the
    decode phase, prefill excluded)."""
    ids = [f"bench-spec-{next(_REQUEST_IDS)}" for _ in group]
    start = time.perf_counter()
    for rid, prompt in zip(ids, group):
        engine.add_request(rid, prompt, params)
    counts: dict[str, int] = {}
    decoding_from = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if decoding_from is None and len([r for r in ids if counts.get(r)]) == len(ids):
            decoding_from = time.perf_counter()
    end = time.perf_counter()
    return sum(counts.get(r, 0) for r in ids), end - start, end - (decoding_from or end)


def _measure(llm, prompts, params, together: bool) -> tuple[float, float, float]:
    """Decode the prompt set (all at once, or each prompt alone in turn) -> (tokens/s, mean
    accepted length over the verify steps of this run, 1.0 without speculation; decode tokens/s:
    the tokens after each request's first over the time after every request of its group had
    one, i.e. without the prefill, which speculation does not change)."""
    before = dict(llm.get_metrics())
    elapsed = decode_time = 0.0
    tokens = decode_tokens = 0
    for group in ([prompts] if together else [[p] for p in prompts]):
        n, total, decoding = _decode_group(llm.engine, group, params)
        tokens, elapsed = tokens + n, elapsed + total
        decode_tokens, decode_time = decode_tokens + n - len(group), decode_time + decoding
    after = llm.get_metrics()
    steps = after.get("spec_num_verify_steps", 0) - before.get("spec_num_verify_steps", 0)
    accepted = after.get("spec_num_accepted_tokens", 0) - before.get("spec_num_accepted_tokens", 0)
    return (tokens / elapsed, (1.0 + accepted / steps) if steps else 1.0,
            decode_tokens / decode_time if decode_time > 0 else 0.0)


def _label(cfg: dict | None) -> str:
    return "off" if cfg is None else f"{cfg['method']} k={cfg['num_speculative_tokens']} {cfg['rollback']}"


def main(argv: list[str] | None = None) -> list[dict]:
    from hyla import LLM, SamplingParams
    from hyla.models.hub import resolve_model

    p = argparse.ArgumentParser(prog="hyla bench spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default=None)
    p.add_argument("--profile", action="store_true", help="print where each configuration's step time goes")
    p.add_argument("--memory-budget", type=int, default=1 << 30, help="bytes of KV pages + state slots per engine")
    p.add_argument("--method", nargs="+", choices=["ngram", "mtp"], default=["ngram"],
                   help="drafters to time (mtp: the checkpoint's own MTP head, e.g. --model mtp)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds over every configuration, interleaved (every engine kept alive); the "
                        "medians are printed, speed-ups per round against that round's baseline")
    p.add_argument("--rollback", nargs="+", choices=["slots", "replay"], default=["slots", "replay"])
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    model = resolve_model(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    # Prefix caching off for every engine, so only speculation differs; a modest KV / state
    # budget so that the engines built one after another fit on one device.
    opts = dict(device=args.device, enable_prefix_caching=False, memory_budget=args.memory_budget)
    base = LLM(model, **opts)
    slot = base.engine.model.state_bytes_per_slot()
    per_tok = replay_bytes_per_token(base.engine.model)
    modes = (("alone", False), ("together", True))
    print(f"# {model}, device {base.engine.model.device}, greedy, {args.max_tokens} new tokens per request; "
          f"'alone': each prompt decoded by itself in turn (batch 1), 'together': the set at once")
    print(f"{'prompts':<11} {'requests':<9} {'spec':<20} {'tok/s':>8} {'speed-up':>9} {'decode tok/s':>13} "
          f"{'decode x':>9} {'mean acc':>9} {'state KiB/req':>14}")
    configs = [None] + [{"method": method, "num_speculative_tokens": k, "rollback": rb}
                        for method in args.method for k in args.k for rb in args.rollback]
    keep = args.repeats > 1  # every engine stays alive, so that the rounds interleave configurations
    engines = {}
    for name, prompts in (("repetitive", REPETITIVE), ("free text", FREE)):
        runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {}  # (label, mode) -> per round
        for _round in range(args.repeats):
            for cfg in configs:
                label = _label(cfg)
                llm = base if cfg is None else engines.get(label) or LLM(model, speculative_config=cfg, **opts)
                for mode, together in modes:
                    if _round == 0:
                        _measure(llm, prompts, params, together)  # warm-up: captures every CUDA graph bucket it needs
                    prof = StepProfile(llm) if args.profile else None
                    runs.setdefault((label, mode), []).append(_measure(llm, prompts, params, together))
                    if prof:
                        print(f"  {name}, {mode}, {label}, round {_round}:\n{prof.report()}")
                        prof.unwrap()
                if cfg is not None and keep:
                    engines[label] = llm
                elif cfg is not None:
                    del llm
                    _release_device_memory()
        for cfg in configs:
            label = _label(cfg)
            k = 0 if cfg is None else cfg["num_speculative_tokens"]
            mem = slot if cfg is None else ((1 + k) * slot if cfg["rollback"] == "slots" else slot + (1 + k) * per_tok)
            for mode, _ in modes:
                mine, off = runs[(label, mode)], runs[("off", mode)]
                # speed-ups per round against the same round's baseline (run next to it), then the median
                speedup = [r[0] / b[0] for r, b in zip(mine, off)]
                decode_x = [r[2] / b[2] if b[2] else 0.0 for r, b in zip(mine, off)]
                rows.append({"prompts": name, "requests": mode, "spec": label,
                             "tok_s": median([r[0] for r in mine]), "speedup": median(speedup),
                             "decode_tok_s": median([r[2] for r in mine]), "decode_speedup": median(decode_x),
                             "decode_speedup_range": (min(decode_x), max(decode_x)),
                             "mean_acc": median([r[1] for r in mine]), "state_bytes": mem})
        for mode, _ in modes:
            for r in rows:
                if r["prompts"] == name and r["requests"] == mode:
                    lo, hi = r["decode_speedup_range"]
                    spread = f"  ({lo:.2f}-{hi:.2f}x over {args.repeats} rounds)" if args.repeats > 1 else ""
                    print(f"{r['prompts']:<11} {r['requests']:<9} {r['spec']:<20} {r['tok_s']:>8.1f} "
                          f"{r['speedup']:>8.2f}x {r['decode_tok_s']:>13.1f} {r['decode_speedup']:>8.2f}x "
                          f"{r['mean_acc']:>9.2f} {r['state_bytes'] / 1024:>14.1f}{spread}")
    return rows


if __name__ == "__main__":
    main()
