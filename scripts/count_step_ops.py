"""How many ops one engine step dispatches, plain decoding vs MTP's fused greedy step, on the CPU.

    python scripts/count_step_ops.py [--model qwen3.5-mtp] [--k 3] [--tokens 24] [--by-op [--sites]] [--aten]
                                     [--strided]
                                     [--host [--profile]]

A proxy for the kernels a CUDA graph of the step replays on the GPU (where a step of a tiny model
is bound by kernel count): every aten op the step dispatches is counted (a TorchDispatchMode),
except pure view / metadata ops (no kernel). By default each call of a fused hyla.ops.dispatch op
(the norms, gates, short convs, recurrences and the gated attention's two ops: one Triton launch
each on CUDA) counts as ONE op, the aten ops it runs on the CPU not counted; --aten counts those
too. The attention layers take their GPU route (hyla.ops.dispatch.gated_attention_kernels).

Both engines run with a CUDAGraphRunner whose capture is off (as tests/engine/test_mtp_fused.py
builds them): the decode graph's and the fused verify graph's functions run eagerly on the CPU,
which is exactly what a capture records. The step reported is a steady-state one (the most common
count among decode steps; for MTP among fused steps whose drafts came prefetched), split into
parts: the verify forward, the acceptance, the head's catch-up over the verify rows (with its
lm_head and argmax: the first next draft), each chained draft step, and what runs outside the
graph (input buffers, readbacks). Also `count_step(engine)`: the same counts for tests.

--host: the host time of a decode step (scheduling, input buffers, acceptance, bookkeeping,
outputs): engine.step's wall time with the graph's function replaced by its earlier outputs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import traceback
from contextlib import ExitStack, contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch nothing: views, aliases, metadata
_VIEWS = {"view", "_unsafe_view", "t", "expand", "as_strided", "detach", "slice", "select", "unsqueeze",
          "squeeze", "permute", "transpose", "alias", "split", "split_with_sizes", "chunk", "unbind", "unflatten",
          "view_as", "reshape", "flatten", "_reshape_alias", "lift_fresh", "diagonal", "narrow", "expand_as",
          "unfold", "sym_size", "sym_stride", "sym_numel", "dim", "is_same_size",
          "_to_copy_noop", "real", "conj", "resolve_conj", "resolve_neg", "_neg_view", "_conj"}

# hyla.ops.dispatch ops that are one Triton launch each on CUDA
FUSED = ("rms_norm_rounded", "rms_norm_zero_centred", "add_rms_norm", "gated_rms_norm", "silu_gated_rms_norm",
         "kda_gate_beta", "gdn_gate_beta", "causal_conv1d_update", "causal_conv1d_update_packed",
         "causal_conv1d_verify", "fused_recurrent_kda", "fused_recurrent_gated_delta_rule",
         "qk_norm_rope_write", "paged_window_attention", "mtp_fc_input", "silu_mul")


# elementwise ops: on CUDA one TensorIterator kernel, vectorised only over contiguous operands
# of the output's shape (what --strided looks for: the others run the slower strided kernel)
ELEMENTWISE = {"add", "sub", "mul", "div", "where", "masked_fill", "sigmoid", "silu", "exp", "neg", "copy_",
               "_to_copy", "clone", "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or", "bitwise_not",
               "logical_and", "logical_not", "abs", "pow", "rsqrt", "sqrt", "cos", "sin", "add_", "mul_", "fill_"}
STRIDED_ONLY = False  # set by --strided


def _strided(args, out) -> bool:
    """Whether an elementwise op has an operand that is not a contiguous tensor of the output's shape."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    shape = next((o.shape for o in outs if isinstance(o, torch.Tensor)), None)
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.numel() > 1] + [
        o for o in outs if isinstance(o, torch.Tensor)]
    return any(not t.is_contiguous() or t.shape != shape for t in tensors)


def _name(func) -> str:
    return func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)


