"""The step benches of `hyla bench throughput`: decode step vs its floor, prefill, one MoE block;
each optionally against transformers on the same weights (hyla.bench.hf_peer).

- `decode`: at every (context, batch), hyla's decode step through the engine's ModelRunner:
  CUDA-graph replay (mean of back-to-back replays; n/a when the runner has no graphs: on the CPU
  or for a module that is not graph-safe) and the eager `forward_batch` + `compute_logits`; caches
  filled with random values. Floor = hyla.bench.floor.step_bytes / copy bandwidth.
  transformers: one decode forward after a prefill of the context (hf_peer.decode_step_ms).
- `prefill`: one prompt of T tokens; hyla through `ModelRunner.execute`, as one engine step of all T
  tokens (`--prefill-chunk C`: steps of C tokens, as the engine's chunked prefill with
  max_num_batched_tokens = C; its default is 4096), logits of the last token only; transformers
  one forward of the same T tokens (logits_to_keep=1). Median of --prefill-repeat.
- `moe_layer`: the model's first MoE block alone on T random tokens: hyla's block vs
  transformers' block on the same weights, against the block's floor
  (hyla.bench.floor.moe_block_bytes / copy bandwidth); medians of single calls.

A transformers cell that runs out of memory prints n/a; the rest of the table goes on.
"""

from __future__ import annotations

import torch

from hyla.bench import floor as fl
from hyla.bench import hf_peer
from hyla.engine.step_plan import StepPlan

PAGE = 16


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def _peer_cell(fn):
    """Run one transformers measurement; None when it runs out of memory (the cell prints n/a)."""
    try:
        return fn()
    except (RuntimeError, MemoryError) as err:
        if not hf_peer.is_oom(err):
            raise
        print(f"# transformers: out of memory ({str(err).splitlines()[0][:120]}); n/a")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def make_runner(model, max_batch: int, max_context: int, prefill_tokens: int = 0, seed: int = 0):
    """A ModelRunner with slots for max_batch requests, pages for each at max_context + 1 tokens
    (or one prompt of prefill_tokens), every pool filled with random values."""
    from hyla.engine.model_runner import ModelRunner

    num_pages = max(max_batch * _pages(max_context + 1), _pages(prefill_tokens + 1))
    runner = ModelRunner(model, max_batch, num_pages, PAGE, torch.float32, enforce_eager=False)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for layer in runner.cache.layers:  # random caches: timing must not run on zeros
            for t in layer.tensors():
                t.normal_(0.0, 0.1, generator=gen)
    return runner


def describe(model, bw: float, context: int) -> str:
    c = model.config
    layers = fl.moe_layers(model)
    moe = ""
    if layers:
        moe = (f", {len(layers)} MoE layers x {c.num_experts} experts top-{fl.top_k_of(c)} "
               f"({layers[0]['expert_bytes'] / 1e6:.2f} MB each)")
    dev = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    return (f"# {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, {model.dtype}, weights "
            f"{model.weight_bytes() / 1e9:.2f} GB{moe}; state {model.state_bytes_per_slot(torch.float32) / 1e6:.1f} "
            f"MB/seq (fp32), KV {model.kv_bytes_per_token() * context / 1e6:.2f} MB/seq at {context}; copy "
            f"bandwidth {bw / 1e9:.0f} GB/s (read + write); {dev}")


