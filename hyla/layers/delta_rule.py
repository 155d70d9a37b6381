"""What every short-conv delta-rule layer (KDA, Gated DeltaNet) does with the engine's pools.

Both layers read the same way: project x, run a depthwise causal conv (kernel W, SiLU) over some
of the projections, split the result into q, k, v heads, compute a log-decay g and a write
strength beta, run the delta rule, and map its output back to the hidden size. They differ only
in the projections, the gate and the output, which subclasses provide as hooks:

    project(x [..., hidden]) -> (pre-conv inputs [..., D_i], one per conv, or a PackedConvInput; aux)
    project_prefill(x)       -> project's outputs for a prefill step (step_pre), their layout the
                                same at any row count (default: project)
    convs()                  -> the depthwise nn.Conv1d of each pre-conv input, same order
    heads(ys)                -> q, k [..., H, K], v [..., HV, V] from the SiLU(conv) outputs
                                (one per conv, or one per output part of a PackedConvInput)
    gates(aux)               -> g (log-decay, [..., HV] or [..., HV, K], fp32), beta [..., HV]
    output(o [..., HV, V], aux) -> [..., hidden]
    _chunk / _recurrent     -> the chunk op and the pool-indexed recurrent op

`aux` is whatever `project` computed that the gates and output need (KDA: the low-rank gate
inputs and b; GDN: the z gate and the b / a projections, or at a decode step (x, w_b, w_a) where
its gate kernel projects b and a itself), so no projection runs twice: a tuple; what
`project_prefill` returns holds tensors (or None) with the token dims of x (step_pre splits them).

This class then runs them over whole sequences (`forward`) and over one engine step
(`forward_batch`: varlen chunk prefill with state and conv-window checkpoints, pool-indexed
decode, speculative verify with per-position slots or replay, `commit_replay`). The cache is a
LinearLayerCache: state [num_slots, HV, K, V] and one conv-window pool [num_slots, D_i, W-1] per conv.

Decode fast path (after `prepare_for_inference`, see `PackedLinears`): the layer's projections
from x run as ONE GEMM, `project` returns its pre-conv inputs as a `PackedConvInput` (columns of
that GEMM's output), and the decode step runs all its convs in one launch
(dispatch.causal_conv1d_update_packed) reading those columns in place; `gates` computes g and
beta in one launch (dispatch.kda_gate_beta / gdn_gate_beta) and the output norm is one launch.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from hyla.contract import ForwardBatch, LinearLayerCache
from hyla.ops import dispatch
from hyla.ops.dtypes import work_dtype
from hyla.ops.transfer import stage_long, to_device_long


class PackedLinears:
    """Several nn.Linear over the same input packed into ONE weight [sum out, in] (and bias), so
    that one GEMM computes them all. Each Linear's weight (and bias) is re-pointed to a view of
    the packed tensor: `state_dict()` keeps its names, shapes and values, and in-place updates
    (load_state_dict) reach the packed tensor. `weight()` returns the packed tensor only while
    every Linear still aliases it (e.g. not after `.to()` re-created the parameters) and no
    gradient is wanted; callers fall back to the separate Linears otherwise.

    Weights that already lie one after the other in one tensor (a shared expert's gate and up
    projections, views of the MoE's stacked experts: StackedExperts.stack_shared) are packed in
    place: the packed weight is a view over them, nothing is copied or re-pointed."""

    def __new__(cls, linears):
        fp8 = [hasattr(lin, "weight_scale_inv") for lin in linears]
        if cls is PackedLinears and any(fp8):
            # FP8 block-quantised projections pack by their own rules (same contract); beside
            # projections a checkpoint keeps in the model dtype, each kind packs on its own
            from hyla.layers.fp8_linear import PackedFp8Linears

            return PackedFp8Linears(linears) if all(fp8) else MixedPackedLinears(linears)
        return super().__new__(cls)

    contiguous = True  # the outputs sit side by side in the one GEMM's (PackedFp8Linears may pad)

    def __init__(self, linears):
        self.linears = list(linears)
        ws = [lin.weight for lin in self.linears]
        if len({(w.device, w.dtype, w.shape[1]) for w in ws}) != 1:
            raise ValueError("packed linears need one device, dtype and input size")
        biases = [lin.bias for lin in self.linears]
        has_bias = [b is not None for b in biases]
        if any(has_bias) and not all(has_bias):
            raise ValueError("packed linears must all have a bias or none")
        self.sizes = [w.shape[0] for w in ws]
        adjacent = _adjacent(ws) and (not any(has_bias) or _adjacent(biases))
        with torch.no_grad():
            if adjacent:
                first = ws[0].detach()
                self.packed = first.as_strided((sum(self.sizes), first.shape[1]), first.stride())
                self.packed_bias = (biases[0].detach().as_strided((sum(self.sizes),), (1,))
                                    if any(has_bias) else None)
                return
            self.packed = torch.cat([w.detach() for w in ws], 0)
            self.packed_bias = torch.cat([b.detach() for b in biases], 0) if all(has_bias) and biases else None
        o = 0
        for lin, n in zip(self.linears, self.sizes):
            lin.weight = nn.Parameter(self.packed[o:o + n], requires_grad=lin.weight.requires_grad)
            if self.packed_bias is not None:
                lin.bias = nn.Parameter(self.packed_bias[o:o + n], requires_grad=lin.bias.requires_grad)
            o += n

    def _aliased(self) -> bool:
        o, esz = 0, self.packed.element_size()
        base = self.packed.data_ptr()
        bbase = self.packed_bias.data_ptr() if self.packed_bias is not None else 0
        for lin, n in zip(self.linears, self.sizes):
            w = lin.weight
            if w.data_ptr() != base + o * self.packed.shape[1] * esz or w.shape[0] != n:
                return False
            if self.packed_bias is not None and (lin.bias is None or lin.bias.data_ptr() != bbase + o * esz):
                return False
            o += n
        return True

    def weight(self):
        """(packed weight, packed bias | None), or None: use the separate Linears."""
        if torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in self.linears):
            return None
        return (self.packed, self.packed_bias) if self._aliased() else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [..., in] -> each Linear's output (one GEMM, then views of its columns)."""
        packed = self.weight()
        if packed is None:
            return [lin(x) for lin in self.linears]
        return list(F.linear(x, *packed).split(self.sizes, dim=-1))


class MixedPackedLinears:
    """PackedLinears' contract for FP8 projections beside ones a checkpoint keeps in the model
    dtype (its `modules_to_not_convert`: Qwen3.5's GDN b and a next to an FP8 qkv and z): the FP8
    parts pack into one GEMM (hyla.layers.fp8_linear.PackedFp8Linears), the others into another,
    the outputs in the parts' order. `weight()` is not None while both packs hold; never
    `contiguous` (two GEMMs' outputs)."""

    contiguous = False

    def __init__(self, linears):
        self.linears = list(linears)
        self.sizes = [lin.out_features for lin in self.linears]
        fp8 = [i for i, lin in enumerate(self.linears) if hasattr(lin, "weight_scale_inv")]
        plain = [i for i in range(len(self.linears)) if i not in fp8]
        self.groups = [(idx, PackedLinears([self.linears[i] for i in idx])) for idx in (fp8, plain)]

    def weight(self):
        """(self, None) while each kind's pack holds (the parts still its views), else None."""
        return (self, None) if all(pack.weight() is not None for _, pack in self.groups) else None

    def plain_parts(self) -> list[nn.Module]:
        """The parts kept in the model dtype (their own GEMM), in the parts' order."""
        return [self.linears[i] for i in self.groups[1][0]]

    def __call__(self, x: torch.Tensor, skip_plain: bool = False) -> list[torch.Tensor | None]:
        """x: [..., in] -> each projection's output (one GEMM per kind, or the parts one by one).
        skip_plain: the model-dtype parts' GEMM is not run and their outputs are None (a consumer
        computes them itself: GDN's gate kernel, b and a at a decode step)."""
        out: list[torch.Tensor | None] = [None] * len(self.linears)
        for idx, pack in self.groups[:1] if skip_plain else self.groups:
            for i, y in zip(idx, pack(x)):
                out[i] = y
        return out


def plain_weight(module: nn.Module | None) -> torch.Tensor | None:
    """The weight of a bias-free plain nn.Linear (a projection a fused kernel reads itself: KDA's
    low-rank up-projections, GDN's b and a, Qwen3-Next's shared-expert gate in the routing kernel);
    None for anything else (an FP8 module keeps its own forward)."""
    if type(module) is nn.Linear and module.bias is None:
        return module.weight
    return None


def _adjacent(ts) -> bool:
    """Whether the contiguous tensors ts lie one after the other in one storage."""
    if not all(t.is_contiguous() for t in ts) or len({t.untyped_storage().data_ptr() for t in ts}) != 1:
        return False
    return all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in itertools.pairwise(ts))


