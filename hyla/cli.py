"""The `hyla` command: serve, generate, bench, plot, demo."""

from __future__ import annotations

import argparse
import json
import math
import sys


def finite_non_negative(unit: str):
    """argparse type: a finite number >= 0 of `unit` (inf or nan would stall or void what waits
    or is timed by it); `hyla bench serve` takes its times with it too."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        if not 0 <= value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number of {unit}, at least 0, got {text}")
        return value
    return parse


def _demo(args) -> None:
    """A short tour of the ops: chunkwise prefill equals the exact loop, checkpoints, decode."""
    import torch
    import torch.nn.functional as F

    from hyla.ops import chunk_kda, fused_recurrent_kda, naive_recurrent_kda

    torch.manual_seed(0)
    T, H, K, V = args.tokens, 4, 64, 64
    q = torch.randn(1, T, H, K, dtype=torch.float64)
    k = F.normalize(torch.randn(1, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, H, V, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(1, T, H, K, dtype=torch.float64))
    beta = torch.rand(1, T, H, dtype=torch.float64)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    p = T // 3 + 1
    o, s, (ck,) = chunk_kda(q, k, v, g, beta, output_final_state=True, checkpoint_positions=[[p]])
    _, s_p = naive_recurrent_kda(q[:, :p], k[:, :p], v[:, :p], g[:, :p], beta[:, :p], output_final_state=True)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    print(f"KDA, T={T}, H={H}, K=V={K}, fp64")
    print(f"  chunkwise prefill vs exact loop: output rel. error {rel(o, o_ref):.1e}, state {rel(s, s_ref):.1e}")
    print(f"  in-pass checkpoint after {p} tokens vs loop stopped there: {rel(ck[0], s_p[0]):.1e}")
    pool = torch.zeros(4, H, K, V, dtype=torch.float64)
    pool[2] = s[0]
    x = [t[:, :1] for t in (q, k, v, g, beta)]
    o_dec, _ = fused_recurrent_kda(*x, initial_state=pool, ssm_state_indices=torch.tensor([2]))
    print(f"  one decode step over a state pool (slot 2, in place): |o| = {o_dec.norm():.3f}")


_BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
               "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


def _byte_size(text: str) -> int:
    """'68719476736', '64GiB', '64G' (binary) or '64GB' (decimal) -> bytes."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 68719476736, 64GiB, 64GB)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def _add_engine_args(p: argparse.ArgumentParser, prefix_cache_default: bool) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory, a Hugging Face Hub id (org/name, from the "
                   "local Hugging Face cache, downloaded when missing), or a bundled model's name: default (the "
                   "default), qwen3.5-mtp (with an MTP head)")
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit of a Hub id (default: main)")
    p.add_argument("--generation-config", default="auto",
                   help="auto: the checkpoint's generation_config.json sampling defaults apply to requests that "
                   "leave them unset; vllm: no defaults; or a directory holding a generation_config.json")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16, float64")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--memory-budget", type=_byte_size, default=None,
                   help="bytes for KV pages + state slots (e.g. 8589934592, 8GiB, 512MiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory this engine may use: weights, a worst-case step and the "
                   "KV pages + state slots (vLLM's flag; --memory-budget overrides the pools' share)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=prefix_cache_default)
    p.add_argument("--mamba-ssm-cache-dtype", choices=["auto", "float32", "bfloat16"], default=None,
                   help="recurrent state precision (vLLM's flag; auto = float32)")
    p.add_argument("--checkpoint-dtype", choices=["auto", "int8"], default="auto",
                   help="int8: prefix-cache state checkpoints stored with int8 rows and fp32 scales "
                        "(~3.6x as many in the same memory with a float32 state)")
    p.add_argument("--enable-int8-mamba-checkpoint", dest="checkpoint_dtype", action="store_const", const="int8",
                   help="the same as --checkpoint-dtype int8 (SGLang's flag)")
    p.add_argument("--host-cache-bytes", type=_byte_size, default=0,
                   help="pinned host memory for a second prefix-cache tier: what the device tier evicts goes "
                        "there and comes back on a hit (e.g. 64GiB; 0: none)")
    p.add_argument("--speculative-config", type=json.loads, default=None, help='JSON, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 4}\'')
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", metavar="N",
                   help="batch sizes of the decode CUDA graphs captured at startup (default 1 2 4 8 16 24 ... "
                        "max-num-seqs)")
    p.add_argument("--prefill-graph-max-tokens", type=int, default=None, metavar="N",
                   help="prefill steps of up to N tokens run their token-wise parts (projections, norms, "
                        "MoE) as CUDA graphs captured at startup, the attention and recurrent cores eager "
                        "(Kimi-Linear, Qwen3-Next, Qwen3.5; default 2048 where decode runs in CUDA graphs, "
                        "0: off)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch a decode step before the previous one's tokens are read (with CUDA graphs; "
                        "same output)")
    p.add_argument("--kernel-warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="on one CUDA device, run prefill-shaped steps at startup so that Triton compiles their "
                        "kernels before serving rather than during it")
    p.add_argument("--step-log", metavar="PATH", default=None,
                   help="write one JSON line per engine step (time, wall time, decode rows, prefill chunks by "
                        "request id) to PATH, for taking a run's latencies apart")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N devices (worker processes started by the engine)")
    p.add_argument("--enable-expert-parallel", action="store_true", help="whole experts per rank (with -tp N)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights from config.json alone (benchmarks)")
    p.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                   help="fp8: block-quantise a bf16 checkpoint's projections and experts to FP8 while loading "
                        "(an FP8 checkpoint is read as FP8 without it)")
    p.add_argument("--fp8-weights", choices=["auto", "fp8", "dequantized"], default="auto",
                   help="FP8 weights: auto (FP8 modules on CUDA, dequantised elsewhere), fp8 (FP8 modules on any "
                        "device) or dequantized")
    p.add_argument("--mxfp4-experts", choices=["auto", "packed", "dequantized", "fp8"], default="auto",
                   help="MXFP4 routed experts (Kimi K3): auto (packed on CUDA), packed, dequantized or fp8 "
                        "(converted to block FP8 at load)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                   help="auto: attention KV pages in the model dtype; fp8 (= fp8_e4m3): e4m3 pages with per-token "
                        "scales, about twice the tokens per byte of bf16 (vLLM's flag)")
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default=None,
                   help="the ops' kernels: auto (Triton on CUDA, torch elsewhere), torch or triton "
                        "(default: the HYLA_BACKEND environment variable, else auto)")


