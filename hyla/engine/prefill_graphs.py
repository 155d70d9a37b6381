"""Prefill steps with their token-wise spans replayed as CUDA graphs (hyla.models.prefill_program).

A prefill step of a few hundred tokens launches about fifty kernels a layer from Python; their
host time, not the device, bounds it (BENCHMARKS.md, "Prefill steps: host or device"). The spans
of the step (projections, norms, FFN / MoE: everything but the convs, the chunk and the
attention) depend on each token alone, so they can run over a fixed number of rows: the step's
T tokens are padded to a bucket B (16, 24, 32, 48, ... up to `max_tokens`) and each span of that
bucket replays a graph captured once. The cores run eagerly between the spans, over the step's T
rows.

Static buffers (`StaticSpanState`): the token ids, the residual stream and the final hidden
states [max_tokens, ...], and per layer layout (a mixer's step_pre tensors and core output; the
layers of one kind share one set) a buffer per tensor. A span reads and writes the first B rows;
a core reads the first T rows of its step_pre buffers and writes the first T of its output
buffer. Padding rows carry token 0 and core outputs of 0 (rewritten every step), so they stay
finite and route through the MoE like any token; nothing of theirs reaches a real row or a pool.

Graphs are captured for every bucket at startup (`capture_all`), before the engine sizes its
pools from the memory left, and share one memory pool. On the CPU the spans run directly over
the same buffers (no capture): the same rows and padding, which the CPU tests check.
"""

from __future__ import annotations

import logging

import torch
import torch.utils._pytree as pytree

from hyla.contract import ForwardBatch, HybridCache
from hyla.models.prefill_program import PrefillProgram, SpanState, check_prefill

log = logging.getLogger("hyla.engine")


def token_buckets(max_tokens: int) -> list[int]:
    """16, 24, 32, 48, 64, 96, 128, 192 (powers of two and their halfway points), then every
    multiple of 128 from 256 and of 256 from 2,048, up to and including max_tokens. A served
    prefill chunk is often a round size plus a few decode rows (1,024 + 8): with the halfway
    points alone that padded to 1,536 rows, and the padded rows' MoE work cost 2.4 ms of a 12-layer
    step's 24.5 (docs/perf-log/2026-12-06-h100-prefill-graphs.md); now it pads to 1,152."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out = [b for b in (16, 24, 32, 48, 64, 96, 128, 192) if b < max_tokens]
    b = 256
    while b < max_tokens:
        out.append(b)
        b += 128 if b < 2048 else 256
    return out + [max_tokens]


class StaticSpanState(SpanState):
    """A SpanState over static buffers (module docstring). `rows`: the rows spans run over (the
    bucket), set before each replay."""

    def __init__(self, program: PrefillProgram, max_rows: int, device: torch.device):
        super().__init__()
        self.rows = max_rows
        self.ids_buffer = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.layer_layout: list[tuple] = []  # per layer: (tree spec, leaf buffers, core buffer)
        self.core_buffers: list[torch.Tensor] = []  # one per layout (zeroed past a step's rows)
        self._probe(program, max_rows, device)

    def _probe(self, program: PrefillProgram, rows: int, device: torch.device) -> None:
        """Run the spans once eagerly at `rows` rows, cores replaced by zeros shaped as theirs
        (step_core_like), to learn each layer's tensors and allocate the buffers."""
        probe = SpanState(torch.zeros(rows, dtype=torch.long, device=device))
        shared: dict[tuple, tuple] = {}
        for i, layer in enumerate(program.layers):
            program.span(i, probe)
            pre = probe.pre(i)
            leaves, spec = pytree.tree_flatten(pre)
            core = layer.token_mixer.step_core_like(pre).zero_()
            probe.set_core(i, core)
            key = (type(layer.token_mixer), str(spec),
                   tuple(None if t is None else (tuple(t.shape[1:]), t.dtype) for t in leaves),
                   tuple(core.shape[1:]), core.dtype)
            if key not in shared:
                bufs = [None if t is None else torch.zeros(rows, *t.shape[1:], dtype=t.dtype, device=device)
                        for t in leaves]
                shared[key] = (bufs, torch.zeros(rows, *core.shape[1:], dtype=core.dtype, device=device))
                self.core_buffers.append(shared[key][1])
            self.layer_layout.append((spec, *shared[key]))
        program.span(len(program.layers), probe)
        self.residual_buffer = torch.zeros_like(probe.residual())
        self.hidden_buffer = torch.zeros_like(probe.hidden)

    # -- SpanState ------------------------------------------------------------------------------

    def ids(self) -> torch.Tensor:
        return self.ids_buffer[:self.rows]

    def set_pre(self, i: int, pre) -> None:
        _, bufs, _ = self.layer_layout[i]
        for buf, t in zip(bufs, pytree.tree_flatten(pre)[0]):
            if buf is not None:
                buf[:self.rows].copy_(t)

    def pre(self, i: int, rows: int | None = None):
        spec, bufs, _ = self.layer_layout[i]
        n = self.rows if rows is None else rows
        return pytree.tree_unflatten([None if b is None else b[:n] for b in bufs], spec)

    def set_core(self, i: int, out: torch.Tensor) -> None:
        self.layer_layout[i][2][:out.shape[0]].copy_(out)

    def core(self, i: int) -> torch.Tensor:
        return self.layer_layout[i][2][:self.rows]

    def residual(self) -> torch.Tensor:
        return self.residual_buffer[:self.rows]

    def set_residual(self, h: torch.Tensor) -> None:
        self.residual_buffer[:self.rows].copy_(h)

    def set_hidden(self, hidden: torch.Tensor) -> None:
        self.hidden_buffer[:self.rows].copy_(hidden)