class PackedConvInput:
    """A layer's pre-conv inputs as columns of one tensor: conv i's channels are sizes[i] (its
    output parts, e.g. GDN's q / k / v) taken from x's first columns in order, or from columns
    `channels` [sum] when given (a head-interleaved projection)."""

    def __init__(self, x: torch.Tensor, sizes, channels: torch.Tensor | None = None):
        self.x, self.sizes, self.channels = x, [list(p) for p in sizes], channels

    def tensors(self) -> list[torch.Tensor]:
        """One [..., D_i] tensor per conv (gathered / sliced with torch)."""
        xs = self.x.index_select(-1, self.channels) if self.channels is not None else self.x
        out, c0 = [], 0
        for part in self.sizes:
            d = sum(part)
            out.append(xs[..., c0:c0 + d])
            c0 += d
        return out


# A pytree node (its x the one tensor; sizes and channels fixed by the layer), so that a prefill
# step's step_pre tensors can be kept in static buffers (hyla.engine.prefill_graphs).
pytree.register_pytree_node(PackedConvInput, lambda p: ([p.x], (p.sizes, p.channels)),
                            lambda xs, ctx: PackedConvInput(xs[0], *ctx))


def _conv_inputs(pre) -> list[torch.Tensor]:
    return pre.tensors() if isinstance(pre, PackedConvInput) else list(pre)