def _site() -> str:
    """file:line of the innermost hyla frame calling the op (hyla/ops excluded: who called it)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace(os.sep, "/")
        if "/hyla/" in path and "/hyla/ops/" not in path:
            return f"{path.rsplit('/hyla/', 1)[1]}:{frame.lineno}"
    return "?"


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops per part (`part`, set by the wrappers of `count_step`) and op name."""

    def __init__(self, aten: bool = False, sites: bool = False):
        super().__init__()
        self.aten, self.sites = aten, sites
        self.part = "outside graph"
        self.fused_depth = 0
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _name(func)
        out = func(*args, **(kwargs or {}))
        # an op that returns one of its inputs untouched (`to` / `contiguous` with nothing to do)
        # launches nothing; in-place ops (name_) return their input and do launch
        noop = not name.endswith("_") and any(out is a for a in args if isinstance(a, torch.Tensor))
        if STRIDED_ONLY and (name not in ELEMENTWISE or not _strided(args, out)):
            return out
        if name not in _VIEWS and not noop and (self.aten or not self.fused_depth):
            self.counts[self.part][f"{name} @ {_site()}" if self.sites else name] += 1
        return out

    def fused(self, name: str, fn):
        """fn (a hyla.ops.dispatch op) counted as one op, its inner aten ops not (unless aten)."""
        @functools.wraps(fn)
        def counted(*a, **k):
            if not STRIDED_ONLY:
                self.counts[self.part][f"hyla.{name}"] += 1
            self.fused_depth += 1
            try:
                return fn(*a, **k)
            finally:
                self.fused_depth -= 1
        return counted

    def labelled(self, label, fn):
        """fn run with `part` = label (a string, or a callable -> string evaluated per call), the
        previous part restored after it."""
        @functools.wraps(fn)
        def run(*a, **k):
            prev, self.part = self.part, label() if callable(label) else label
            try:
                return fn(*a, **k)
            finally:
                self.part = prev
        return run


@contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def count_step(engine, aten: bool = False, sites: bool = False):
    """A context manager wrapping engine.step: it yields the list to which every step's counts
    (part -> Counter of op names, and "_fused": whether a fused MTP step ran) are appended while
    it is active."""
    return _Recorder(engine, aten, sites)


class _Recorder:
    def __init__(self, engine, aten: bool, sites: bool):
        self.engine, self.aten, self.sites, self.steps = engine, aten, sites, []

    def __enter__(self):
        from hyla.ops import dispatch

        engine, stack = self.engine, ExitStack()
        self.stack = stack
        counter = OpCounter(self.aten, self.sites)
        for name in FUSED:
            stack.enter_context(_patched(dispatch, name, counter.fused(name, getattr(dispatch, name))))
        # the attention layers take the route they take on the GPU (their two fused ops, run here
        # by the torch references and counted one each)
        stack.enter_context(_patched(dispatch, "gated_attention_kernels", lambda x, cache_k, fp8=False: True))
        graphs = engine.runner.graphs
        if graphs is not None:
            stack.enter_context(_patched(graphs, "_forward", counter.labelled("decode forward", graphs._forward)))
            stack.enter_context(_patched(graphs, "_verify_forward",
                                         counter.labelled("verify forward", graphs._verify_forward)))
        drafter = getattr(engine.spec, "drafter", None) if engine.spec is not None else None
        fused = getattr(drafter, "fused", None)
        if fused is not None:
            head, calls = fused.steps.head, [0]

            def head_part():
                calls[0] += 1
                return "head catch-up" if calls[0] == 1 else f"draft step {calls[0] - 1}"

            def head_call(fn):  # the label stays set after the call: its lm_head and argmax belong to it
                @functools.wraps(fn)
                def run(*a, **k):
                    counter.part = head_part()
                    return fn(*a, **k)
                return run

            def fused_forward(fn):
                @functools.wraps(fn)
                def run(*a, **k):
                    calls[0] = 0
                    prev, counter.part = counter.part, "acceptance"
                    try:
                        return fn(*a, **k)
                    finally:
                        counter.part = prev
                return run
            stack.enter_context(_patched(head, "forward_batch", head_call(head.forward_batch)))
            stack.enter_context(_patched(fused, "forward", fused_forward(fused.forward)))
        inner = engine.step

        def step(*a, **k):
            counter.counts = collections.defaultdict(collections.Counter)
            counter.part = "outside graph"
            runs = fused.runs if fused is not None else 0
            with counter:
                out = inner(*a, **k)
            info = dict(counter.counts)
            info["_fused"] = fused is not None and fused.runs > runs
            self.steps.append(info)
            return out
        stack.enter_context(_patched(engine, "step", step))
        return self.steps

    def __exit__(self, *exc):
        self.stack.close()
        return False


def total(step: dict) -> int:
    return sum(sum(c.values()) for part, c in step.items() if not part.startswith("_"))


def steady(steps: list[dict], fused: bool) -> dict:
    """The most common step among decode steps (MTP: fused ones; their first is left out: its
    drafts came from an unfused propose)."""
    pool = [s for s in steps if s["_fused"]][1:] if fused else [s for s in steps if "decode forward" in s]
    if not pool:
        raise RuntimeError("no steady-state step was recorded")
    common = collections.Counter(total(s) for s in pool).most_common(1)[0][0]
    return next(s for s in pool if total(s) == common)


def build(model: str, k: int | None, dtype: str | None, **kw):
    """An LLM on the CPU whose runner has graphs with capture off (the graphs' functions run eagerly)."""
    from hyla import LLM
    from hyla.engine import model_runner

    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k, "rollback": "slots"}} if k else {}
    with _patched(model_runner, "use_cuda_graphs", lambda model, eager: True):
        return LLM(model, device="cpu", dtype=dtype, enable_prefix_caching=False, **spec, **kw)