class PrefillGraphs:
    """A model's prefill steps of up to `max_tokens` tokens through graphed spans (module
    docstring). `capture`: CUDA graphs (CUDA devices), else the spans run directly."""

    def __init__(self, model, max_tokens: int, buckets: list[int] | None = None):
        self.program = PrefillProgram(model)
        self.device = model.device
        self.buckets = sorted(set(buckets)) if buckets else token_buckets(max_tokens)
        if self.buckets[0] < 1:
            raise ValueError(f"prefill graph buckets must be >= 1 token, got {self.buckets}")
        self.max_tokens = self.buckets[-1]
        self.capture = self.device.type == "cuda"
        with torch.no_grad():  # not inference tensors: a run may come from outside inference mode
            self.state = StaticSpanState(self.program, self.max_tokens, self.device)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def can_run(self, batch: ForwardBatch) -> bool:
        """A prefill step (not a verify, not a pure decode) of at most max_tokens tokens."""
        return 0 < batch.num_tokens <= self.max_tokens and not (batch.is_verify or batch.is_decode)

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    @torch.no_grad()
    def capture_all(self) -> int:
        """Capture every bucket's spans now (largest first: its memory is what the pool keeps)
        -> the number of graphs."""
        if not self.capture:
            return 0
        for b in reversed(self.buckets):
            self._graphs(b)
        return sum(len(g) for g in self.graphs.values())

    def _graphs(self, rows: int) -> list[torch.cuda.CUDAGraph]:
        if rows in self.graphs:
            return self.graphs[rows]
        from hyla.engine.cuda_graph import warmup_stream

        state, program = self.state, self.program
        state.rows = rows
        stream = warmup_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # Triton compiles, cuBLAS picks its kernels: outside the captures
            for i in range(program.num_spans):
                program.span(i, state)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graphs = []
        for i in range(program.num_spans):
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    program.span(i, state)
            except BaseException:
                log.warning("a prefill CUDA graph capture failed: later graphs take a new memory pool")
                self.pool = torch.cuda.graph_pool_handle()
                raise
            graphs.append(graph)
        self.graphs[rows] = graphs
        return graphs

    def _span(self, rows: int, i: int) -> None:
        if self.capture:
            self._graphs(rows)[i].replay()
        else:
            self.program.span(i, self.state)

    def run(self, input_ids: torch.Tensor, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        """input_ids [T] (T = batch.num_tokens <= max_tokens) -> final-norm hidden states [T, hidden]:
        a view of a static buffer, valid until the next run."""
        check_prefill(batch)
        T = batch.num_tokens
        rows = self.bucket(T)
        state = self.state
        if self.capture:
            self._graphs(rows)  # before the buffers are filled: a first capture's warm-up writes them
        state.rows = rows
        state.ids_buffer[T:rows].zero_()
        state.ids_buffer[:T].copy_(input_ids)
        for buf in state.core_buffers:
            buf[T:rows].zero_()
        self._span(rows, 0)
        for i in range(len(self.program.layers)):
            self.program.core(i, state, batch, cache)
            self._span(rows, i + 1)
        return state.hidden_buffer[:T]