class ShortConvDeltaRule(nn.Module):
    """x: [B, T, hidden] -> [B, T, hidden] (full sequences), or packed [T_total, hidden] with a
    ForwardBatch and a LinearLayerCache (forward_batch). Subclasses set `conv_kernel_size` and
    implement the hooks listed in the module docstring."""

    conv_kernel_size: int

    # -- hooks ----------------------------------------------------------------------------------

    def project(self, x: torch.Tensor):
        raise NotImplementedError

    def project_prefill(self, x: torch.Tensor):
        """`project` for a prefill step's token-wise part: what it returns must be laid out alike at
        every row count (hyla.engine.prefill_graphs lays out buffers for it once)."""
        return self.project(x)

    def convs(self) -> tuple[nn.Conv1d, ...]:
        raise NotImplementedError

    def heads(self, ys: list[torch.Tensor]):
        raise NotImplementedError

    def gates(self, aux):
        raise NotImplementedError

    def output(self, o: torch.Tensor, aux) -> torch.Tensor:
        raise NotImplementedError

    def _chunk(self, *args, **kwargs):
        raise NotImplementedError

    def _recurrent(self, *args, **kwargs):
        raise NotImplementedError

    # -- full sequences -----------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden] whole sequences from position 0 (no cache) -> [B, T, hidden]."""
        pre, aux = self.project(x)
        ys = [dispatch.causal_conv1d_fn(t, conv.weight, activation="silu")[0]
              for t, conv in zip(_conv_inputs(pre), self.convs())]
        q, k, v = self.heads(ys)
        g, beta = self.gates(aux)
        o, _ = self._chunk(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return self.output(o, aux)

    # -- engine step --------------------------------------------------------------------------

    def forward_batch(self, x: torch.Tensor, batch: ForwardBatch, cache: LinearLayerCache) -> torch.Tensor:
        """x: [T_total, hidden] packed new tokens; batch: ForwardBatch; cache: LinearLayerCache,
        read at batch.state_slots and overwritten with the state after this step's tokens.
        Returns [T_total, hidden]."""
        if batch.is_verify:
            return self._verify(x, batch, cache)
        if batch.is_decode:
            return self._decode(x, batch, cache)
        return self._prefill(x, batch, cache)

    def _verify(self, x: torch.Tensor, batch: ForwardBatch, cache: LinearLayerCache) -> torch.Tensor:
        """Speculative verify: sequence n feeds 1..S tokens starting from the state in slot
        state_slots[n, num_accepted_tokens[n] - 1]. Outputs for every position. Rollback "slots":
        the state and conv windows after its j-th token are written to slot state_slots[n, j], so
        the next step picks the accepted one by index (no copy). Rollback "replay": nothing is
        written; the per-token inputs (k, v, g, beta, pre-conv inputs) are kept on the cache and
        `commit_replay` advances the state by the accepted tokens only."""
        idx, acc = batch.state_slots, batch.num_accepted_tokens
        N, S = idx.shape[0], max(batch.seq_lens)  # S: padded width of the per-sequence token rows
        # [N] slot holding each sequence's state: the same for every layer of the step
        start = batch.shared("verify_start", lambda b: idx.gather(1, (acc - 1)[:, None])[:, 0])
        # Token rows as an [N, S] grid: already so when every sequence brings S tokens (the
        # CUDA-graph runner pads to that), else scattered into a zero-padded grid.
        uniform = batch.uniform_width == S
        dst = idx[:, :S] if batch.rollback == "slots" else None  # [N, S] slot of the window after token j
        if not uniform:
            seq_ids = batch.token_seq_ids()
            offs = torch.arange(batch.num_tokens, device=x.device) - batch.cu_seqlens[:-1][seq_ids]  # [T_total]
            padded = seq_ids * S + offs  # [T_total] row in the [N * S] padded layout
            if dst is not None:  # grid positions past a row's length write nothing
                lens = to_device_long(batch.seq_lens, x.device)  # pinned: no wait for the stream
                dst = torch.where(torch.arange(S, device=x.device)[None, :] < lens[:, None], dst, -1)
        xs = x[None]  # [1, T_total, hidden]
        pre, aux = self.project(xs)
        ys, inputs, windows0 = [], [], []
        for t, pool, conv in zip(_conv_inputs(pre), cache.conv, self.convs()):
            if uniform:
                tp = t[0].view(N, S, -1)  # [N, S, D]
            else:
                tp = t.new_zeros(N * S, t.shape[-1]).index_copy(0, padded, t[0]).view(N, S, -1)
            if batch.rollback == "replay":
                windows0.append(pool[start])  # [N, D, W-1], for commit_replay
            y = dispatch.causal_conv1d_verify(tp, pool, conv.weight, activation="silu", read_indices=start,
                                              write_indices=dst)  # [N, S, D]
            inputs.append(tp)
            ys.append(y.reshape(1, N * S, -1) if uniform else y.flatten(0, 1)[padded][None])  # [1, T_total, D]
        q, k, v = self.heads(ys)
        g, beta = self.gates(aux)
        if batch.rollback == "slots":
            o, _ = self._recurrent(q, k, v, g, beta, initial_state=cache.state, ssm_state_indices=idx,
                                   num_accepted_tokens=acc, cu_seqlens=batch.cu_seqlens,
                                   use_qk_l2norm_in_kernel=True)
        else:
            work = work_dtype(x)
            o, _ = self._recurrent(q, k, v, g, beta, initial_state=cache.state[start].to(work),
                                   cu_seqlens=batch.cu_seqlens, use_qk_l2norm_in_kernel=True)
            cache.replay = dict(k=k, v=v, g=g, beta=beta, inputs=inputs, windows0=windows0, start=start,
                                cu=batch.cu_seqlens)
        return self.output(o, aux)[0]

    def commit_replay(self, cache: LinearLayerCache, accepted: list[int] | torch.Tensor) -> None:
        """After a "replay" verify: advance sequence n's state and conv windows by its first
        accepted[n] verified tokens (1 <= accepted[n] <= its verified tokens).

        accepted: a list, or an int64 tensor [N] on the pools' device. The work has a fixed
        shape (CUDA-graph safe when `accepted` is a tensor): the recurrence re-runs over every
        verified token of the row from the kept state, and only the state after token
        accepted[n] - 1 is written back to the row's slot (the verify kernel's per-position slot
        rows, all -1 but that one); the conv window is cut from [old window | inputs] at that
        offset."""
        r, cache.replay = cache.replay, None
        dev = r["k"].device
        acc = accepted if isinstance(accepted, torch.Tensor) else torch.tensor(accepted, device=dev)
        S = r["inputs"][0].shape[1]
        cols = torch.arange(S, device=dev)
        idx = torch.where(cols[None, :] == (acc - 1)[:, None], r["start"][:, None], -1)  # [N, S]
        self._recurrent(r["k"], r["k"], r["v"], r["g"], r["beta"], initial_state=cache.state,
                        ssm_state_indices=idx, num_accepted_tokens=acc, cu_seqlens=r["cu"],
                        use_qk_l2norm_in_kernel=True)  # outputs unused
        width = self.conv_kernel_size - 1
        for pool, tp, w0 in zip(cache.conv, r["inputs"], r["windows0"]):
            ext = torch.cat([w0, tp.transpose(1, 2).to(w0.dtype)], dim=2)  # [N, D, W-1+S]
            take = acc[:, None] + torch.arange(width, device=dev)  # [N, W-1]
            pool[r["start"]] = ext.gather(2, take[:, None, :].expand(-1, ext.shape[1], -1)).to(pool.dtype)

    def _decode(self, x: torch.Tensor, batch: ForwardBatch, cache: LinearLayerCache) -> torch.Tensor:
        """One new token per sequence: the pool-indexed recurrent path, states updated in place."""
        slots = batch.state_slots
        # A one-token prompt: its slot may hold an old request's state (the CUDA-graph runner
        # zeroes such slots before a replay: its context_lens_list is a placeholder).
        if not batch.cuda_graph and 0 in batch.context_lens_list:
            fresh = slots[~batch.has_context()]
            for t in cache.tensors():
                t[fresh] = 0
        xs = x[:, None]  # [N, 1, hidden]: B = N sequences of one token
        pre, aux = self.project(xs)
        if isinstance(pre, PackedConvInput):  # one launch for all convs, inputs read in place
            ys = dispatch.causal_conv1d_update_packed(pre.x, cache.conv, [c.weight for c in self.convs()], pre.sizes,
                                                      activation="silu", conv_state_indices=slots,
                                                      channels=pre.channels)
        else:
            ys = [
                dispatch.causal_conv1d_update(t, pool, conv.weight, activation="silu", conv_state_indices=slots)
                for t, pool, conv in zip(pre, cache.conv, self.convs())
            ]
        q, k, v = self.heads(ys)  # [N, 1, H, K], v [N, 1, HV, V]
        g, beta = self.gates(aux)
        # dispatched: the Triton kernel on CUDA (no host sync, so CUDA graphs can capture it)
        o, _ = self._recurrent(q, k, v, g, beta, initial_state=cache.state, ssm_state_indices=slots,
                                      use_qk_l2norm_in_kernel=True)
        if checkpoint_positions(batch) is not None:  # p can only be 1: the state after the step
            src = batch.state_slots.tolist()
            for n, pairs in enumerate(batch.checkpoints):
                for _, dest in pairs:
                    for t in cache.tensors():
                        t[dest] = t[src[n]]
        return self.output(o, aux)[:, 0]

    def _prefill_convs(self, inputs: list[torch.Tensor], batch: ForwardBatch, cache: LinearLayerCache,
                       positions) -> list[torch.Tensor]:
        """The convs one by one (inputs [1, T_total, D_i] not columns of one packed GEMM): each
        initial window gathered and masked, causal_conv1d_fn, the checkpoints' and the final
        windows written to the pool."""
        slots, cu, resume = batch.state_slots, batch.cu_seqlens, batch.has_context()
        ys = []
        for t, pool, conv in zip(inputs, cache.conv, self.convs()):
            init = torch.where(resume[:, None, None], pool.index_select(0, slots), 0)  # [N, D, W-1]
            y, final = dispatch.causal_conv1d_fn(t, conv.weight, activation="silu", initial_state=init,
                                                 output_final_state=True, cu_seqlens=cu)
            if positions is not None:
                write_conv_checkpoints(pool, init, t[0], batch)
            pool.index_copy_(0, slots, final.to(pool.dtype))  # the slots are distinct: as pool[slots] = final
            ys.append(y)
        return ys

    def _prefill(self, x: torch.Tensor, batch: ForwardBatch, cache: LinearLayerCache) -> torch.Tensor:
        """Any mix of lengths: the varlen chunk path, states gathered from and scattered to the pool."""
        pre = self.step_pre(x)
        return self.step_post(self.step_core(pre, batch, cache), pre)

    # -- a prefill step in three parts (hyla.models.prefill_program) ----------------------------

    def step_pre(self, x: torch.Tensor):
        """x [T_total, hidden] -> (pre-conv inputs, aux) as `project` gives them, every tensor
        [T_total, ...]: the token-wise part of a prefill step (no pool, no batch)."""
        pre, aux = self.project_prefill(x[None])
        if isinstance(pre, PackedConvInput):
            pre = PackedConvInput(pre.x[0], pre.sizes, pre.channels)
        else:
            pre = [t[0] for t in pre]
        return pre, tuple(None if a is None else a[0] for a in aux)

    def step_core_like(self, pre) -> torch.Tensor:
        """An empty tensor shaped as step_core's output for `pre` (the delta rule's o
        [T_total, HV, V] in the model dtype): what a caller sizes a buffer for."""
        T = _conv_inputs(pre[0])[0].shape[0]
        v = self.heads([t[None, :1] for t in _conv_inputs(pre[0])])[2]  # [1, 1, HV, V]
        return v.new_empty(T, *v.shape[2:])

    def step_core(self, pre, batch: ForwardBatch, cache: LinearLayerCache) -> torch.Tensor:
        """step_pre's tensors -> the delta rule's output o [T_total, HV, V]: the convs (windows
        read from and written to the pools, checkpoints), the gates, the varlen chunk (states
        read from and written to the pool at batch.state_slots, checkpoint states)."""
        conv_in, aux = pre
        slots, cu = batch.state_slots, batch.cu_seqlens
        resume = batch.has_context()  # [N]: sequences without context start from zeros
        positions = checkpoint_positions(batch)
        aux = tuple(None if a is None else a[None] for a in aux)  # [1, T_total, ...], sequences packed along T
        if isinstance(conv_in, PackedConvInput):  # every conv in one op, its windows read and written in the pools
            ys = dispatch.causal_conv1d_prefill_packed(
                conv_in.x[None], cache.conv, [c.weight for c in self.convs()], conv_in.sizes, activation="silu",
                state_indices=slots, has_context=resume, cu_seqlens=cu, channels=conv_in.channels,
                checkpoints=None if positions is None else _checkpoint_table(batch))
        else:
            ys = self._prefill_convs([t[None] for t in conv_in], batch, cache, positions)
        q, k, v = self.heads(ys)  # [1, T_total, H, K], v [1, T_total, HV, V]
        g, beta = self.gates(aux)
        # the chunk op reads each start state from the pool and writes the final one back in place
        # (no gathered copy of the states: they are 2 MB a sequence and layer on the 48B shape)
        out = self._chunk(q, k, v, g, beta, initial_state=cache.state, ssm_state_indices=slots,
                          has_initial_state=resume, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu, checkpoint_positions=positions)
        if positions is not None:  # one write for all of them (checkpoint slots are distinct)
            cache.state.index_copy_(0, _checkpoint_slots(batch), _joined(out[2]).to(cache.state.dtype))
        return out[0][0]

    def step_post(self, o: torch.Tensor, pre) -> torch.Tensor:
        """step_core's o [T_total, HV, V] and step_pre's tensors -> the layer output [T_total, hidden]."""
        aux = tuple(None if a is None else a[None] for a in pre[1])
        return self.output(o[None], aux)[0]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0, without the copy when the parts already tile one contiguous
    block in order (the chunk kernels' checkpoint states: each sequence's a view of their one
    sorted output, ~29 MB a layer for 14 returning turns on the 48B shape)."""
    parts = [t for t in parts if t.shape[0]]
    if len(parts) > 1 and _adjacent(parts):
        first = parts[0]
        return first.as_strided((sum(t.shape[0] for t in parts), *first.shape[1:]), first.stride())
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def checkpoint_positions(batch: ForwardBatch) -> list[list[int]] | None:
    """Per sequence, the token counts p of the batch's checkpoints (None when there are none)."""
    if not batch.checkpoints or not any(batch.checkpoints):
        return None
    return [[p for p, _ in pairs] for pairs in batch.checkpoints]


def write_conv_checkpoints(pool: torch.Tensor, init: torch.Tensor, t: torch.Tensor, batch: ForwardBatch) -> None:
    """The conv window after the first p new tokens of sequence n is columns p .. p+W-2 of
    [its initial window (W-1 columns) ++ its new pre-conv inputs]: every checkpoint's window
    gathered at once (_conv_window_sources) and written with one index_copy_.

    pool: [num_slots, D, W-1]; init: [N, D, W-1]; t: [T_total, D] this step's pre-conv inputs."""
    width = pool.shape[-1]
    from_init, init_rows, input_rows = batch.shared(("conv_window_sources", width),
                                                    lambda b: _conv_window_sources(b, width))
    flat_init = init.transpose(1, 2).reshape(-1, init.shape[1])  # [N * (W-1), D]: row n * (W-1) + column
    cols = torch.where(from_init[:, None], flat_init.index_select(0, init_rows),
                       t.index_select(0, input_rows).to(init.dtype))  # [C * (W-1), D]
    windows = cols.view(-1, width, cols.shape[-1]).transpose(1, 2)  # [C, D, W-1]
    pool.index_copy_(0, _checkpoint_slots(batch), windows.to(pool.dtype))


def _conv_window_sources(batch: ForwardBatch, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For column w of checkpoint (n, p)'s window, in checkpoint order and then w: column j = p + w
    of [initial window ++ new inputs] comes from the initial window (j < W-1: from_init, its row
    n * (W-1) + j of the flattened windows) or from new input row cu[n] + j - (W-1). -> (from_init
    bool, init row, input row), each [C * (W-1)] on the batch's device, in one transfer."""
    cu = batch.cu_seqlens_list
    from_init, init_rows, input_rows = [], [], []
    for n, pairs in enumerate(batch.checkpoints):
        for p, _ in pairs:
            for j in range(p, p + width):
                from_init.append(int(j < width))
                init_rows.append(n * width + min(j, width - 1))
                input_rows.append(cu[n] + max(j - width, 0))
    flags, init_idx, input_idx = stage_long([from_init, init_rows, input_rows], batch.cu_seqlens.device)
    return flags.bool(), init_idx, input_idx


def _checkpoint_table(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, new tokens p, destination slot) of every checkpoint of the step, sequence by
    sequence in its order, each [C] on the batch's device: causal_conv1d_prefill_packed's
    `checkpoints`, and the state checkpoints' slots (one transfer a step, shared by the layers)."""
    def build(b: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = [(n, p, dest) for n, pairs in enumerate(b.checkpoints) for p, dest in pairs]
        seq, count, dest = stage_long([[r[i] for r in rows] for i in range(3)], b.cu_seqlens.device)
        return seq, count, dest
    return batch.shared("checkpoint_table", build)


def _checkpoint_slots(batch: ForwardBatch) -> torch.Tensor:
    """The destination slot of every checkpoint of the step, sequence by sequence in its order [C]."""
    return _checkpoint_table(batch)[2]
