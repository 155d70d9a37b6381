"""Tensor parallelism (Megatron style) without rewriting the layers: a per-rank model built from a
per-rank config, a per-rank slice of every checkpoint tensor, and collectives attached as hooks.

Each rank of an N-way group builds its family's model from a config whose head counts and
intermediate sizes are divided by N (the family's plan, hyla/parallel/tp_<family>.py), so every
column-parallel projection, head-split short conv, gate and state pool has its per-rank shape by
construction. Then:

- row-parallel outputs (o_proj / out_proj of the token mixers, the whole MLP / MoE block) are
  all-reduced by a forward hook: one all-reduce per mixer and one per FFN, as Megatron;
- embed_tokens / lm_head become vocab-parallel (VocabParallelEmbedding, VocabParallelLMHead):
  rows [r * s, (r + 1) * s) of the vocabulary on rank r, s = ceil(V / N), the last rank
  zero-padded; the embedding sums its masked lookups with one all-reduce, the head all-gathers
  its logits and drops the padding;
- expert parallelism (`enable_expert_parallel`): rank r holds experts [r * E/N, (r + 1) * E/N)
  at full width; the router stays replicated and a hook on it maps the chosen experts to local
  ids, zeroing the weights of the other ranks' experts (those pairs run on a local expert with
  weight 0: exact, one all-reduce, no all-to-all; the price is each rank processing all M * k
  pairs).

The loader (hyla.models.loader.load_model(..., shard=plan)) asks the plan, for every checkpoint
tensor, which part this rank holds (a Cut: ranges along one dimension, read from the safetensors
slice, so no rank ever materialises a full tensor it does not keep), and whether an expert
belongs to this rank at all (`rename`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Cut:
    """The part of a checkpoint tensor one rank holds: `ranges` ([start, stop) along `dim`,
    concatenated in order), zero-padded to `pad_to` along `dim` when set; `zero`: the rank holds
    zeros of the full shape (a row-parallel bias, added once: on rank 0)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    pad_to: int | None = None
    zero: bool = False

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.zero:
            return tuple(full)
        size = self.pad_to if self.pad_to is not None else sum(b - a for a, b in self.ranges)
        return tuple(size if d == self.dim else n for d, n in enumerate(full))

    def read(self, sl, full: tuple[int, ...]) -> torch.Tensor:
        """sl: a safetensors slice (f.get_slice(name)) of shape `full` -> this rank's tensor."""
        if self.zero:
            return torch.zeros_like(sl[:])
        lead = (slice(None),) * self.dim
        parts = [sl[lead + (slice(a, b),)] for a, b in self.ranges]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        if self.pad_to is not None and t.shape[self.dim] < self.pad_to:
            pad = list(t.shape)
            pad[self.dim] = self.pad_to - t.shape[self.dim]
            t = torch.cat([t, t.new_zeros(pad)], dim=self.dim)
        return t


def divide(config, field: str, world: int, what: str = "tensor_parallel_size") -> int:
    """config.field / world; ValueError naming the field when it does not divide."""
    value = getattr(config, field)
    if value % world:
        raise ValueError(f"{what}={world} does not divide config field `{field}` ({value})")
    return value // world


