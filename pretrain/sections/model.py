"""The `model` section: shape and numerics. Field names follow Megatron-Core's `TransformerConfig` where one exists.

Each field declares its facts where it is declared (`model_providers/core/knobs.py`): `mcore=` the Megatron-Core
attribute it feeds (`model_providers/core/builder.py` passes every one; derived values are its named functions),
`range=` the values `validate` accepts, `resume=` its rule on resume (every field here must match the checkpoint,
the model's identity, unless it says `resume=NEXT_STEP` or its own rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from model_providers import DEFAULT_FAMILY
from model_providers.core.knobs import (
    CHANGE,
    FP8,
    GPT,
    HYBRID,
    HYBRID_MODEL,
    IDENTITY,
    MIXER,
    MLA,
    MOE,
    MTP,
    NEXT_STEP,
    TC,
    UNUSED,
    YARN,
    Resume,
    knob,
)

SIZE = "set {key} to a positive integer, or null to derive it"  # the fix of a size that null derives
RecomputeModule = Literal["core_attn", "mlp", "layernorm", "moe", "moe_act", "mla_up_proj", "shared_experts"]
Fp8Recipe = Literal["tensorwise", "delayed", "mxfp8", "blockwise"]

# RoPE's frequencies (base, Llama-3 scaling, YaRN): no weight depends on them, so a context extension (a stage,
# docs/training.md "Stages") changes them on resume.
INIT_ONLY = Resume(UNUSED, "the weights come from the checkpoint")  # a value only the initialisation reads
ROPE = Resume(CHANGE, "the positions' frequencies from the resumed step (a context extension; no weight depends on "
                      "them)")


@dataclass
class ModelConfig:
    """Model shape and numerics (see the module docstring)."""

    RESUME = IDENTITY  # a resumed run trains the same model

    preset: str | None = knob(None, resume=Resume(UNUSED, "its fields are compared one by one"))
    family: str = DEFAULT_FAMILY  # a family of model_providers/ (checked when the config is parsed)
    num_layers: int = knob(4, mcore=TC, range=">= 1")
    hidden_size: int = knob(256, mcore=TC, range=">= 1")
    ffn_hidden_size: int | None = knob(None, mcore=TC, range=">= 1", fix=SIZE)  # None: 4 * hidden_size
    num_attention_heads: int = knob(8, mcore=TC, range=">= 1")
    # None: multi-head attention (= num_attention_heads)
    num_query_groups: int | None = knob(None, mcore=TC, range=">= 1", fix=SIZE)
    kv_channels: int | None = knob(None, mcore=TC, range=">= 1", fix=SIZE)  # None: hidden_size // heads
    seq_length: int = knob(256, resume=NEXT_STEP, range=">= 1")  # training sequence length
    # The model's context length (None: seq_length)
    max_position_embeddings: int | None = knob(None, mcore=(GPT.named("max_sequence_length"),
                                                            HYBRID_MODEL.named("max_sequence_length")),
                                               resume=NEXT_STEP, range=">= 1")
    vocab_size: int | None = knob(None, range=">= 1", fix=SIZE)  # None: taken from the tokenizer
    make_vocab_size_divisible_by: int = knob(128, resume=NEXT_STEP, range=">= 1")
    normalization: Literal["RMSNorm", "LayerNorm"] = knob("RMSNorm", mcore=TC)
    layernorm_epsilon: float = knob(1e-5, mcore=TC, range="> 0")
    gated_linear_unit: bool = knob(True, mcore=TC)  # SwiGLU when activation is "silu"
    # quick_gelu: x·sigmoid(1.702x) (GPT-OSS); squared_relu: relu(x)² (Nemotron-H, with gated_linear_unit=false)
    activation: Literal["silu", "gelu", "quick_gelu", "squared_relu"] = knob("silu", mcore=TC.named("activation_func"))
    # GLU (GPT-OSS's clamped SwiGLU, Megatron-Core's names): act(min(gate, c)) · (clamp(up, ±c) + offset).
    glu_linear_offset: float = knob(0.0, mcore=TC, range="finite")
    activation_func_clamp_value: float | None = knob(None, mcore=TC, range="> 0",
                                                     why="the GLU inputs are clamped to it")
    # yarn: YaRN RoPE with model.rotary_scaling_factor, original_max_position_embeddings, beta_fast/slow, mscale*;
    # none: no position encoding (Nemotron-H: order comes from its Mamba layers; hybrid models only).
    position_embedding_type: Literal["rope", "learned_absolute", "yarn", "none"] = knob("rope",
                                                                                       mcore=(GPT, HYBRID_MODEL))
    # YaRN's correction range rounded (GPT-OSS: false, "truncate")
    yarn_correction_range_round_to_int: bool = knob(True, resume=ROPE, mcore=YARN)
    rotary_base: float = knob(10000.0, resume=ROPE, mcore=(MLA, GPT, HYBRID_MODEL), range="> 0")
    rotary_percent: float = knob(1.0, mcore=(MLA, GPT, HYBRID_MODEL), range="(0, 1]",
                                 why="the share of each head RoPE rotates")
    rope_scaling: bool = knob(False, resume=ROPE, mcore=GPT)  # Llama-3 ("llama3") RoPE frequency scaling
    rope_scaling_factor: float = knob(8.0, resume=ROPE, mcore=GPT, range="> 0")
    rope_scaling_low_freq_factor: float = knob(1.0, resume=ROPE, range="> 0")
    rope_scaling_high_freq_factor: float = knob(4.0, resume=ROPE, range="> 0")
    rope_scaling_original_max_position_embeddings: int = knob(8192, resume=ROPE, range=">= 1")
    share_embeddings_and_output_weights: bool = knob(False, mcore=(GPT, HYBRID_MODEL))
    add_bias_linear: bool = knob(False, mcore=TC)
    add_qkv_bias: bool = knob(False, mcore=TC)
    qk_layernorm: bool = knob(False, mcore=TC)  # per-head norm of queries and keys (model.normalization, before RoPE)
    # Attention window: a token sees itself and the sliding_window-1 before it (Megatron-Core: window_size).
    sliding_window: int | None = knob(None, mcore=TC.named("window_size"), range=">= 1",
                                      fix="set {key} to 1 or more, or null (no window: full attention)")
    # Which layers use the window (Megatron-Core's name): None all; N: every N-th layer full; a list: 1 windowed.
    window_attn_skip_freq: int | list[int] | None = knob(
        None, mcore=TC, range=">= 1", why="every N-th layer full",
        fix="use e.g. 2 (alternating windowed and full layers) or null (all windowed)")
    # Attention sinks (Megatron-Core's softmax_type): learnable = one logit per head added to the softmax (GPT-OSS).
    softmax_type: Literal["vanilla", "off-by-one", "learnable"] = knob("vanilla", mcore=TC)
    hidden_dropout: float = knob(0.0, mcore=TC, resume=NEXT_STEP, range="[0, 1)", why="a probability")
    attention_dropout: float = knob(0.0, mcore=TC, resume=NEXT_STEP, range="[0, 1)", why="a probability")
    init_method_std: float = knob(0.02, mcore=TC, range="> 0",
                                  resume=Resume(UNUSED, "the weights come from the checkpoint"))
    apply_residual_connection_post_layernorm: bool = knob(False, mcore=TC)
    # Recompute: None | "selective" | "full"; method "uniform" | "block" for full.
    recompute_granularity: Literal["selective", "full"] | None = knob(None, mcore=TC, resume=NEXT_STEP)
    recompute_method: Literal["uniform", "block"] | None = knob(None, mcore=TC, resume=NEXT_STEP)
    recompute_num_layers: int | None = knob(None, mcore=TC, resume=NEXT_STEP, range=">= 1")
    # Fused SwiGLU / bias-GELU kernels (torch.compile'd): None = on GPU, off on CPU.
    bias_activation_fusion: bool | None = knob(None, mcore=TC, resume=NEXT_STEP)
    # Selective recompute: which submodules (Megatron-Core's names); None: ["core_attn"] (Megatron's default).
    # moe (the whole MoE layer), moe_act (the experts' activation, grouped GEMM only), shared_experts: MoE models
    # only; mla_up_proj (MLA's up-projections and RoPE): multi-latent attention only (pretrain/rules/recompute.py).
    recompute_modules: list[RecomputeModule] | None = knob(None, mcore=TC, resume=NEXT_STEP)
    # Transformer Engine / FP8 (GPU only; validated).
    transformer_impl: Literal["auto", "transformer_engine", "local"] = knob("auto", mcore=TC, resume=NEXT_STEP)
    fp8: Fp8Recipe | None = knob(None, mcore=FP8.named("fp8_recipe"), resume=NEXT_STEP)
    fp8_param_gather: bool = knob(False, mcore=FP8.named("fp8_param"), resume=NEXT_STEP)
    # Mixture of Experts (None: dense). Names follow Megatron-Core's TransformerConfig.
    num_moe_experts: int | None = knob(None, mcore=MOE, range=">= 1")
    moe_ffn_hidden_size: int | None = knob(None, mcore=MOE, range=">= 1")  # one expert's FFN; None: ffn_hidden_size
    moe_router_topk: int = knob(2, mcore=MOE, range=">= 1")
    moe_router_score_function: Literal["softmax", "sigmoid"] = knob("softmax", mcore=MOE)
    # False: softmax over the top-k logits (= softmax over all, renormalised over the top k: Mixtral,
    # Qwen3-MoE with norm_topk_prob); True: softmax over all experts, top-k probabilities not renormalised.
    moe_router_pre_softmax: bool = knob(False, mcore=MOE)
    # None: the activations' dtype
    moe_router_dtype: Literal["fp32", "fp64"] | None = knob("fp32", mcore=MOE, resume=NEXT_STEP)
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = knob(
        "aux_loss", mcore=MOE, resume=NEXT_STEP)
    moe_aux_loss_coeff: float = knob(0.0, mcore=MOE, resume=NEXT_STEP, range=">= 0")
    moe_z_loss_coeff: float | None = knob(None, mcore=MOE, resume=NEXT_STEP, range=">= 0")
    # None: dropless
    moe_expert_capacity_factor: float | None = knob(None, mcore=MOE, resume=NEXT_STEP, range="> 0")
    moe_token_drop_policy: Literal["probs", "position"] = knob("probs", mcore=MOE, resume=NEXT_STEP)
    moe_pad_expert_input_to_capacity: bool = knob(False, mcore=MOE, resume=NEXT_STEP)
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = knob("alltoall", mcore=MOE, resume=NEXT_STEP)
    # None: Transformer Engine grouped GEMM with the TE spec
    moe_grouped_gemm: bool | None = knob(None, mcore=MOE, resume=NEXT_STEP)
    # DeepSeek-V3 class (docs/moe.md): Multi-Latent Attention, DeepSeek routing, dense-first layers, Multi-Token
    # Prediction. Names follow Megatron-Core's MLATransformerConfig / TransformerConfig.
    multi_latent_attention: bool = False  # the builder then makes an MLATransformerConfig
    # None: queries projected directly (HF q_proj); else q_a_proj → norm → q_b_proj
    q_lora_rank: int | None = knob(None, mcore=MLA, range=">= 1")
    kv_lora_rank: int = knob(512, mcore=MLA, range=">= 1")  # the compressed KV width (HF kv_lora_rank)
    qk_head_dim: int = knob(128, mcore=MLA, range=">= 1")  # per-head query/key width without RoPE (HF qk_nope_head_dim)
    # per-head RoPE width, shared by all heads for keys (HF qk_rope_head_dim)
    qk_pos_emb_head_dim: int = knob(64, mcore=MLA, range=">= 1")
    v_head_dim: int = knob(128, mcore=MLA, range=">= 1")
    # MLA's RoPE; yarn: YaRN with the fields below
    rope_type: Literal["rope", "yarn"] = knob("rope", resume=ROPE, mcore=MLA)
    # YaRN (MLA's rope_type=yarn, or position_embedding_type=yarn: Megatron-Core's yarn_* attributes)
    rotary_scaling_factor: float = knob(1.0, resume=ROPE, mcore=(MLA, YARN.named("yarn_rotary_scaling_factor")),
                                        range="> 0")
    original_max_position_embeddings: int = knob(4096, resume=ROPE, range=">= 1", mcore=(
        MLA, YARN.named("yarn_original_max_position_embeddings")))  # YaRN: the pre-extension context
    beta_fast: float = knob(32.0, resume=ROPE, mcore=(MLA, YARN.named("yarn_beta_fast")), range="> 0")
    beta_slow: float = knob(1.0, resume=ROPE, mcore=(MLA, YARN.named("yarn_beta_slow")), range="> 0")
    mscale: float = knob(1.0, resume=ROPE, mcore=(MLA, YARN.named("yarn_mscale")), range=">= 0")
    mscale_all_dim: float = knob(0.0, resume=ROPE, mcore=(MLA, YARN.named("yarn_mscale_all_dim")), range=">= 0")
    # 1: every layer MoE; a list of 0 (dense) / 1 (MoE) per layer
    moe_layer_freq: int | list[int] = knob(1, mcore=MOE, range=">= 1")
    # shared experts' total FFN size (None: none)
    moe_shared_expert_intermediate_size: int | None = knob(None, mcore=MOE, range=">= 1")
    moe_router_num_groups: int | None = knob(None, mcore=MOE, range=">= 1")  # group-limited routing: expert groups
    moe_router_group_topk: int | None = knob(None, mcore=MOE, range=">= 1")  # ... and how many of them a token may use
    # routing weights × this (HF routed_scaling_factor)
    moe_router_topk_scaling_factor: float | None = knob(None, mcore=MOE, range="> 0")
    # aux-loss-free balancing: a per-expert bias on the scores
    moe_router_enable_expert_bias: bool = knob(False, mcore=MOE)
    # ... moved by ± this per step toward balanced load
    moe_router_bias_update_rate: float = knob(1e-3, mcore=MOE, resume=NEXT_STEP, range=">= 0")
    mtp_num_layers: int | None = knob(None, mcore=MTP, range=">= 1")  # Multi-Token Prediction depth (None: off)
    # MTP loss weight (divided over the MTP layers)
    mtp_loss_scaling_factor: float = knob(0.1, mcore=MTP, resume=NEXT_STEP, range=">= 0")
    # Megatron-Core's name for the FP8 recipe, model.fp8's value (e.g. blockwise): either key sets it, both must agree.
    fp8_recipe: Fp8Recipe | None = knob(None, mcore=FP8, resume=NEXT_STEP)
    # ---- Gated DeltaNet layers in a GPTModel (Qwen3-Next / Qwen3.5; docs/moe.md "Qwen3-Next"): Gated DeltaNet
    # linear attention on the layers linear_attention_freq picks, output-gated attention, zero-centred norms, a gated
    # shared expert. Megatron-Core's TransformerConfig names (model_providers/core/linear_attention.py; rules:
    # pretrain/rules/linear_attention.py).
    # Linear-attention layers (None: none)
    experimental_attention_variant: Literal["gated_delta_net"] | None = knob(None, mcore=TC)
    # Which layers are Gated DeltaNet: N = every N-th layer full attention, the rest linear (Qwen's
    # full_attention_interval); a list: 1 linear, 0 full attention, per layer.
    linear_attention_freq: int | list[int] | None = knob(
        None, mcore=TC, range=">= 2", why="every N-th layer is full attention: 1 leaves no linear layer",
        fix="set {key} to 2 or more (e.g. 4: Qwen's full_attention_interval), or a list of 0/1 per layer")
    linear_conv_kernel_dim: int = knob(4, mcore=TC, range=">= 1")  # the causal depthwise convolution's width
    linear_key_head_dim: int = knob(128, mcore=TC, range=">= 1")  # query/key head width of Gated DeltaNet
    linear_value_head_dim: int = knob(128, mcore=TC, range=">= 1")  # value/gate head width
    linear_num_key_heads: int = knob(16, mcore=TC, range=">= 1")  # query/key heads
    linear_num_value_heads: int = knob(32, mcore=TC, range=">= 1")  # value heads (a multiple of the key heads)
    # full attention's output × sigmoid(a gate projected with the queries)
    attention_output_gate: bool = knob(False, mcore=TC)
    layernorm_zero_centered_gamma: bool = knob(False, mcore=TC)  # every norm scales by (1 + weight): weights start at 0
    # the shared expert's output × sigmoid(x · w), w a [1, hidden] weight (models with experts)
    moe_shared_expert_gate: bool = knob(False, mcore=MOE)
    # ---- Hybrid Mamba models (Megatron-Core's MambaModel; family nemotron_h; docs/hybrid.md). Megatron-Core's names;
    # the builder's derived values: model_providers/core/mamba_builder.py `hybrid_fields`.
    # One symbol per layer (num_layers of them): M Mamba-2, * attention, - MLP, E MoE. None: a GPTModel (no Mamba).
    # MambaModel's hybrid_override_pattern on 0.16.1-0.18, hybrid_layer_pattern on 0.19+.
    hybrid_layer_pattern: str | None = knob(None, mcore=HYBRID_MODEL)
    mamba_state_dim: int = knob(128, mcore=HYBRID, range=">= 1")  # SSM state size per group (HF ssm_state_size)
    mamba_head_dim: int = knob(64, mcore=HYBRID, range=">= 1")
    # None: 2 × hidden_size / mamba_head_dim (Megatron-Core's expand=2)
    mamba_num_heads: int | None = knob(None, mcore=HYBRID, range=">= 1", fix=SIZE)
    # B/C groups (HF n_groups); the gated RMSNorm normalises per group
    mamba_num_groups: int = knob(8, mcore=HYBRID, range=">= 1")
    # causal depthwise conv width (HF conv_kernel)
    mamba_conv_kernel: int = knob(4, mcore=MIXER.named("d_conv"), range="[2, 4]",
                                  why="the widths the causal_conv1d CUDA kernel takes")
    # SSD scan chunk (HF chunk_size): the same recurrence, other rounding; a power of 2 (pretrain/rules/hybrid.py)
    mamba_chunk_size: int = knob(128, mcore=MIXER.named("chunk_size"), resume=NEXT_STEP, range=">= 1")
    # initial time steps drawn log-uniformly in [dt_min, dt_max], and at least dt_init_floor (initial values only)
    mamba_dt_min: float = knob(0.001, mcore=MIXER.named("dt_min"), resume=INIT_ONLY, range="> 0")
    mamba_dt_max: float = knob(0.1, mcore=MIXER.named("dt_max"), resume=INIT_ONLY, range="> 0")
    mamba_dt_init_floor: float = knob(1e-4, mcore=MIXER.named("dt_init_floor"), resume=INIT_ONLY, range="> 0")
    # LatentMoE (Nemotron 3 Super): experts run at this width (h → latent → h); Transformer Engine only
    moe_latent_size: int | None = knob(None, mcore=MOE, range=">= 1")
    # The layers of one Multi-Token Prediction depth of a hybrid model (symbols as hybrid_layer_pattern's; Nemotron 3
    # Super: "*E"), repeated model.mtp_num_layers times. Megatron-Core 0.19+ takes it after the pattern, "/"-separated
    # per depth (HybridModel(hybrid_layer_pattern="...|.../*E/*E"), built by mamba_builder.model_fields; HF
    # mtp_hybrid_override_pattern / mtp_layers_block_type). Checked by pretrain/rules/hybrid.py.
    mtp_layer_pattern: str | None = knob(None)
