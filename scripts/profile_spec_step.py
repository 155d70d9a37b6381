"""What one engine step replays on the GPU, plain decoding vs MTP speculation (a hint for fusion).

    python scripts/profile_spec_step.py --model qwen3.5-mtp --k 3 --tokens 64

Builds the engine on CUDA, decodes one prompt once to capture every graph, then decodes it
again under torch.profiler (hyla.bench.floor.kernel_profile, which sees the kernels a CUDA graph
replays): kernels and kernel time per engine step, and the kernels that take most of it.
"""

from __future__ import annotations

import argparse

from hyla import LLM, SamplingParams
from hyla.bench import floor as fl
from hyla.bench.spec import FREE
from hyla.models.hub import resolve_model


def _profile(llm: LLM, prompt: str, params: SamplingParams, top: int) -> str:
    llm.generate([prompt], params, use_tqdm=False)  # warm-up: graph capture
    engine = llm.engine
    steps = [0]
    inner = engine.step

    def counted(*a, **kw):
        steps[0] += 1
        return inner(*a, **kw)

    engine.step = counted
    report = fl.kernel_profile(lambda: llm.generate([prompt], params, use_tqdm=False), top=top)
    del engine.step
    return f"{steps[0]} engine steps\n# {report}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-mtp")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    model = resolve_model(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    opts = dict(device="cuda", enable_prefix_caching=False, memory_budget=1 << 30)
    prompt = FREE[0]
    print("# plain\n# " + _profile(LLM(model, **opts), prompt, params, args.top))
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "rollback": "slots"}
    print(f"# mtp k={args.k}\n# " + _profile(LLM(model, speculative_config=spec, **opts), prompt, params, args.top))


if __name__ == "__main__":
    main()