class ShardPlan:
    """One rank's view of an N-way tensor-parallel model. A family subclasses it with
    `local_config` (the per-rank sizes; ValueError naming the field that N does not divide),
    `rules` ((regex on the checkpoint name, fn(full shape) -> Cut | None) pairs, first match
    wins; no match or None: replicated) and, when it needs to, `prepare_family`."""

    # Modules whose output is a partial sum over ranks (row-parallel): all-reduced by a hook.
    reduce_modules = re.compile(r"layers\.\d+\.(self_attn\.o_proj|linear_attn\.out_proj|mlp|block_sparse_moe)$")

    def __init__(self, rank: int, world: int, group=None, expert_parallel: bool = False):
        self.rank, self.world, self.group = rank, world, group
        self.expert_parallel = expert_parallel
        self._rules: list[tuple[re.Pattern, object]] = []
        self.num_experts = 0  # set by local_config when the model has routed experts (EP)

    # -- family hooks --------------------------------------------------------------------------
    def local_config(self, config):
        raise NotImplementedError

    def rules(self, config) -> list[tuple[str, object]]:
        raise NotImplementedError

    def prepare_family(self, model: nn.Module) -> None:
        pass

    # -- what the loader calls ----------------------------------------------------------------
    def configure(self, config):
        """The per-rank config (also compiles the slicing rules against the full config)."""
        self._rules = [(re.compile(p), fn) for p, fn in self.rules(config)]
        return self.local_config(config)

    def prepare(self, model: nn.Module) -> None:
        """On the meta model built from the per-rank config: vocab-parallel embedding and head,
        expert-parallel routing, the all-reduce hooks."""
        embed = _module_name(model, model.model.embed_tokens)
        vocab, hidden = model.model.embed_tokens.weight.shape
        model.set_submodule(embed, VocabParallelEmbedding(vocab, hidden, self))
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        # by its module path: a family may expose `lm_head` as a read-only property (Kimi K3's
        # language_model.lm_head), which an attribute assignment would shadow, not replace
        model.set_submodule(_module_name(model, model.lm_head), VocabParallelLMHead(vocab, hidden, self))
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        self.prepare_family(model)
        for name, module in model.named_modules():
            if self.reduce_modules.search(name):
                module.register_forward_hook(self._all_reduce_hook)

    def prepare_head(self, head: nn.Module) -> None:
        """On a meta MTP head (hyla.models.qwen3_5_mtp.MTPHead) built from the per-rank config:
        its decoder layer gets what the target's layers got (expert-parallel stacks and routing,
        the all-reduce hooks on o_proj and the MLP / MoE). Its embeddings and lm_head are the
        target's (vocab-parallel already); fc and the norms stay replicated."""
        self.prepare_family(head)
        for name, module in head.named_modules():
            if self.reduce_modules.search(name):
                module.register_forward_hook(self._all_reduce_hook)

    def rename(self, name: str) -> str | None:
        """A checkpoint tensor's name on this rank: per-expert tensors of other ranks' experts
        -> None (not loaded here), this rank's -> their local expert index (expert parallel)."""
        if not self.expert_parallel or not self.num_experts:
            return name
        m = _EXPERT.match(name)
        if m is None:
            return name
        per = self.num_experts // self.world
        e = int(m["e"]) - self.rank * per
        return f"{m['pre']}{e}{m['post']}" if 0 <= e < per else None

    def cut(self, name: str, full: tuple[int, ...]) -> Cut | None:
        for pattern, fn in self._rules:
            if pattern.search(name):
                return fn(full)
        return None

    def shape(self, name: str, full: tuple[int, ...]) -> tuple[int, ...]:
        cut = self.cut(name, full)
        return tuple(full) if cut is None else cut.shape(full)

    def read(self, name: str, f) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` from open safetensors file `f`."""
        sl = f.get_slice(name)
        full = tuple(sl.get_shape())
        cut = self.cut(name, full)
        return f.get_tensor(name) if cut is None else cut.read(sl, full)

    # -- cuts the families use ---------------------------------------------------------------
    def even(self, dim: int):
        """fn(shape) -> this rank's 1/N of `dim` (contiguous; the size must divide)."""
        def fn(shape):
            s = shape[dim] // self.world
            return Cut(dim, ((self.rank * s, (self.rank + 1) * s),))
        return fn

    def pieces(self, dim: int, sizes):
        """fn(shape) -> this rank's 1/N of each consecutive piece of `dim` (sizes: a list, or
        fn(shape) -> list), concatenated: e.g. q ++ k ++ v conv channels, gate ++ up rows."""
        def fn(shape):
            out, off = [], 0
            for p in (sizes(shape) if callable(sizes) else sizes):
                s = p // self.world
                out.append((off + self.rank * s, off + (self.rank + 1) * s))
                off += p
            return Cut(dim, tuple(out))
        return fn

    def vocab(self, dim: int = 0):
        """fn(shape) -> this rank's vocabulary rows [r * s, (r + 1) * s), zero-padded to s."""
        def fn(shape):
            s = -(-shape[dim] // self.world)
            lo, hi = min(self.rank * s, shape[dim]), min((self.rank + 1) * s, shape[dim])
            return Cut(dim, ((lo, hi),), pad_to=s)
        return fn

    def rank0_only(self, shape):
        """A row-parallel bias: rank 0 holds it, the others zeros (the all-reduce adds it once)."""
        return Cut(0, ((0, shape[0]),), zero=self.rank != 0)

    # -- collectives --------------------------------------------------------------------------
    def _all_reduce_hook(self, _module, _inputs, output):
        dist.all_reduce(output, group=self.group)
        return output

    def expert_parallel_hook(self, num_experts: int):
        """A forward hook for a router returning (weights [M, k], ids [M, k]): global expert ids
        -> this rank's local ids (the stacked shared expert, id E, -> E / N), the other ranks'
        experts -> local expert 0 with weight 0."""
        per, lo = num_experts // self.world, self.rank * (num_experts // self.world)

        def hook(_module, _inputs, output):
            weights, ids = output
            local = ids - lo
            own = (local >= 0) & (local < per)
            shared = ids == num_experts
            keep = own | shared
            ids = torch.where(own, local, torch.where(shared, torch.full_like(ids, per), torch.zeros_like(ids)))
            return torch.where(keep, weights, torch.zeros_like(weights)), ids

        return hook

    def local_ep_experts(self, config_experts: int, field: str = "num_experts") -> int:
        self.num_experts = config_experts
        if config_experts % self.world:
            raise ValueError(f"expert parallel over {self.world} ranks does not divide config field `{field}` "
                             f"({config_experts})")
        return config_experts // self.world


_EXPERT = re.compile(r"^(?P<pre>.+\.experts\.)(?P<e>\d+)(?P<post>\..+)$")


def _module_name(root: nn.Module, target: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is target:
            return name
    raise ValueError("module not found in the model")


class VocabParallelEmbedding(nn.Module):
    """Rows [r * s, (r + 1) * s) of an embedding [V, hidden] (weight [s, hidden], the last rank
    zero-padded). ids: [...] int64 -> [..., hidden], the full embedding on every rank (each id's
    row comes from one rank, the others add zeros: exact)."""

    def __init__(self, vocab_size: int, hidden_size: int, plan: ShardPlan):
        super().__init__()
        self.per = -(-vocab_size // plan.world)
        self.start = plan.rank * self.per
        self.group = plan.group
        self.weight = nn.Parameter(torch.empty(self.per, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.per)
        out = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        out = out * mine[..., None].to(out.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """lm_head rows [r * s, (r + 1) * s) (weight [s, hidden]). hidden: [..., hidden] ->
    logits [..., V] on every rank (all-gathered, padding dropped), in the weight's dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, plan: ShardPlan):
        super().__init__()
        self.vocab_size, self.world, self.group = vocab_size, plan.world, plan.group
        self.weight = nn.Parameter(torch.empty(-(-vocab_size // plan.world), hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()  # [..., s]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def shrink(config, **sizes):
    """dataclasses.replace for a config (re-validated by its __post_init__)."""
    return replace(config, **sizes)
