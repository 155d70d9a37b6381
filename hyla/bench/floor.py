"""Memory floors of a decode step and of one MoE block, a prefill's compute floor, and the GPU
timers the benches share.

A decode step of b tokens must read every weight it uses once and the per-request state, so its
floor is bytes / copy bandwidth (`copy_bandwidth`: a device-to-device copy, bytes read + written).
Bytes of one step (`step_bytes`):

- weights: every tensor except the routed experts and the embedding (only the b rows looked up):
  attention / linear-attention projections, norms, routers, shared experts, dense MLPs, lm_head;
- experts: per MoE layer, the expected number of distinct experts b tokens touch under uniform
  top-k routing, E (1 - (1 - k/E)^b) (`expected_distinct_experts`), x bytes of one expert
  (its gate, up and down projections);
- state: each request's recurrent state and conv windows, read and written;
- kv: each request's cached KV (context + 1 tokens) read and the new token's written;
- logits: b x vocab fp32 written.

A prefill of T tokens is bound by compute: its floor is `prefill_flops` / `matmul_rate` (a square
GEMM in the model dtype, measured in the same run).

`moe_block_bytes`: one MoE block over T tokens: distinct experts x expert bytes + shared
expert(s) + router (+ Qwen3-Next's shared-expert gate) + the T activations read and written.
"""

from __future__ import annotations

import statistics
import time

