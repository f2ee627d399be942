"""Rules of the GPT-OSS pieces: attention sinks (`model.softmax_type`), biases with experts, the clamped GLU
(`model.glu_linear_offset`, `model.activation_func_clamp_value`) and YaRN RoPE (`position_embedding_type=yarn`).

What each combines with (docs/moe.md, "GPT-OSS"):
- sinks on the local spec: Megatron-Core's `DotProductAttention` (`SoftmaxOne`), TP-split by heads; with CP > 1 or
  packed documents our `ContextParallelAttention` (`all_gather`, `a2a`; its `p2p` ring has no sink term: refused);
  Transformer Engine takes sinks under CP only with `cp_comm_type=a2a` (what Megatron-Bridge's GPT-OSS recipes
  set), and runs them with its fused attention from TE 2.8 on;
- `add_bias_linear` with experts: Megatron-Core asserts expert tensor parallelism 1 ("Bias in Moe is only supported
  when ETP==1");
- the GLU clamp and offset act only on a gated MLP (Megatron-Core ignores them otherwise);
- YaRN: a scaling factor of at least 1 (positive context lengths: their declared ranges); not with MLA (its own
  `rope_type`).
"""

from __future__ import annotations

from pretrain.config import ModelConfig, ParallelConfig
from pretrain.layout import Layout, use_transformer_engine
from pretrain.problems import Report


def sink_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, lay: Layout | None, te_on_gpu: bool) -> None:
    """Attention sinks against context parallelism (per attention implementation) and MLA."""
    m, p = model, parallel
    if m.softmax_type == "vanilla":
        return
    if m.multi_latent_attention:
        r.error(("model.softmax_type", "model.multi_latent_attention"),
                f"model.softmax_type={m.softmax_type} (attention sinks) is not wired to Multi-Latent Attention here",
                "set model.softmax_type=vanilla")
    if p.context <= 1:
        return
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if use_te and p.cp_comm_type != "a2a":
        r.error(("model.softmax_type", "parallel.cp_comm_type"),
                f"Transformer Engine's context-parallel attention takes attention sinks (model.softmax_type="
                f"{m.softmax_type}) only with cp_comm_type a2a, not {p.cp_comm_type}", "set parallel.cp_comm_type=a2a")
    elif not use_te and p.cp_comm_type == "p2p":
        r.error(("model.softmax_type", "parallel.cp_comm_type"),
                f"attention sinks (model.softmax_type={m.softmax_type}) with cp_comm_type=p2p: the CPU ring attention "
                "merges partial results by log-sum-exp with a hand-written backward that has no sink term",
                "set parallel.cp_comm_type=a2a (or all_gather)")


def glu_bias_yarn_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, lay: Layout | None) -> None:
    """Biased experts and expert TP, the GLU clamp and offset, YaRN's fields."""
    m, p = model, parallel
    etp = lay.etp if lay is not None else (p.expert_tensor or p.tensor)
    if m.num_moe_experts and m.add_bias_linear and etp != 1:
        r.error(("model.add_bias_linear", "parallel.expert_tensor"),
                f"experts with biases (model.add_bias_linear=true) need expert tensor parallelism 1 (Megatron-Core "
                f"asserts it); parallel.expert_tensor resolves to {etp}", "set parallel.expert_tensor=1")
    if not m.gated_linear_unit:
        for key in ("glu_linear_offset", "activation_func_clamp_value"):
            if getattr(m, key) not in (0.0, None):
                r.error((f"model.{key}", "model.gated_linear_unit"),
                        f"model.{key}={getattr(m, key)} acts on a gated MLP, but model.gated_linear_unit is false",
                        f"set model.gated_linear_unit=true or model.{key} to its default")
    if m.position_embedding_type != "yarn":
        return
    if 0 < m.rotary_scaling_factor < 1:  # not above 0: the range rule's
        r.error(("model.position_embedding_type", "model.rotary_scaling_factor"),
                f"YaRN needs model.rotary_scaling_factor >= 1, got {m.rotary_scaling_factor}",
                "set the context extension factor, e.g. 32")
