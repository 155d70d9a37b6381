"""Qwen3-Next's (and Qwen3.5's) tensor-parallel plan (hyla.parallel.tensor.ShardPlan).

Per rank (N ranks):
- Gated DeltaNet: H / N key heads with their r value heads each (the GVA ratio r = HV / H is
  kept). in_proj_qkvz / in_proj_ba are head-interleaved per key head, so a rank's part is one
  contiguous block of rows; the short conv's channels are q (all heads) ++ k ++ v, so a rank
  takes 1/N of each of the three pieces; dt_bias / A_log [HV] by value head; the output norm
  [V] replicated; out_proj row-parallel. Qwen3.5's separate in_proj_qkv (conv order, three
  pieces) / in_proj_z / in_proj_b / in_proj_a split the same way.
- Gated attention: H / N query heads (q_proj rows are per head [q, gate]); the Hkv key/value
  heads split when N divides them, else (N a multiple of Hkv) each rank holds the one KV head
  its query heads read, replicated over N / Hkv ranks as vLLM does; q_norm / k_norm
  replicated; o_proj row-parallel.
- MLPs and the MoE: as Kimi-Linear (hyla.parallel.tp_kimi): gate/up column-, down row-parallel;
  routed experts along their width, or whole experts with expert parallelism; the shared expert
  split along its width, its sigmoid gate replicated.
- The MTP head (`mtp.*`, hyla.models.qwen3_5_mtp) is built from the same per-rank config, so its
  one decoder layer splits by the rules above (the names match them); fc and its norms are
  replicated.
"""

from __future__ import annotations

from hyla.layers.moe import StackedExperts
from hyla.layers.qwen_moe import Qwen3NextSparseMoE
from hyla.parallel.tensor import Cut, ShardPlan, divide, shrink


class Qwen3NextShardPlan(ShardPlan):
    def local_config(self, config):
        n = self.world
        kv = config.num_key_value_heads
        if kv % n and n % kv:
            raise ValueError(f"tensor_parallel_size={n} and config field `num_key_value_heads` ({kv}): one must "
                             "divide the other")
        sizes = dict(linear_num_key_heads=divide(config, "linear_num_key_heads", n),
                     linear_num_value_heads=divide(config, "linear_num_value_heads", n),
                     num_attention_heads=divide(config, "num_attention_heads", n),
                     num_key_value_heads=max(1, kv // n))
        if "dense" in config.mlp_layer_types:
            sizes["intermediate_size"] = divide(config, "intermediate_size", n)
        elif getattr(config, "intermediate_size", 0) and config.intermediate_size % n == 0:
            # no dense layer in the target, but an MTP head's layer may be dense: split it too
            sizes["intermediate_size"] = config.intermediate_size // n
        if "sparse" in config.mlp_layer_types:
            sizes["shared_expert_intermediate_size"] = divide(config, "shared_expert_intermediate_size", n)
            if self.expert_parallel:
                self.local_ep_experts(config.num_experts)
            else:
                sizes["moe_intermediate_size"] = divide(config, "moe_intermediate_size", n)
        self.full = config
        return shrink(config, **sizes)

    def _kv_heads(self, shape):
        """k_proj / v_proj rows (or bias): this rank's KV heads, or the one its query heads read."""
        c = self.full
        kv, d = c.num_key_value_heads, c.head_dim
        if kv % self.world == 0:
            return self.even(0)(shape)
        head = self.rank // (self.world // kv)
        return Cut(0, ((head * d, (head + 1) * d),))

    def rules(self, config):
        c = config
        conv = [c.linear_num_key_heads * c.linear_key_head_dim] * 2 + [c.linear_num_value_heads * c.linear_value_head_dim]
        rules = [
            (r"(^|\.)(embed_tokens|lm_head)\.weight$", self.vocab(0)),
            (r"linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_z|in_proj_b|in_proj_a)\.weight$", self.even(0)),
            (r"linear_attn\.(conv1d|in_proj_qkv)\.weight$", self.pieces(0, conv)),
            (r"linear_attn\.(dt_bias|A_log)$", self.even(0)),
            (r"linear_attn\.out_proj\.weight$", self.even(1)),
            (r"self_attn\.q_proj\.(weight|bias)$", self.even(0)),
            (r"self_attn\.(k_proj|v_proj)\.(weight|bias)$", self._kv_heads),
            (r"self_attn\.o_proj\.weight$", self.even(1)),
            (r"self_attn\.o_proj\.bias$", self.rank0_only),
        ]
        if self.expert_parallel:
            rules += [(r"\.experts\.(gate_up_proj|down_proj)$", self.even(0)),
                      (r"\.experts\.\d+\.", lambda shape: None)]
        else:
            rules += [(r"\.experts\.gate_up_proj$", self.pieces(1, lambda shape: [shape[1] // 2] * 2)),
                      (r"\.experts\.down_proj$", self.even(2))]
        rules += [(r"\.(gate_proj|up_proj)\.weight$", self.even(0)),
                  (r"\.down_proj\.weight$", self.even(1))]
        return rules

    def prepare_family(self, model) -> None:
        """Expert parallel: E / N full-width experts per MoE block; the router's choices mapped
        to them (the shared expert is split by the per-rank config already)."""
        if not self.expert_parallel:
            return
        c = self.full
        for module in model.modules():
            if isinstance(module, Qwen3NextSparseMoE):
                module.experts = StackedExperts(c.num_experts // self.world, c.hidden_size, c.moe_intermediate_size)
                module.gate.register_forward_hook(self.expert_parallel_hook(c.num_experts))