import torch


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """E (1 - (1 - k/E)^b): distinct experts b tokens touch when each picks k of E uniformly
    (each expert is missed by one token with probability 1 - k/E)."""
    if not 1 <= top_k <= num_experts or tokens < 0:
        raise ValueError(f"need 1 <= top_k <= num_experts and tokens >= 0, got {top_k}, {num_experts}, {tokens}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def top_k_of(config) -> int:
    """Experts per token (Kimi `num_experts_per_token`, Qwen3-Next `num_experts_per_tok`)."""
    return getattr(config, "num_experts_per_token", None) or config.num_experts_per_tok


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_routed_expert(name: str) -> bool:
    """A routed expert tensor under either layout: stacked `<moe>.experts.gate_up_proj` /
    `.down_proj`, or per-expert `<moe>.experts.{e}.<proj>.weight` (not the shared expert(s))."""
    return ".experts." in name and ".shared_expert" not in name


def moe_layers(model) -> list[dict]:
    """Per MoE block (a module with `gate` and `experts` children), in layer order: prefix (its
    module name), num_experts, expert_bytes (one routed expert: gate, up and down), other_bytes
    (router, shared expert(s), shared-expert gate)."""
    out = []
    for prefix, module in model.named_modules():
        if getattr(module, "experts", None) is None or not hasattr(module, "gate"):
            continue
        E = model.config.num_experts
        expert_bytes, other_bytes = moe_block_parts(module, E)
        out.append(dict(prefix=prefix, num_experts=E, expert_bytes=expert_bytes, other_bytes=other_bytes))
    return out


def moe_block_parts(block, num_experts: int) -> tuple[int, int]:
    """(bytes of one routed expert, bytes of the rest: router, shared expert(s), their gate) of an
    MoE block, from its own tensors."""
    routed = sum(_nbytes(t) for t in block.experts.state_dict(keep_vars=True).values())
    total = sum(_nbytes(t) for t in block.state_dict(keep_vars=True).values())
    return routed // num_experts, total - routed


def step_bytes(model, batch: int, context: int, state_dtype=torch.float32) -> dict:
    """Fewest bytes one decode step of `batch` requests at `context` cached tokens moves (see
    the module docstring). Keys: weights, experts, state, kv, logits."""
    c = model.config
    emb = model.model.embed_tokens.weight
    seen, weights = set(), 0
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or is_routed_expert(name):
            continue
        seen.add(id(t))
        weights += _nbytes(t)
    tied = model.lm_head.weight is emb
    if not tied:  # the embedding: only the looked-up rows (a tied one is read whole by lm_head)
        weights += batch * c.hidden_size * emb.element_size() - _nbytes(emb)
    experts = 0.0
    for layer in moe_layers(model):
        experts += expected_distinct_experts(layer["num_experts"], top_k_of(c), batch) * layer["expert_bytes"]
    state = 2 * batch * model.state_bytes_per_slot(state_dtype)
    kv = batch * (context + 2) * model.kv_bytes_per_token()
    return dict(weights=weights, experts=experts, state=state, kv=kv, logits=batch * c.vocab_size * 4)


def moe_block_bytes(model, layer: dict, tokens: int) -> float:
    """Fewest bytes one MoE block (`layer` from moe_layers) moves over `tokens` tokens."""
    act = 2 * tokens * model.config.hidden_size * torch.empty((), dtype=model.dtype).element_size()
    distinct = expected_distinct_experts(layer["num_experts"], top_k_of(model.config), tokens)
    return distinct * layer["expert_bytes"] + layer["other_bytes"] + act


class _Clock:
    """CUDA events on a CUDA device, perf_counter (after nothing to wait for) on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def tic(self) -> None:
        if self.cuda:
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def toc_ms(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return (time.perf_counter() - self.t0) * 1e3


def copy_bandwidth(device, nbytes: int = 2 << 30, repeat: int = 20) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read + written (median)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), repeat, device=device, warmup=3)
    del src, dst
    return 2 * nbytes / (ms / 1e3)


def matmul_rate(device, dtype: torch.dtype, n: int | None = None, repeat: int = 10) -> float:
    """FLOP/s of one square GEMM [n, n] x [n, n] in dtype on device (median; n 8192 on CUDA, 1024
    elsewhere): the rate a prefill's compute floor divides by (`prefill_flops`)."""
    n = n or (8192 if torch.device(device).type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    ms = median_ms(lambda: torch.mm(a, b), repeat, device=device, warmup=3)
    del a, b
    return 2 * n ** 3 / (ms / 1e3)


def prefill_flops(model, tokens: int) -> dict:
    """FLOPs of one fresh prompt of `tokens` tokens -> {"matmul", "attention", "per_token_params"}.

    matmul: 2 FLOPs per token for every weight a token multiplies: every tensor of two or more
    dimensions but the embedding and lm_head (a prefill computes one row's logits) and FP8 scales;
    a routed expert's at top_k / E of its elements (what a token's k experts hold on average);
    MXFP4 bytes count two weights each. attention: causal softmax attention of each MLA layer
    (expanded: QK^T over nope + rope, PV over v) and gated attention layer, T^2 / 2 query-key pairs
    x 2 FLOPs x heads x (key + value width). The linear-attention layers' chunk math (a few
    percent of a released shape's prefill) and sparse attention are not counted."""
    from hyla.layers.attention import GatedAttention
    from hyla.layers.mla import MLAAttention

    c = model.config
    routed_share = top_k_of(c) / c.num_experts if getattr(c, "num_experts", 0) else 1.0
    params = 0.0
    for name, t in model.state_dict().items():
        if t.dim() < 2 or "embed_tokens" in name or name.startswith("lm_head") or "scale" in name:
            continue
        n = t.numel() * (2 if t.dtype == torch.uint8 else 1)
        params += n * routed_share if is_routed_expert(name) else n
    attention = 0.0
    for module in model.modules():
        if isinstance(module, MLAAttention):
            attention += tokens ** 2 * module.num_heads * (module.nope + module.rope + module.v_dim)
        elif isinstance(module, GatedAttention):
            attention += tokens ** 2 * module.num_heads * 2 * module.head_dim
    return {"matmul": 2.0 * params * tokens, "attention": attention, "per_token_params": params}


def time_ms(fn, repeat: int, warmup: int = 3, device="cuda") -> float:
    """Mean ms of `repeat` back-to-back calls of fn (one clock around the whole run)."""
    clock = _Clock(device)
    for _ in range(warmup):
        fn()
    clock.sync()
    clock.tic()
    for _ in range(repeat):
        fn()
    return clock.toc_ms() / repeat


def median_ms(fn, repeat: int, setup=None, warmup: int = 1, device="cuda") -> float:
    """Median ms of `repeat` calls of fn, each timed alone (CUDA events on CUDA); `setup()`
    (untimed) runs before each call, e.g. to restore a cache."""
    clock = _Clock(device)
    times = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        clock.sync()
        clock.tic()
        fn()
        ms = clock.toc_ms()
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)
def kernel_times(fn) -> list[tuple[float, int, str]]:
    """The GPU kernels of one synced call of fn, by the profiler: (self time us, launches, name)
    per kernel, most time first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted(((k.self_device_time_total, k.count, k.key) for k in prof.key_averages()
                   if k.device_type == DeviceType.CUDA), reverse=True)


def describe_kernels(rows: list[tuple[float, int, str]], top: int = 8) -> str:
    """kernel_times' rows -> kernel count, summed kernel time and the `top` costliest kernels."""
    lines = [f"{sum(r[1] for r in rows)} kernels, {sum(r[0] for r in rows) / 1e3:.3f} ms of kernel time"]
    lines += [f"  {us / 1e3:7.3f} ms {n:5d}x {name[:90]}" for us, n, name in rows[:top]]
    return "\n# ".join(lines)


def kernel_profile(fn, top: int = 8) -> str:
    """What one call runs on the GPU (what a CUDA graph replays): describe_kernels of its
    kernel_times (a hint, not a result: n/a if the profiler is absent)."""
    try:
        rows = kernel_times(fn)
    except Exception as err:  # noqa: BLE001
        return f"n/a ({type(err).__name__}: {err})"
    return describe_kernels(rows, top)


