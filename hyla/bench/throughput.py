"""Engine throughput: offline prefill and decode tokens/s, and the decode step against its floor.

    hyla bench throughput [--model PATH | --random-config tiny|1b] [--device cpu|cuda]
                          [--num-prompts 8] [--prompt-len 128] [--new-tokens 32]     # offline
                          [--batch-sizes 1 16 64] [--context-len 512]               # decode (CUDA)

Offline (the default on the CPU): the same N equal-length random prompts, greedy, the same number
of new tokens, through hyla's `LLM.generate` and through transformers' `generate` on the same
checkpoint in the same run. Equal lengths let transformers batch all prompts without padding,
its best case. Prefill tokens/s = N * prompt_len / time of a 1-token generate; decode tokens/s =
N * (new_tokens - 1) / (time of the full generate - that). Medians of --repeat runs.

Decode (the default on CUDA): ms per decode step (forward + logits; CUDA-graph replay and eager)
at each batch size, every sequence with --context-len cached tokens, against the floor = bytes a
step must move (weights once, each sequence's recurrent state and conv windows read and written,
its cached latents read) / copy bandwidth measured in the same run (a device-to-device copy,
bytes read + written).

--model omitted: the bundled default model (hyla.models.default_model_path), else --random-config
tiny. Random configs are Kimi-Linear shapes with random weights, written as an HF checkpoint to a
temporary directory so that both engines load the same file.
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

from hyla.models.config import KimiLinearConfig
from hyla.models.kimi_linear import KimiLinearForCausalLM
from hyla.models.memory import FP32_TENSORS

# Kimi-Linear shapes: KDA : MLA 3:1 (MLA every 4th layer), dense SwiGLU MLPs, NoPE MLA.
RANDOM_CONFIGS = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32, linear_heads=4, linear_head_dim=32),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, linear_heads=16, linear_head_dim=128),
}


def random_config_dict(name: str) -> dict:
    """config.json contents (the keys transformers' KimiLinearConfig and hyla both read)."""
    c = dict(RANDOM_CONFIGS[name])
    n = c["num_hidden_layers"]
    heads, head_dim = c.pop("linear_heads"), c.pop("linear_head_dim")
    full = [i for i in range(1, n + 1) if i % 4 == 0]  # 1-based
    return dict(c, model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], rms_norm_eps=1e-5,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, q_lora_rank=None,
                num_key_value_heads=c["num_attention_heads"], first_k_dense_replace=n,
                linear_attn_config=dict(head_dim=head_dim, num_heads=heads, short_conv_kernel_size=4,
                                        kda_layers=[i for i in range(1, n + 1) if i not in full],
                                        full_attn_layers=full))


def random_model(name: str, dtype=torch.float32, device="cpu", seed: int = 0) -> KimiLinearForCausalLM:
    """A Kimi-Linear of config `name` with PyTorch's default random init (never zeros), in `dtype`
    except the tensors the loader keeps in fp32."""
    config = KimiLinearConfig.from_hf_dict(random_config_dict(name))
    torch.manual_seed(seed)
    with torch.device(device):
        model = KimiLinearForCausalLM(config)
        with torch.no_grad():
            for name_, p in model.named_parameters():  # gate parameters away from their zero init
                if name_.endswith(("A_log", "dt_bias")):
                    p.uniform_(-1.0, 1.0)
    model.to(dtype)
    for name_, p in model.named_parameters():
        if name_.endswith(FP32_TENSORS):
            p.data = p.data.float()
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return model


def random_checkpoint(root, name: str, seed: int = 0) -> Path:
    """Write random config `name` as an fp32 HF checkpoint under root/random-<name>-<seed>."""
    from safetensors.torch import save_file

    path = Path(root) / f"random-{name}-{seed}"
    if not (path / "config.json").is_file():
        path.mkdir(parents=True, exist_ok=True)
        model = random_model(name, seed=seed)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(dict(random_config_dict(name), dtype="float32"), indent=2))
    return path


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- offline: hyla vs transformers ------------------------------------------------------------

