"""The multi-token-prediction head (`mtp.*`) that Qwen3.5 and Qwen3-Next checkpoints ship beside
the model (transformers does not build it; vLLM and SGLang use it as a speculative drafter).

One step at position t reads the target's final-norm hidden state h_t and the embedding of the
token at t + 1 (the model's own `embed_tokens`, shared) and predicts the token at t + 2 through
the model's `lm_head` (shared):

    x = fc(cat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))   fc: [hidden, 2*hidden]
    y = norm(layer(x))            layer: a full-attention decoder layer at position t (RoPE),
                                  its MLP dense or MoE as the checkpoint holds it
    logits = lm_head(y)           y also feeds the next step (k > 1 reuses the same layer)

Every norm is the zero-centred RMSNorm of the family. Tensor names: mtp.fc.weight,
mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight, mtp.layers.{i}.*, mtp.norm.weight.

    head = load_mtp_head(path, model)       # ValueError when the checkpoint has no mtp.* tensors
    y = head(h [T, hidden], next_ids [T], model)                  # whole sequences from position 0
    y = head.forward_batch(h, next_ids, model, batch, kv_cache)   # one engine step, paged KV
"""

from __future__ import annotations

import copy
import os
import re

import torch
from torch import nn

from hyla.contract import ForwardBatch, KVLayerCache
from hyla.layers.norm import ZeroCentredRMSNorm
from hyla.models.config import DENSE, FULL, SPARSE
from hyla.ops import dispatch

PREFIX = "mtp."
_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


class MTPHead(nn.Module):
    """`mtp.*` of a Qwen3-Next-style model: fc, the two pre-fc norms, `num_layers` full-attention
    decoder layers (the model's decoder layer class) and the output norm."""

    def __init__(self, config, decoder_layer_cls: type[nn.Module], num_layers: int = 1, moe: bool = False):
        super().__init__()
        hid = config.hidden_size
        layer_config = copy.copy(config)  # the head's layers: full attention, one MLP kind
        layer_config.layer_types = [FULL] * num_layers
        layer_config.mlp_layer_types = [SPARSE if moe else DENSE] * num_layers
        layer_config.num_hidden_layers = num_layers
        self.fc = nn.Linear(2 * hid, hid, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(hid, config.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(hid, config.rms_norm_eps)
        self.layers = nn.ModuleList(decoder_layer_cls(layer_config, i) for i in range(num_layers))
        self.norm = ZeroCentredRMSNorm(hid, config.rms_norm_eps)

    def _input(self, hidden: torch.Tensor, next_ids: torch.Tensor, model) -> torch.Tensor:
        embed = model.model.embed_tokens
        if type(embed) is nn.Embedding and hidden.dim() == 2 and hidden.dtype == embed.weight.dtype:
            # an engine step (packed rows): gather, both norms and the concatenation as one op
            x = dispatch.mtp_fc_input(next_ids, embed.weight, hidden, self.pre_fc_norm_embedding.weight,
                                      self.pre_fc_norm_hidden.weight, self.pre_fc_norm_hidden.eps)
            return self.fc(x)
        e = self.pre_fc_norm_embedding(embed(next_ids))
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, model, step: int = 0) -> torch.Tensor:
        """hidden: [B, T, hidden] the target's final-norm states at positions 0..T-1; next_ids:
        [B, T] the tokens at 1..T -> [B, T, hidden] final-norm head states (model.compute_logits
        gives the logits of the tokens at 2..T+1). step: which layer (step % num_layers)."""
        layer = self.layers[step % len(self.layers)]
        return self._out(*layer.forward_residual(self._input(hidden, next_ids, model), None))

    def forward_batch(self, hidden: torch.Tensor, next_ids: torch.Tensor, model, batch: ForwardBatch,
                      cache: KVLayerCache, step: int = 0) -> torch.Tensor:
        """hidden: [T_total, hidden], next_ids: [T_total], packed as `batch` describes (positions
        are the target's positions t of the hidden states); cache: the head layer's paged KV
        ([num_pages, page_size, Hkv, head_dim] keys and values) -> [T_total, hidden]."""
        layer = self.layers[step % len(self.layers)]
        return self._out(*layer.forward_residual(self._input(hidden, next_ids, model), None, batch, cache))

    def _out(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """norm(residual + x): the layer's last residual add fused into the output norm."""
        return self.norm.add_forward(x, residual)[0]

    def allocate_kv(self, num_pages: int, page_size: int, device=None, dtype=None) -> KVLayerCache:
        """Zeroed paged KV for the head's attention layer (each layer's keys and values share
        one pool: only one layer runs per step and position)."""
        attn = self.layers[0].self_attn
        w = self.fc.weight
        k, v = (torch.zeros(num_pages, page_size, attn.num_kv_heads, attn.head_dim, dtype=dtype or w.dtype,
                            device=device or w.device) for _ in range(2))
        return KVLayerCache(k, v)


def load_mtp_head(path: str | os.PathLike, model, shard=None) -> MTPHead:
    """The `mtp.*` head of the checkpoint at `path`, for `model` (the target loaded from it: its
    config, dtype, device and decoder layer class). ValueError if the checkpoint holds none, or
    a tensor is missing, unexpected or of the wrong shape.

    shard: the rank's tensor-parallel plan that `model` was loaded with (hyla.parallel.tensor.
    ShardPlan): the head is built from the per-rank config (model.config already is), its layer
    split as the target's attention layers (query / KV heads, o_proj row-parallel, the MLP or
    experts split or distributed) with the same all-reduce hooks, and only this rank's slice of
    each `mtp.*` tensor is read; fc and the norms are replicated."""
    from hyla.models import loader

    path = os.fspath(path)
    files = {name: f for name, f in loader.weight_files(path).items() if name.startswith(PREFIX)}
    if not files:
        raise ValueError(f"the checkpoint at {path} has no multi-token-prediction head (no `mtp.*` tensors): "
                         "speculative method 'mtp' needs one")
    num_layers = 1 + max((int(m[1]) for m in map(_LAYER.match, files) if m), default=-1)
    if num_layers < 1:
        raise ValueError(f"the checkpoint at {path} has `mtp.*` tensors but no `mtp.layers.0.*`")
    moe = any(name.startswith("mtp.layers.0.mlp.experts.") for name in files)
    layer_cls = type(model.model.layers[0])
    with torch.device("meta"):
        head = MTPHead(model.config, layer_cls, num_layers, moe)
        if shard is not None:
            shard.prepare_head(head)
    expected = {PREFIX + name: t.shape for name, t in head.state_dict().items()}
    plan = loader._plan(files, expected, optional=set(), shard=shard)
    head.to(model.dtype)
    for name, t in head.state_dict(keep_vars=True).items():
        if loader._keeps_fp32(name):
            t.data = t.data.float()
    head.to_empty(device=model.device)
    targets = head.state_dict(keep_vars=True)
    from safetensors import safe_open

    with torch.no_grad():
        for file in sorted(set(files.values())):
            with safe_open(file, "pt", device="cpu") as f:
                for name in f.keys():
                    if files.get(name) == file and name in plan:  # not another rank's expert
                        target, index = plan[name]
                        value = f.get_tensor(name) if shard is None else shard.read(name, f)
                        loader._copy_into(targets[target[len(PREFIX):]], index, value)
    head.eval().requires_grad_(False)
    for module in head.modules():
        if module is not head and hasattr(module, "prepare_for_inference"):
            module.prepare_for_inference()
    return head
