"""Load a released shape through `LLM(..., load_format="dummy")` on the GPU and report the peak
memory of loading against the weights, then generate a few tokens through the same `LLM`.

    python scripts/load_peak.py --shape kimi-linear-48b-a3b

Loading must peak at the weights plus one MoE layer's transient (hyla.models.loader.load_model):
the table prints both, and the one-layer bound (the largest MoE layer's routed + shared experts).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import hyla.models

from hyla.bench.random_models import random_config_dict
from hyla.engine import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="kimi-linear-48b-a3b")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(random_config_dict(args.shape)))
        load_peak = []
        load_model = hyla.models.load_model

        def measured(*a, **k):  # the peak of loading alone, before the engine sizes its pools
            model = load_model(*a, **k)
            torch.cuda.synchronize()
            load_peak.append(torch.cuda.max_memory_allocated())
            return model

        hyla.models.load_model = measured
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        llm = LLM(tmp, load_format="dummy", dtype=torch.bfloat16, device="cuda", max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len)
        load_s = time.perf_counter() - start
        model = llm.engine.model
        weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                       for t in model.state_dict().values()}.values())  # shared storages once
        layer = max((sum(t.numel() * t.element_size() for t in m.state_dict().values())
                     for m in model.modules() if type(m).__name__ == "StackedExperts"), default=0)
        peak = load_peak[0]
        prompts = [[(7 * i + j) % 1000 + 10 for j in range(256)] for i in range(8)]
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        gen_s = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    gib = 1 << 30
    print(f"| shape | weights GiB | one MoE layer GiB | peak while loading GiB | load s | "
          f"8 x 256 in / 32 out s |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.shape} | {weights / gib:.2f} | {layer / gib:.2f} | {peak / gib:.2f} | {load_s:.1f} | "
          f"{gen_s:.2f} ({tokens} tokens) |")


if __name__ == "__main__":
    main()