def _hyla_generate(path, prompts, new_tokens, dtype, device):
    from hyla import LLM, SamplingParams
    from hyla.models import memory

    config = KimiLinearConfig.from_file(path)
    max_len = len(prompts[0]) + new_tokens + 1
    # Room for every prompt at full length, with slots for all of them (the planner gives slots at
    # most half the budget).
    per_seq = memory.state_bytes_per_slot(config, torch.float32, dtype) + (max_len + 16) * memory.kv_bytes_per_token(
        config, dtype)
    llm = LLM(str(path), dtype=dtype, device=device, max_num_seqs=len(prompts), max_model_len=max_len,
              memory_budget=2 * len(prompts) * per_seq + (1 << 20))

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
    vocab = KimiLinearConfig.from_file(path).vocab_size
    prompts = torch.randint(3, vocab, (args.num_prompts, args.prompt_len), generator=gen).tolist()
    engines = [("hyla", _hyla_generate)]
    if not args.no_transformers:
        engines.append(("transformers", _hf_generate))
    rows, outputs = [], {}
    if not args.no_transformers:
        import transformers

        print(f"# transformers {transformers.__version__}")
    for name, make in engines:
        run = make(path, prompts, args.new_tokens, dtype, args.device)
        outputs[name] = run(args.new_tokens)  # warm-up, and the tokens compared below
        t_first = _median_s(lambda: run(1), args.repeat)
        t_all = _median_s(lambda: run(args.new_tokens), args.repeat)
        n = args.num_prompts
        rows.append(dict(engine=name, prefill_tok_s=n * args.prompt_len / t_first,
                         decode_tok_s=n * (args.new_tokens - 1) / max(t_all - t_first, 1e-9), total_s=t_all))
    same = None
    if "transformers" in outputs:
        same = sum(a == b for a, b in zip(outputs["hyla"], outputs["transformers"]))
    print(f"# offline: {args.num_prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, "
          f"{args.dtype}, {args.device}; medians of {args.repeat}")
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


# ---- decode step vs the memory floor (CUDA) ---------------------------------------------------

def copy_bandwidth(device, nbytes: int = 2 << 30, repeat: int = 20) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read + written."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def step_bytes(model, batch: int, context: int, state_dtype=torch.float32) -> dict:
    """Fewest bytes one decode step moves: every weight once (only `batch` rows of the embedding),
    each sequence's recurrent state + conv windows read and written, its latents read (and the new
    one written), the fp32 logits written."""
    c = model.config
    emb = model.model.embed_tokens.weight
    weights = model.weight_bytes() - emb.numel() * emb.element_size() + batch * c.hidden_size * emb.element_size()
    state = 2 * batch * model.state_bytes_per_slot(state_dtype)
    kv = batch * (context + 2) * model.kv_bytes_per_token()
    return dict(weights=weights, state=state, kv=kv, logits=batch * c.vocab_size * 4)


