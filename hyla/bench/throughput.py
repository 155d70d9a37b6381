"""Engine throughput: offline tokens/s vs transformers; decode step, prefill and one MoE block on
the GPU against their memory floors and against transformers + fla on the same weights.

    hyla bench throughput [--model PATH | --random-config NAME [--layers N]] [--device cpu|cuda]
        [--mode offline decode prefill moe-layer] [--vs transformers]
        [--num-prompts 8] [--prompt-len 128] [--new-tokens 32]                       # offline
        [--batch-sizes 1 16 64 256] [--context-lens 512 4096] [--steps 50]          # decode
        [--prefill-tokens 8192] [--prefill-chunk 0]                                  # prefill
        [--moe-layer] [--moe-tokens 64 256]                                          # one MoE block
        [--quantization fp8]                                       # block-FP8 weights (not offline)

Offline (the default on the CPU): the same N equal-length random prompts, greedy, the same number
of new tokens, through hyla's `LLM.generate` and through transformers' `generate` on the same
checkpoint in the same run. Equal lengths let transformers batch all prompts without padding,
its best case. Prefill tokens/s = N * prompt_len / time of a 1-token generate; decode tokens/s =
N * (new_tokens - 1) / (time of the full generate - that). Medians of --repeat runs.

Decode (the default on CUDA), prefill (--prefill-tokens) and --moe-layer: hyla.bench.step_bench
(what each times) and hyla.bench.floor (the floors: weights once, the EXPECTED distinct experts a
batch touches, E (1 - (1 - k/E)^b) per MoE layer, state read + written, KV read, logits written;
over a copy bandwidth measured in the same run). They also run on the CPU (perf_counter instead
of CUDA events, no graphs: a test of the plumbing, not a figure).

--random-config: shapes with random weights built straight on the device (hyla.bench.random_models,
which says where every value of the released shapes comes from): tiny, 1b (dense Kimi-Linear),
kimi-linear-48b-a3b, qwen3-next-80b-a3b (the released shapes), tiny-kimi-moe,
tiny-qwen3-next-moe (CPU tests). --layers N keeps the first N layers of the schedule; N >= 4 keeps
an attention layer in both released shapes (the full 80B shape, ~160 GB in bf16, does not fit one
H200: cut it). Offline mode writes the small shapes as an HF checkpoint to a temporary directory
so that both engines load the same file. --model omitted: the bundled default model, else tiny.

--vs transformers (decode, prefill, moe-layer): transformers' KimiLinearForCausalLM /
Qwen3NextForCausalLM built on the meta device with its tensors pointed at hyla's
(hyla.bench.hf_peer: shared storage, only the small re-laid-out tensors copied),
experts_implementation="grouped_mm", flash-linear-attention kernels when `fla` imports.

On the GPU machine (no network; the wheels travel in the git-ignored .whl/ at the repo root:
fla-core and flash-linear-attention 0.6.0, pure python, for the image's torch 2.11 / triton 3.6 /
transformers 5.17, which hyla.bench.hf_peer supports as well as 5.24) start with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

scripts/bench_moe_gpu.sh runs the whole MoE benchmark in one command.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hyla.bench.random_models import (  # noqa: F401  (re-exported: tests and scripts import them from here)
    RANDOM_CONFIGS, random_checkpoint, random_config_dict, random_model,
)
from hyla.models.loader import load_config


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- offline: hyla vs transformers ------------------------------------------------------------

def _hyla_generate(path, prompts, new_tokens, dtype, device, tp: int = 1, expert_parallel: bool = False):
    from hyla import LLM, SamplingParams
    from hyla.models import memory

    config = load_config(path)  # the family its model_type names
    max_len = len(prompts[0]) + new_tokens + 1
    # Room for every prompt at full length, with slots for all of them (the planner gives slots at
    # most half the budget).
    per_seq = memory.state_bytes_per_slot(config, torch.float32, dtype) + (max_len + 16) * memory.kv_bytes_per_token(
        config, dtype)
    # (per rank under tensor parallelism: the whole model's sizes, more than a rank needs)
    dummy = not any((Path(path) / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    llm = LLM(str(path), dtype=dtype, device=device, max_num_seqs=len(prompts), max_model_len=max_len,
              memory_budget=2 * len(prompts) * per_seq + (1 << 20), tensor_parallel_size=tp,
              enable_expert_parallel=expert_parallel, load_format="dummy" if dummy else "auto")

    def run(m):
        params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return run


def _hf_generate(path, prompts, new_tokens, dtype, device):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)  # equal lengths: one batch, no padding

    def run(m):
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()
    return run


def offline(path, args) -> list[dict]:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(args.seed)
    vocab = load_config(path).vocab_size
    prompts = torch.randint(3, vocab, (args.num_prompts, args.prompt_len), generator=gen).tolist()
    engines = [("hyla", _hyla_generate)]
    if not args.no_transformers:
        engines.append(("transformers", _hf_generate))
    rows, outputs = [], {}
    if not args.no_transformers:
        import transformers

        print(f"# transformers {transformers.__version__}")
    for name, make in engines:
        tp = dict(tp=args.tensor_parallel_size, expert_parallel=args.enable_expert_parallel) if name == "hyla" else {}
        run = make(path, prompts, args.new_tokens, dtype, args.device, **tp)
        outputs[name] = run(args.new_tokens)  # warm-up, and the tokens compared below
        t_first = _median_s(lambda: run(1), args.repeat)
        t_all = _median_s(lambda: run(args.new_tokens), args.repeat)
        n = args.num_prompts
        rows.append(dict(engine=name, prefill_tok_s=n * args.prompt_len / t_first,
                         decode_tok_s=n * (args.new_tokens - 1) / max(t_all - t_first, 1e-9), total_s=t_all))
    same = None
    if "transformers" in outputs:
        same = sum(a == b for a, b in zip(outputs["hyla"], outputs["transformers"]))
    tp = f", tensor parallel {args.tensor_parallel_size}" + (" (experts whole)" if args.enable_expert_parallel else "")
    print(f"# offline: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, "
          f"{args.dtype}, {args.device}{tp if args.tensor_parallel_size > 1 else ''}; medians of {args.repeat}")
    print(f"{'engine':<14} {'prefill tok/s':>14} {'decode tok/s':>13} {'total s':>9}")
    for r in rows:
        print(f"{r['engine']:<14} {r['prefill_tok_s']:>14.0f} {r['decode_tok_s']:>13.1f} {r['total_s']:>9.2f}")
    if len(rows) == 2:
        h, t = rows
        ratio = dict(engine="hyla/transformers", prefill_tok_s=h["prefill_tok_s"] / t["prefill_tok_s"],
                     decode_tok_s=h["decode_tok_s"] / t["decode_tok_s"], total_s=t["total_s"] / h["total_s"])
        rows.append(ratio)
        print(f"{'hyla/transf.':<14} {ratio['prefill_tok_s']:>13.1f}x {ratio['decode_tok_s']:>12.1f}x "
              f"{ratio['total_s']:>8.1f}x")
        print(f"# greedy outputs identical for {same}/{args.num_prompts} prompts")
    return rows


# ---- entry point ------------------------------------------------------------------------------

def _resolve_model(args, tmp: str) -> tuple[Path | None, str]:
    if args.model:
        return Path(args.model), args.model
    if args.random_config is None:
        try:
            from hyla.models.default import default_model_path

            return Path(default_model_path()), "default model"
        except (ImportError, FileNotFoundError):
            args.random_config = "tiny"
    label = f"random {args.random_config}" + (f", first {args.layers} layers" if args.layers else "")
    if "offline" not in args.mode:
        return None, label  # built straight on the device
    if args.tensor_parallel_size > 1:  # a config.json only: every rank draws its shard's weights
        path = Path(tmp) / f"random-{args.random_config}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(random_config_dict(args.random_config, args.layers)))
        return path, label + ", random weights drawn on each rank"
    return random_checkpoint(tmp, args.random_config, args.seed), label


def _step_benches(path, args, dtype) -> dict:
    from hyla.bench import floor, hf_peer, step_bench
    from hyla.models.config import read_config_json

    if path is None:
        # FP8 drawn on the device, as load_format "dummy" does; FP8 modules on any device: the
        # CPU's table then counts the FP8 bytes too
        model = random_model(args.random_config, dtype=dtype, device=args.device, seed=args.seed, layers=args.layers,
                             quantization=args.quantization, fp8_weights="fp8")
        config_dict = random_config_dict(args.random_config, args.layers)
    else:
        from hyla.models import load_model

        model = load_model(path, dtype=dtype, device=args.device, quantization=args.quantization)
        config_dict = read_config_json(path)
    cuda = model.device.type == "cuda"
    bw = floor.copy_bandwidth(model.device, nbytes=(2 << 30) if cuda else (64 << 20))
    hf = None
    if args.vs == "transformers":
        hf = hf_peer.build_peer(model, config_dict, args.experts_implementation)
        print(f"# vs {hf_peer.peer_versions()}; experts_implementation={hf.config._experts_implementation}; "
              f"kernels bound: {hf_peer.kernels_bound(hf)}")
    print(step_bench.describe(model, bw, max(args.context_lens)))
    prefill_tokens = max(args.prefill_tokens or [0]) if "prefill" in args.mode else 0
    runner = step_bench.make_runner(model, max(args.batch_sizes), max(args.context_lens), prefill_tokens, args.seed)
    results = {}
    if "decode" in args.mode:
        print(f"# decode step: graph = CUDA-graph replay (mean of {args.steps}), eager = forward_batch + "
              f"compute_logits; transformers = median of {args.hf_repeat} decode forwards after a prefill")
        results["decode"] = step_bench.decode(model, runner, args, bw, hf)
    if "prefill" in args.mode:
        print(f"# prefill: one prompt, hyla through ModelRunner.execute (chunk = tokens per engine step), "
              f"transformers one forward; medians of {args.prefill_repeat}")
        results["prefill"] = step_bench.prefill(model, runner, args, hf)
    if "moe-layer" in args.mode:
        results["moe_layer"] = step_bench.moe_layer(model, args, bw, hf)
    return results


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="hyla bench throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    p.add_argument("--random-config", choices=list(RANDOM_CONFIGS), help="random weights of this shape")
    p.add_argument("--layers", type=int, help="keep the first N layers of --random-config (its layer pattern)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", nargs="+", choices=["offline", "decode", "prefill", "moe-layer", "both"],
                   help="default: offline on CPU, decode on CUDA (both = offline + decode); --prefill-tokens "
                        "and --moe-layer add theirs")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="offline: skip the transformers column")
    p.add_argument("--vs", choices=["transformers"], help="decode / prefill / moe-layer: also time transformers")
    p.add_argument("--experts-implementation", default="grouped_mm", help="transformers' experts_implementation")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context-lens", "--context-len", dest="context_lens", type=int, nargs="+", default=[512])
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per cell")
    p.add_argument("--hf-repeat", type=int, default=5, help="timed transformers decode steps per cell (median)")
    p.add_argument("--prefill-tokens", type=int, nargs="+", help="prompt lengths of the prefill table")
    p.add_argument("--prefill-chunk", type=int, default=0, help="tokens per hyla prefill step (0: the whole prompt)")
    p.add_argument("--prefill-repeat", type=int, default=3)
    p.add_argument("--moe-layer", action="store_true", help="time the first MoE block alone")
    p.add_argument("--moe-tokens", type=int, nargs="+", default=[64, 256])
    p.add_argument("--moe-repeat", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="list the kernels of one eager decode step (CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", "-q", choices=["fp8"],
                   help="decode / prefill / moe-layer: block-FP8 weights (random ones drawn in FP8 with "
                        "--random-config; a bf16 --model quantised while loading)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="offline through LLM over N ranks (random weights drawn on each rank with --random-config)")
    p.add_argument("--enable-expert-parallel", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    modes = set(args.mode or [])
    if "both" in modes:
        modes |= {"offline", "decode"}
    if args.prefill_tokens:
        modes.add("prefill")
    if args.moe_layer:
        modes.add("moe-layer")
    if not modes - {"both"}:
        modes.add("decode" if cuda and args.tensor_parallel_size == 1 else "offline")
    args.mode = modes - {"both"}
    if args.tensor_parallel_size > 1:
        if args.mode != {"offline"}:
            p.error("--tensor-parallel-size runs the offline engine benchmark only (--mode offline)")
        args.no_transformers = True  # transformers runs on one device
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if "prefill" in args.mode and not args.prefill_tokens:
        args.prefill_tokens = [8192]
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (prefill is timed with 1)")
    if args.quantization and "offline" in args.mode:
        p.error("--quantization times the decode / prefill / moe-layer steps (not --mode offline)")
    if args.layers is not None and args.random_config is None:
        p.error("--layers cuts a --random-config")
    if ("offline" in args.mode and args.random_config and RANDOM_CONFIGS[args.random_config][0] is not None
            and args.tensor_parallel_size == 1):
        p.error("--mode offline writes a checkpoint: use --random-config tiny or 1b")
    print(f"# hyla bench throughput: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    results: dict = {}
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path, label = _resolve_model(args, tmp)
        print(f"# model: {label}{'' if path is None else f' ({path})'}")
        if "offline" in args.mode:
            results["offline"] = offline(path, args)
        if args.mode - {"offline"}:
            results.update(_step_benches(None if args.random_config else path, args, dtype))
    return results


if __name__ == "__main__":
    main()
