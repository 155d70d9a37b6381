"""Kimi-Linear's tensor-parallel plan (hyla.parallel.tensor.ShardPlan).

Per rank (N ranks):
- KDA: H / N heads. q/k/v_proj, their short convs, f_b_proj, g_b_proj (or g_proj), b_proj,
  dt_bias [H*K] and A_log [1, 1, H, 1] split by head; f_a_proj / g_a_proj (rank K, shared by all
  heads) and o_norm [K] replicated; o_proj split by its input columns (row-parallel). Each
  rank's state pool holds its heads: [slots, H / N, K, K] and conv windows [slots, H*K / N, W-1].
- MLA: H / N heads. q_proj (or q_b_proj), kv_b_proj split by head; the latent projection
  (q_a_proj, kv_a_proj_with_mqa, their norms) replicated, so every rank caches the full latent
  (as vLLM); o_proj row-parallel (its bias, if any, on rank 0 only).
- MLPs: gate/up column-parallel, down row-parallel (dense, shared experts, and the routed
  experts along their intermediate dim); or, with expert parallelism, E / N whole experts per
  rank and the shared experts still split along their width.
"""

from __future__ import annotations

from hyla.layers.clamped_swiglu import ClampedMLP
from hyla.layers.mlp import MLP
from hyla.layers.moe import MoE, StackedExperts
from hyla.parallel.tensor import ShardPlan, divide, shrink


class KimiShardPlan(ShardPlan):
    shared_field = "num_shared_experts"  # the config field counting the shared experts (GLM-5-Next: n_shared_experts)

    def local_config(self, config):
        n = self.world
        sizes = dict(linear_num_heads=divide(config, "linear_num_heads", n),
                     num_attention_heads=divide(config, "num_attention_heads", n))
        if "dense" in config.mlp_layer_types:
            sizes["intermediate_size"] = divide(config, "intermediate_size", n)
        if "sparse" in config.mlp_layer_types:
            if self.expert_parallel:
                self.local_ep_experts(config.num_experts)
                shared = getattr(config, self.shared_field)
                if (config.moe_intermediate_size * shared) % n:
                    raise ValueError(f"tensor_parallel_size={n} does not divide the shared experts' width, config "
                                     f"fields `moe_intermediate_size` x `{self.shared_field}` "
                                     f"({config.moe_intermediate_size} x {shared})")
            else:
                sizes["moe_intermediate_size"] = divide(config, "moe_intermediate_size", n)
        self.full = config
        return shrink(config, **sizes)

    def rules(self, config):
        mixer = (r"self_attn\.(q_proj|k_proj|v_proj|q_conv1d|k_conv1d|v_conv1d|f_b_proj|g_b_proj|g_proj|b_proj"
                 r"|q_b_proj|kv_b_proj)\.weight$")
        rules = [
            (r"(^|\.)(embed_tokens|lm_head)\.weight$", self.vocab(0)),
            (mixer, self.even(0)),
            (r"self_attn\.dt_bias$", self.even(0)),
            (r"self_attn\.A_log$", lambda shape: self.even(max(range(len(shape)), key=shape.__getitem__))(shape)),
            (r"self_attn\.o_proj\.weight$", self.even(1)),
            (r"self_attn\.o_proj\.bias$", self.rank0_only),
        ]
        if self.expert_parallel:
            rules += [(r"\.experts\.(gate_up_proj|down_proj)$", self.even(0)),  # fused stacks: whole experts
                      (r"\.experts\.\d+\.", lambda shape: None)]  # per-expert pieces: renamed, not cut
        else:
            rules += [(r"\.experts\.gate_up_proj$", self.pieces(1, lambda shape: [shape[1] // 2] * 2)),
                      (r"\.experts\.down_proj$", self.even(2))]
        rules += [(r"\.(gate_proj|up_proj|w1|w3)\.weight$", self.even(0)),
                  (r"\.(down_proj|w2)\.weight$", self.even(1))]
        return rules

    def prepare_family(self, model) -> None:
        """Expert parallel: E / N full-width experts per MoE block, a shared expert of 1/N of the
        width, and the router's choices mapped to this rank's experts."""
        if not self.expert_parallel:
            return
        c = self.full
        for module in model.modules():
            if isinstance(module, MoE):
                module.experts = StackedExperts(c.num_experts // self.world, c.hidden_size, c.moe_intermediate_size,
                                                module.experts.swiglu_limit)
                if module.shared_experts is not None:
                    width = c.moe_intermediate_size * getattr(c, self.shared_field) // self.world
                    limit = module.experts.swiglu_limit
                    module.shared_experts = (MLP(c.hidden_size, width) if limit is None
                                             else ClampedMLP(c.hidden_size, width, limit))
                module.gate.register_forward_hook(self.expert_parallel_hook(c.num_experts))