def _engine_config(args):
    from pathlib import Path

    from hyla.engine import EngineConfig
    from hyla.models.default import BUNDLED_MODELS
    from hyla.models.hub import is_repo_id

    model = getattr(args, "model_positional", None) or args.model
    if getattr(args, "model_positional", None) and args.model and args.model != args.model_positional:
        raise SystemExit(f"hyla: the model is given twice ({args.model_positional!r} and --model {args.model!r})")
    named = model is not None and not Path(model).exists() and (model in BUNDLED_MODELS or is_repo_id(model))
    if named and getattr(args, "served_model_name", "") is None:
        args.served_model_name = model  # clients ask for the name they were given (vLLM's rule)
    return EngineConfig(
        model=model, revision=args.revision, generation_config=args.generation_config, dtype=args.dtype,
        device=args.device, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, memory_budget=args.memory_budget,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=args.enable_prefix_caching, speculative_config=args.speculative_config,
        enforce_eager=args.enforce_eager, kernel_warmup=args.kernel_warmup, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel, load_format=args.load_format,
        quantization=getattr(args, "quantization", None), backend=getattr(args, "backend", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        fp8_weights=getattr(args, "fp8_weights", "auto"), mxfp4_experts=getattr(args, "mxfp4_experts", "auto"),
        scheduling_policy=getattr(args, "scheduling_policy", "fcfs"),  # a serve flag
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, checkpoint_dtype=args.checkpoint_dtype,
        host_cache_bytes=args.host_cache_bytes, async_scheduling=args.async_scheduling,
        cuda_graph_sizes=args.cuda_graph_sizes, step_log=getattr(args, "step_log", None),
        prefill_graph_max_tokens=args.prefill_graph_max_tokens)


def _serve(args) -> None:
    import gc
    import logging
    import os

    from hyla.engine import LLMEngine
    from hyla.server import create_app
    from hyla.server.shutdown import serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = _engine_config(args)
    engine = LLMEngine(config)
    name = args.served_model_name or os.path.basename(os.path.normpath(config.model))
    app = create_app(engine, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                     chat_template=args.chat_template, trust_request_chat_template=args.trust_request_chat_template,
                     reasoning_parser=args.reasoning_parser, admission_wait=None if args.admission_wait_ms is None else args.admission_wait_ms / 1e3)
    logging.getLogger("hyla").info("serving %s on http://%s:%d", name, args.host, args.port)
    # What startup made (the model's modules, torch's and the server's objects: ~300K with the
    # bundled model) lives as long as the process, yet every full garbage collection would traverse
    # it again, ~120 ms on one core, in whichever thread triggered it (the engine's, mid-step). The
    # collector is told to leave it be, as vLLM does once its engine is up (BENCHMARKS.md "Serving
    # host work on the CPU"). Only here: a process that builds several engines (tests, `LLM` in a
    # notebook) relies on the collector to free the ones it dropped.
    gc.collect()
    gc.freeze()
    failure = []
    if engine.workers is not None:  # a dead tensor-parallel worker stops the server, exit code 1
        import signal

        def stop(err):  # called in the engine's loop thread, inside the failing step
            failure.append(err)
            logging.getLogger("hyla").error("%s: stopping the server", err)
            for rid in list(engine.requests):  # nothing left to step: the loop idles until shutdown
                engine.abort_request(rid)
            app.state.server.async_engine.stop_all()  # their clients get their 503s now
            os.kill(os.getpid(), signal.SIGTERM)

        engine.workers.on_failure = stop
    # SIGTERM / Ctrl-C: stop accepting, let in-flight requests finish for up to the drain time,
    # then answer the rest (a 503, or a stream's error event and [DONE]) and exit.
    try:
        serve(app, args.host, args.port, args.shutdown_drain_s)
    finally:
        engine.shutdown()
    if failure:
        raise SystemExit(f"hyla serve: {failure[0]}")


def _generate(args) -> None:
    import time

    from hyla.engine import LLMEngine, SamplingParams

    engine = LLMEngine(_engine_config(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sampling_seed)
    engine.add_request("cli", args.prompt, params)
    start, first, out = time.perf_counter(), None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = first or time.perf_counter()
    elapsed = time.perf_counter() - start
    completion = out.outputs[0]
    print(args.prompt + completion.text)
    n = len(completion.token_ids)
    decode = (n - 1) / (elapsed - (first - start)) if n > 1 and elapsed > first - start else float("nan")
    print(f"\n[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s overall, {decode:.1f} tokens/s decode, "
          f"first token after {(first - start) * 1e3:.0f} ms; finish: {completion.finish_reason}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hyla", description="hybrid linear-attention LLM stack")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model takes it (vLLM's `vllm serve MODEL`)")
    _add_engine_args(serve, prefix_cache_default=True)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 routes")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20)
    serve.add_argument("--shutdown-drain-s", type=float, default=10.0,
                       help="on SIGTERM, seconds in-flight requests may take to finish; those still running then "
                       "are aborted and answered (a 503, or a stream's error event and [DONE]) before the exit")
    serve.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                       help="fcfs: first come, first served; priority: a request's `priority` orders the waiting "
                       "queue (lower first) and preemption takes the lowest-priority running request (vLLM's)")
    serve.add_argument("--tool-call-parser", default=None,
                       choices=["hermes", "qwen3_coder", "kimi_k2", "glm45", "glm47"], help="how tool calls are read from the model's text (vLLM's names)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (needs --tool-call-parser), as in vLLM')
    serve.add_argument("--chat-template", default=None,
                       help="a chat template file, or the template's text, used instead of the tokenizer's")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request send its own chat_template (a template is code the server runs)")
    serve.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1", "glm45", "kimi_k2"],
                       help="split the model's reasoning (<think>...</think>) from the content (vLLM's names)")
    serve.add_argument("--admission-wait-ms", type=finite_non_negative("milliseconds"), default=None,
                       help="an idle engine about to start a step waits up to this long for generation requests "
                       "that arrived with its first one and are still being prepared (tokenised), so that a burst "
                       "shares one prefill step; a lone request never waits (0: off; default: 20 on CUDA, where a "
                       "small prefill step costs mostly fixed host time, 0 on the CPU, where its time grows with its "
                       "tokens and a merged step makes the first arrivals wait)")
    serve.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="complete one prompt and print tokens/s")
    _add_engine_args(gen, prefix_cache_default=False)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="a short demonstration of the ops")
    demo.add_argument("--tokens", type=int, default=300)
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks: ops, kernels, throughput, prefix-cache, spec, moe, serve, shape",
                           add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda a: __import__("hyla.bench.__main__", fromlist=["main"]).main(a.rest))

    plot = sub.add_parser("plot", help="render the explanatory figures (PNG)")
    plot.add_argument("--out", required=True, help="output directory")
    plot.set_defaults(func=_plot)

    args = parser.parse_args(argv)
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        serve.error("--enable-auto-tool-choice needs --tool-call-parser")
    if getattr(args, "chat_template", None) is not None:  # a mistyped path fails before the model loads
        from hyla.server.chat_prompt import load_chat_template

        try:
            load_chat_template(args.chat_template)
        except (OSError, ValueError) as e:
            serve.error(str(e))
    args.func(args)


def _plot(args) -> None:
    from hyla.viz.plots import render_all

    for name, path in render_all(args.out).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