def decode(model, runner, args, bw: float, hf=None) -> list[dict]:
    from hyla.contract import ForwardBatch

    device = model.device
    per_seq = _pages(max(args.context_lens) + 1)
    head = f"{'batch':>5} {'ctx':>6} {'graph ms':>9} {'eager ms':>9} {'tok/s':>9} {'floor ms':>9} {'x floor':>8}"
    print(head + ("" if hf is None else f" {'transf. ms':>10} {'transf./hyla':>12}"))
    rows = []
    for ctx in args.context_lens:
        for b in args.batch_sizes:
            tables = [list(range(i * per_seq, i * per_seq + _pages(ctx + 1))) for i in range(b)]
            tokens = torch.randint(3, model.config.vocab_size, (b,)).tolist()
            ctxs, slots = [ctx] * b, list(range(b))
            graph_ms = float("nan")
            if runner.graphs is not None:
                graph, _, _ = runner.graphs.prepare(tokens, ctxs, slots, tables)  # captures on first use
                if graph is not None:
                    graph_ms = fl.time_ms(graph.replay, args.steps, device=device)
            batch = ForwardBatch.build([1] * b, ctxs, tables, slots, device=device)
            ids = torch.tensor(tokens, device=device)

            def eager():
                batch._memo.clear()
                with torch.inference_mode():
                    return model.compute_logits(model.forward_batch(ids, batch, runner.cache))
            eager_ms = fl.time_ms(eager, max(3, args.steps // 5), device=device)
            if args.profile and device.type == "cuda":
                print(f"# eager decode step, batch {b}, context {ctx}: {fl.kernel_profile(eager)}")
            floor = sum(fl.step_bytes(model, b, ctx).values()) / bw * 1e3
            best = eager_ms if graph_ms != graph_ms else min(graph_ms, eager_ms)
            r = dict(batch=b, context=ctx, graph_ms=graph_ms, eager_ms=eager_ms, tok_s=b / best * 1e3,
                     floor_ms=floor, x_floor=best / floor)
            line = (f"{r['batch']:>5} {r['context']:>6} {_fmt(r['graph_ms'], '9.3f'):>9} {r['eager_ms']:>9.2f} "
                    f"{r['tok_s']:>9.0f} {r['floor_ms']:>9.3f} {r['x_floor']:>7.2f}x")
            if hf is not None:
                hf_ms = _peer_cell(lambda: hf_peer.decode_step_ms(hf, b, ctx, model.config.vocab_size,
                                                                  repeat=args.hf_repeat, seed=args.seed))
                r.update(hf_ms=hf_ms, hf_over_hyla=None if hf_ms is None else hf_ms / best)
                line += f" {_fmt(r['hf_ms'], '10.2f'):>10} {_fmt(r['hf_over_hyla'], '11.1f'):>11}x"
            print(line)
            rows.append(r)
    return rows


def prefill(model, runner, args, hf=None) -> list[dict]:
    device = model.device
    rate = fl.matmul_rate(device, model.dtype)
    per_token = fl.prefill_flops(model, 1)["per_token_params"]
    print(f"# prefill floor: (2 x {per_token / 1e9:.3f} B parameters a token multiplies x tokens + causal attention) "
          f"/ {rate / 1e12:.1f} TFLOP/s (a square {model.dtype} GEMM, this run; hyla.bench.floor.prefill_flops)")
    head = f"{'tokens':>7} {'chunk':>6} {'hyla ms':>9} {'hyla tok/s':>11} {'floor ms':>9} {'x floor':>8}"
    print(head + ("" if hf is None else f" {'transf. ms':>10} {'transf. tok/s':>13} {'hyla/transf.':>12}"))
    rows = []
    for T in args.prefill_tokens:
        gen = torch.Generator().manual_seed(args.seed)
        prompt = torch.randint(3, model.config.vocab_size, (T,), generator=gen).tolist()
        chunk = args.prefill_chunk or T
        table = list(range(_pages(T + 1)))

        def run():
            for start in range(0, T, chunk):
                n = min(chunk, T - start)
                runner.execute(StepPlan(token_ids=prompt[start:start + n], seq_lens=[n], context_lens=[start],
                                        block_tables=[table], state_slots=[0],
                                        logit_rows=[[n - 1]] if start + n == T else [[]]))
        ms = fl.median_ms(run, args.prefill_repeat, device=device)
        flops = fl.prefill_flops(model, T)
        floor_ms = (flops["matmul"] + flops["attention"]) / rate * 1e3
        r = dict(tokens=T, chunk=chunk, hyla_ms=ms, hyla_tok_s=T / ms * 1e3, floor_ms=floor_ms, x_floor=ms / floor_ms)
        line = (f"{r['tokens']:>7} {r['chunk']:>6} {r['hyla_ms']:>9.2f} {r['hyla_tok_s']:>11.0f} "
                f"{floor_ms:>9.2f} {r['x_floor']:>7.2f}x")
        if hf is not None:
            hf_ms = _peer_cell(lambda: hf_peer.prefill_ms(hf, T, model.config.vocab_size, args.prefill_repeat,
                                                          args.seed))
            r.update(hf_ms=hf_ms, hf_tok_s=None if hf_ms is None else T / hf_ms * 1e3,
                     hyla_over_hf=None if hf_ms is None else hf_ms / ms)
            line += (f" {_fmt(r['hf_ms'], '10.2f'):>10} {_fmt(r['hf_tok_s'], '13.0f'):>13} "
                     f"{_fmt(r['hyla_over_hf'], '11.2f'):>11}x")
        print(line)
        rows.append(r)
    return rows


def moe_layer(model, args, bw: float, hf=None) -> list[dict]:
    layers = fl.moe_layers(model)
    if not layers:
        print("# --moe-layer: the model has no MoE block")
        return []
    layer = layers[0]
    block = model.get_submodule(layer["prefix"])
    hf_block = None if hf is None else hf_peer.hf_moe_block(hf, layer["prefix"])
    device, H = model.device, model.config.hidden_size
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"# MoE block {layer['prefix']}: {layer['num_experts']} experts x {layer['expert_bytes'] / 1e6:.2f} MB, "
          f"router + shared {layer['other_bytes'] / 1e6:.2f} MB; experts = touched (expected under uniform routing)")
    head = f"{'tokens':>6} {'experts':>12} {'hyla ms':>9} {'floor ms':>9} {'x floor':>8}"
    print(head + ("" if hf_block is None else f" {'transf. ms':>10} {'x floor':>8} {'transf./hyla':>12}"))
    rows = []
    for T in args.moe_tokens:
        x = torch.randn(T, H, generator=gen, device=device, dtype=torch.float32).to(model.dtype)
        with torch.inference_mode():
            touched = block.gate(x)[1].unique().numel()
        expected = fl.expected_distinct_experts(layer["num_experts"], fl.top_k_of(model.config), T)

        def run():
            with torch.inference_mode():
                block(x)
        ms = fl.median_ms(run, args.moe_repeat, warmup=3, device=device)
        floor = fl.moe_block_bytes(model, layer, T) / bw * 1e3
        r = dict(tokens=T, experts_touched=touched, experts_expected=expected, hyla_ms=ms, floor_ms=floor,
                 x_floor=ms / floor)
        line = (f"{r['tokens']:>6} {r['experts_touched']:>5} ({r['experts_expected']:>5.1f}) {r['hyla_ms']:>9.3f} "
                f"{r['floor_ms']:>9.3f} {r['x_floor']:>7.2f}x")
        if hf_block is not None:
            def hf_run():
                with torch.inference_mode():
                    hf_block(x[None])
            hf_ms = _peer_cell(lambda: fl.median_ms(hf_run, args.moe_repeat, warmup=3, device=device))
            r.update(hf_ms=hf_ms, hf_x_floor=None if hf_ms is None else hf_ms / floor,
                     hf_over_hyla=None if hf_ms is None else hf_ms / ms)
            line += (f" {_fmt(r['hf_ms'], '10.3f'):>10} {_fmt(r['hf_x_floor'], '7.2f'):>7}x "
                     f"{_fmt(r['hf_over_hyla'], '11.2f'):>11}x")
        print(line)
        rows.append(r)
    return rows