def measure(llm, prompt, params, fused: bool, aten: bool = False, sites: bool = False) -> dict:
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    with count_step(llm.engine, aten, sites) as steps:
        llm.generate([prompt], params, use_tqdm=False)
    return steady(steps, fused)


def host_times(llm, prompt, params, profile: bool = False) -> dict[str, float]:
    """Host time of a decode step in ms, what a GPU step spends besides its graph replay: the
    graph's function (decode / verify, eager on the CPU) is replaced by the outputs it gave the
    first time for its key (the graph's buffers, as a replay leaves them), so a step's wall time
    is its host work only -> {"step": median per decode step, "token": per emitted token}. The
    tokens are then not the model's (stale logits); the work per step is the same. profile:
    also print cProfile's top functions by own time."""
    import cProfile
    import pstats
    import statistics
    import time

    engine, graphs = llm.engine, llm.engine.runner.graphs
    times: list[float] = []
    inner = engine.step

    def step(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        times.append(time.perf_counter() - t)
        return out

    def replayed(fn, key_of):
        seen = {}

        @functools.wraps(fn)
        def run(*a):
            key = key_of(a)
            if key not in seen:
                seen[key] = fn(*a)
            return seen[key]
        return run
    prof = cProfile.Profile() if profile else None
    with ExitStack() as stack:
        stack.enter_context(_patched(graphs, "_forward", replayed(graphs._forward, lambda a: a)))
        stack.enter_context(_patched(graphs, "_verify_step", replayed(graphs._verify_step, lambda a: a[0])))
        stack.enter_context(_patched(engine, "step", step))
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        del times[:]
        if prof:
            prof.enable()
        out = llm.generate([prompt], params, use_tqdm=False)
        if prof:
            prof.disable()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    decode = times[2:]  # past the prompt's steps
    tokens = len(out[0].outputs[0].token_ids) - 1
    return {"step": statistics.median(decode) * 1e3, "token": sum(decode) / max(tokens, 1) * 1e3}


def _report(title: str, step: dict, by_op: bool) -> str:
    lines = [f"# {title}: {total(step)} ops"]
    for part, c in step.items():
        if part.startswith("_"):
            continue
        lines.append(f"  {part:<16} {sum(c.values()):5d}")
        if by_op:
            for name, n in c.most_common():
                lines.append(f"      {name:<48} {n:4d}")
    if by_op:
        allc = collections.Counter()
        for part, c in step.items():
            if not part.startswith("_"):
                allc.update(c)
        lines.append("  all parts by op:")
        lines += [f"      {name:<48} {n:4d}" for name, n in allc.most_common()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from hyla import SamplingParams
    from hyla.bench.spec import FREE
    from hyla.models.hub import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-mtp")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--dtype", default="bfloat16", help="the model dtype (bfloat16: the casts the GPU runs)")
    p.add_argument("--by-op", action="store_true", help="counts by op name in every part")
    p.add_argument("--aten", action="store_true", help="count the aten ops inside fused dispatch ops too")
    p.add_argument("--strided", action="store_true",
                   help="count only elementwise ops with a strided or broadcast operand (non-vectorised on CUDA)")
    p.add_argument("--sites", action="store_true", help="with --by-op: by op name and calling line of hyla")
    p.add_argument("--host", action="store_true", help="also the host time per step (what is not the graph)")
    p.add_argument("--profile", action="store_true", help="with --host: cProfile's top functions")
    p.add_argument("--host-tokens", type=int, default=400, help="tokens decoded for --host")
    args = p.parse_args(argv)
    global STRIDED_ONLY
    STRIDED_ONLY = args.strided
    torch.manual_seed(0)
    model = str(resolve_model(args.model))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    prompt = FREE[0]
    engines = {"plain decode step": build(model, None, args.dtype),
               f"MTP fused step (k={args.k})": build(model, args.k, args.dtype)}
    counts = [measure(llm, prompt, params, fused=bool(i), aten=args.aten, sites=args.sites)
              for i, llm in enumerate(engines.values())]
    for title, step in zip(engines, counts):
        print(_report(title, step, args.by_op))
    print(f"# MTP / plain: {total(counts[1]) / total(counts[0]):.2f}x")
    if args.host:
        long = SamplingParams(temperature=0.0, max_tokens=args.host_tokens, ignore_eos=True)
        for title, llm in engines.items():
            t = host_times(llm, prompt, long, profile=args.profile)
            print(f"# {title}: host {t['step']:.4f} ms per step, {t['token']:.4f} ms per token")


if __name__ == "__main__":
    main()
