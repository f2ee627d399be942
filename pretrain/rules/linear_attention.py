"""Rules of the Qwen3-Next pieces: Gated DeltaNet layers (`model.experimental_attention_variant=gated_delta_net`,
`model.linear_attention_freq`, `model.linear_*`), output-gated attention, the gated shared expert.

What each combines with (docs/moe.md "Qwen3-Next"):
- the layer pattern: an int N (every N-th layer full attention) needs 2 ≤ N ≤ num_layers (1 would leave no linear
  layer, more than num_layers no full-attention layer); a list has one 0/1 per layer;
- heads: value heads a multiple of key heads (each key head serves value_heads / key_heads of them), both split over
  tensor parallelism (Megatron-Core asserts both);
- no context parallelism: Megatron-Core 0.16.1 asserts `context_parallel_size == 1` for Gated DeltaNet; 0.19's head
  all-to-all runs FLA's kernels, and the CPU module (`TorchGatedDeltaNet`) has no CP path;
- MTP builds its layer from the decoder's last layer: that layer must be full attention (as Qwen's are);
- on GPUs with Transformer Engine: the output norm's gradient is summed over tensor parallelism only under sequence
  parallelism (Megatron-Core reduces TE norms marked `sequence_parallel`), and Megatron-Core before 0.19 refuses
  packed documents in Gated DeltaNet (`NotImplementedError`); on CPU our module does both;
- the output gate is not wired to Multi-Latent Attention (Megatron-Core raises); the shared-expert gate gates a
  shared expert.
"""

from __future__ import annotations

from model_providers.core.linear_layers import VARIANT, linear_pattern
from pretrain.config import DataConfig, ModelConfig, ParallelConfig
from pretrain.config_parse import shown
from pretrain.layout import Layout, use_transformer_engine
from pretrain.problems import Report

_V = "model.experimental_attention_variant"


def linear_attention_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, data: DataConfig,
                           lay: Layout | None, te_on_gpu: bool) -> None:
    """The Gated DeltaNet layer pattern, heads, CP, MTP and GPU limits; the attention and shared-expert gates."""
    m = model
    if m.attention_output_gate and m.multi_latent_attention:
        r.error(("model.attention_output_gate", "model.multi_latent_attention"),
                "the attention output gate is not wired to Multi-Latent Attention (Megatron-Core raises "
                "NotImplementedError)", "set model.attention_output_gate=false")
    if m.moe_shared_expert_gate and not (m.num_moe_experts and m.moe_shared_expert_intermediate_size):
        r.error(("model.moe_shared_expert_gate", "model.moe_shared_expert_intermediate_size"),
                "model.moe_shared_expert_gate=true gates a shared expert, but the model has none",
                "set model.moe_shared_expert_intermediate_size (with experts) or model.moe_shared_expert_gate=false")
    if m.experimental_attention_variant != VARIANT:
        if m.linear_attention_freq is not None:
            r.error(("model.linear_attention_freq", _V), "model.linear_attention_freq picks Gated DeltaNet layers, "
                    "but model.experimental_attention_variant is null", f"set {_V}=gated_delta_net or "
                    "model.linear_attention_freq=null")
        return
    _pattern_rules(r, m)
    _head_rules(r, m, parallel.tensor)
    if parallel.context > 1:
        r.error((_V, "parallel.context"), f"Gated DeltaNet layers have no context-parallel path (Megatron-Core 0.16.1 "
                f"asserts context_parallel_size == 1; 0.19's all-to-all runs FLA's CUDA kernels; the CPU module has "
                f"none): parallel.context={parallel.context}", "set parallel.context=1")
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if use_te:
        _gpu_rules(r, parallel, data)


def _pattern_rules(r: Report, m: ModelConfig) -> None:
    freq, layers = m.linear_attention_freq, m.num_layers
    key = "model.linear_attention_freq"
    if freq is None:
        r.error((key, _V), f"{_V}=gated_delta_net needs model.linear_attention_freq (which layers are linear)",
                "set it, e.g. 4: every 4th layer full attention (Qwen's full_attention_interval)")
        return
    if isinstance(freq, int):
        if freq < 2:
            return  # reported by the range rule (the declared range: 2 or more)
        if freq > max(layers, 2):
            r.error((key, "model.num_layers"), f"{key}={freq} does not fit model.num_layers={layers}: every "
                    f"{freq}-th layer is full attention, so it must be 2..{layers} (1: no linear layer; more than "
                    "the layers: no full-attention layer)", f"set {key} to 2..{layers} or a list of 0/1 per layer")
            return
    elif len(freq) != layers or set(freq) - {0, 1}:
        r.error((key, "model.num_layers"), f"{key} as a list needs one 0 (full attention) or 1 (Gated DeltaNet) per "
                f"layer: got {len(freq)} entries {shown(sorted(set(freq)))} for model.num_layers={layers}",
                f"give {layers} entries of 0/1, or an interval")
        return
    if m.mtp_num_layers and linear_pattern(layers, freq)[-1]:
        r.error((key, "model.mtp_num_layers"), "Multi-Token Prediction builds its layer from the last decoder layer, "
                f"which {key}={shown(freq)} makes Gated DeltaNet; Qwen3-Next's MTP layer is full attention",
                "make the last layer full attention (an interval dividing model.num_layers) or drop MTP")


def _head_rules(r: Report, m: ModelConfig, tp: int) -> None:
    nk, nv = m.linear_num_key_heads, m.linear_num_value_heads
    if nk < 1 or nv < 1:
        return  # reported by the range rule (`knob(range=...)`, pretrain/rules/bounds.py)
    if nv % nk:
        r.error(("model.linear_num_value_heads", "model.linear_num_key_heads"),
                f"model.linear_num_value_heads={nv} must be a multiple of model.linear_num_key_heads={nk} (each key "
                "head serves an equal share of the value heads)", "choose value heads = k × key heads")
    if tp > 1 and (nk % tp or nv % tp):
        r.error(("model.linear_num_key_heads", "model.linear_num_value_heads", "parallel.tensor"),
                f"Gated DeltaNet's heads are split over tensor parallelism: model.linear_num_key_heads={nk} and "
                f"model.linear_num_value_heads={nv} must both be divisible by parallel.tensor={tp}",
                "use a tensor-parallel size dividing both")


def _gpu_rules(r: Report, parallel: ParallelConfig, data: DataConfig) -> None:
    from packaging.version import Version

    from pretrain.compat import matrix

    if parallel.tensor > 1 and not parallel.sequence_parallel:
        r.error((_V, "parallel.tensor", "parallel.sequence_parallel"),
                "with Transformer Engine, Megatron-Core sums Gated DeltaNet's output-norm gradient over tensor "
                "parallelism only under sequence parallelism (TE norms marked sequence_parallel); without it each "
                "tensor-parallel rank's norm would drift apart", "set parallel.sequence_parallel=true")
    release = matrix.installed().megatron_core
    if data.reset_attention_mask and release and Version(release) < Version("0.19"):
        r.error((_V, "data.reset_attention_mask"), f"Megatron-Core {release}'s GatedDeltaNet refuses packed documents "
                "(NotImplementedError before 0.19)", "set data.reset_attention_mask=false, or use megatron-core 0.19+")