def _time_ms(fn, repeat: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat


def kernel_profile(fn, top: int = 8) -> str:
    """What one call runs on the GPU (what a CUDA graph replays): kernel count, summed kernel time
    and the kernels that take most of it, via the profiler (a hint, not a result: n/a if absent)."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows = [(k.self_device_time_total, k.count, k.key) for k in prof.key_averages()
                if k.device_type == DeviceType.CUDA]
    except Exception as err:  # noqa: BLE001
        return f"n/a ({type(err).__name__}: {err})"
    rows.sort(reverse=True)
    lines = [f"{sum(r[1] for r in rows)} kernels, {sum(r[0] for r in rows) / 1e3:.3f} ms of kernel time"]
    lines += [f"  {us / 1e3:7.3f} ms {n:5d}x {name[:90]}" for us, n, name in rows[:top]]
    return "\n# ".join(lines)


def decode_floor(model, args) -> list[dict]:
    from hyla.engine.model_runner import ModelRunner
    from hyla.models.batch import ForwardBatch

    device = model.device
    bw = copy_bandwidth(device)
    page = 16
    pages_per_seq = -(-(args.context_len + 1) // page)
    max_b = max(args.batch_sizes)
    runner = ModelRunner(model, max_b, max_b * pages_per_seq, page, torch.float32, enforce_eager=False)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for layer in runner.cache.layers:  # random caches: timing must not run on zeros
        for t in layer.tensors():
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32) * 0.1)
    print(f"# decode step: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, "
          f"{model.dtype}, weights {model.weight_bytes() / 1e9:.2f} GB, state "
          f"{model.state_bytes_per_slot(torch.float32) / 1e6:.1f} MB/seq (fp32), latents "
          f"{model.kv_bytes_per_token() * args.context_len / 1e6:.2f} MB/seq at context {args.context_len}; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); {torch.cuda.get_device_name(device)}")
    rows = []
    for b in args.batch_sizes:
        tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(b)]
        tokens = torch.randint(3, model.config.vocab_size, (b,)).tolist()
        ctx, slots = [args.context_len] * b, list(range(b))
        replay_ms = host_ms = float("nan")
        if runner.graphs is not None:  # None for MoE models: eager only
            graph, _, _ = runner.graphs.prepare(tokens, ctx, slots, tables)  # captures on first use
            replay_ms = _time_ms(graph.replay, args.steps)
            host_ms = _time_ms(lambda: runner.graphs.run_decode(tokens, ctx, slots, tables)[:, 0].cpu(),
                               args.steps)
        batch = ForwardBatch.build([1] * b, ctx, tables, slots, device=device)
        ids = torch.tensor(tokens, device=device)

        def eager():
            batch._memo.clear()
            with torch.inference_mode():
                return model.compute_logits(model.forward_batch(ids, batch, runner.cache))
        eager_ms = _time_ms(eager, max(3, args.steps // 5))
        if args.profile:
            print(f"# eager decode step, batch {b}: {kernel_profile(eager)}")
        floor = sum(step_bytes(model, b, args.context_len).values()) / bw * 1e3
        best = min(replay_ms, eager_ms) if replay_ms == replay_ms else eager_ms
        rows.append(dict(batch=b, graph_ms=replay_ms, graph_host_ms=host_ms, eager_ms=eager_ms,
                         tok_s=b / best * 1e3, floor_ms=floor, x_floor=best / floor))
    print(f"{'batch':>5} {'graph ms':>9} {'+host ms':>9} {'eager ms':>9} {'tok/s':>9} {'floor ms':>9} {'x floor':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['graph_ms']:>9.3f} {r['graph_host_ms']:>9.3f} {r['eager_ms']:>9.2f} "
              f"{r['tok_s']:>9.0f} {r['floor_ms']:>9.3f} {r['x_floor']:>7.2f}x")
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
    if args.mode == "decode":
        return None, f"random {args.random_config}"  # built straight on the device
    return random_checkpoint(tmp, args.random_config, args.seed), f"random {args.random_config}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="hyla bench throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the bundled model)")
    p.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), help="random weights of this shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", choices=["offline", "decode", "both"], help="default: offline on CPU, decode on CUDA")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers column")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per batch size")
    p.add_argument("--profile", action="store_true", help="list the kernels of one eager decode step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    args.mode = args.mode or ("decode" if cuda else "offline")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.mode != "offline" and not cuda:
        p.error("--mode decode needs --device cuda")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (prefill is timed with 1)")
    print(f"# hyla bench throughput: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path, label = _resolve_model(args, tmp)
        print(f"# model: {label}{'' if path is None else f' ({path})'}")
        if args.mode in ("offline", "both"):
            if path is None:
                path = random_checkpoint(tmp, args.random_config, args.seed)
            results["offline"] = offline(path, args)
        if args.mode in ("decode", "both"):
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
            if path is None:
                model = random_model(args.random_config, dtype=dtype, device=args.device, seed=args.seed)
            else:
                from hyla.models import load_model

                model = load_model(path, dtype=dtype, device=args.device)
            results["decode"] = decode_floor(model, args)
    return results


if __name__ == "__main__":
    main()
