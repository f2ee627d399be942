"""Nemotron-H / Nemotron 3 family (NVIDIA Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano / Super): Megatron-Core's
hybrid `MambaModel`.

Layers follow `model.hybrid_layer_pattern`, Megatron-Core's symbols: `M` a Mamba-2 layer (RMSNorm → mixer: fused
in-projection to z, x, B, C, dt; causal depthwise conv (width 4) + silu over x, B, C; the chunked SSD scan with
`mamba_num_groups` groups of B/C shared by the heads, a per-head D skip and the silu(z) gate; RMSNorm by groups;
out-projection), `*` an attention layer (grouped-query attention, no position encoding: Nemotron-H has no RoPE),
`-` an MLP layer (squared-ReLU, not gated), `E` an MoE layer (squared-ReLU experts; a shared expert; the router of
Nemotron 3: sigmoid scores, an expert bias for choosing only (aux-loss-free balancing), top-k weights renormalised
and scaled by `routed_scaling_factor`). Every layer is one residual block; untied embeddings; RMSNorm (eps 1e-5).

Shapes follow Megatron-Bridge's Nemotron-H providers and the released config.json files (docs/hybrid.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from model_providers.core import hybrid
from model_providers.core.family import Family, require
from model_providers.core.mapping import QKV, ConversionError, Copy, ExactCopy, MappingRule, SplitRows, Vocab
from model_providers.core.yarn import refuse as _refuse

# What makes a model a Nemotron-H (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": False, "activation": "squared_relu",
          "position_embedding_type": "none", "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": False,
          "multi_latent_attention": False}
# Nemotron 3's MoE routing (Megatron-Bridge's NemotronHModelProvider).
_ROUTER = {"moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
           "moe_router_enable_expert_bias": True, "moe_router_dtype": "fp32", "moe_router_bias_update_rate": 1e-3,
           "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4}
_COMMON = {"family": "nemotron_h", **_FIXED, "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5,
           "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02, "mamba_conv_kernel": 4,
           "mamba_chunk_size": 128, "mamba_num_groups": 8, "mamba_head_dim": 64, "mamba_state_dim": 128,
           "vocab_size": 131072, "seq_length": 8192}

_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
_SUPER_PATTERN = "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"

PRESETS: dict[str, dict] = {
    # CPU-sized Nemotron 3: one layer of each kind and a second Mamba layer (M*M-ME), 64 wide; 8 Mamba heads of 8 in
    # 2 groups, state 16, chunk 8 (sequence 32 = 4 chunks); 4 heads / 2 KV groups of 16; 4 squared-ReLU experts of 32
    # (top-2) and a shared one of 48, Nemotron 3's router.
    "tiny_nemotron_h": {**_COMMON, **_ROUTER, "num_layers": 6, "hybrid_layer_pattern": "M*M-ME", "hidden_size": 64,
                        "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 16,
                        "mamba_num_heads": 8, "mamba_head_dim": 8, "mamba_num_groups": 2, "mamba_state_dim": 16,
                        "mamba_chunk_size": 8, "num_moe_experts": 4, "moe_ffn_hidden_size": 32,
                        "moe_shared_expert_intermediate_size": 48, "moe_router_topk": 2,
                        "moe_router_topk_scaling_factor": 2.5, "vocab_size": None,
                        "seq_length": 32, "max_position_embeddings": 64},
    # Nemotron 3 Nano 30B-A3B: 52 layers (23 Mamba-2, 23 MoE, 6 attention), 128 experts + 1 shared, top-6.
    "nemotron3_nano": {**_COMMON, **_ROUTER, "num_layers": 52, "hybrid_layer_pattern": _NANO_PATTERN,
                       "hidden_size": 2688, "ffn_hidden_size": 1856, "num_attention_heads": 32, "num_query_groups": 2,
                       "kv_channels": 128, "mamba_num_heads": 64, "num_moe_experts": 128, "moe_ffn_hidden_size": 1856,
                       "moe_shared_expert_intermediate_size": 3712, "moe_router_topk": 6,
                       "moe_router_topk_scaling_factor": 2.5, "max_position_embeddings": 262144},
    # Nemotron 3 Super 120B-A12B: 88 layers (40 Mamba-2, 40 LatentMoE, 8 attention), 512 experts of 2688 at the
    # latent width 1024 (top-22, × 5) + a shared expert of 5376. Its MTP (Megatron-Bridge's recipe: two depths of
    # *E) is model.mtp_num_layers=2 model.mtp_layer_pattern='*E' on Megatron-Core 0.19+, not part of the preset: the
    # count is the decoder's (as transformers' NemotronHForCausalLM, which builds no MTP layer either).
    "nemotron3_super": {**_COMMON, **_ROUTER, "num_layers": 88, "hybrid_layer_pattern": _SUPER_PATTERN,
                        "hidden_size": 4096, "ffn_hidden_size": 2688, "num_attention_heads": 32,
                        "num_query_groups": 2, "kv_channels": 128, "mamba_num_heads": 128, "num_moe_experts": 512,
                        "moe_ffn_hidden_size": 2688, "moe_shared_expert_intermediate_size": 5376,
                        "moe_router_topk": 22, "moe_router_topk_scaling_factor": 5.0, "moe_latent_size": 1024,
                        "max_position_embeddings": 262144},
}


# --------------------------------------------------------------------------------------------------
# The mapping: templates over `{i}` per layer kind (MambaModel stores every layer under its own key,
# `decoder.layers.<i>.`), expanded along the pattern by `NemotronHFamily.mapping_for`. HF names are the released
# checkpoints' (`backbone.`; transformers renames them to `model.` in memory).
# --------------------------------------------------------------------------------------------------

_M = "decoder.layers.{i}."
_L = "backbone.layers.{i}."
_X = _L + "mixer."


def _mamba(m: Any) -> tuple[MappingRule, ...]:
    """A Mamba-2 layer: the in-projection and convolution are stored part by part (z, x, B, C, dt / x, B, C)."""
    proj, conv = tuple(hybrid.in_proj_parts(m).items()), tuple(hybrid.conv_parts(m).items())
    return (Copy(_M + "mixer.in_proj.layer_norm_weight", _L + "norm.weight"),
            SplitRows(_M + "mixer.in_proj.weight", _X + "in_proj.weight", rows=proj),
            SplitRows(_M + "mixer.conv1d.weight", _X + "conv1d.weight", rows=conv),
            SplitRows(_M + "mixer.conv1d.bias", _X + "conv1d.bias", rows=conv),
            *(Copy(_M + f"mixer.{k}", _X + k) for k in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")))


_ATTENTION = (Copy(_M + "self_attention.linear_qkv.layer_norm_weight", _L + "norm.weight"),
              QKV(_M + "self_attention.linear_qkv.weight", (_X + "q_proj.weight", _X + "k_proj.weight",
                                                             _X + "v_proj.weight")),
              Copy(_M + "self_attention.linear_proj.weight", _X + "o_proj.weight"))
_MLP = (Copy(_M + "mlp.linear_fc1.layer_norm_weight", _L + "norm.weight"),
        Copy(_M + "mlp.linear_fc1.weight", _X + "up_proj.weight"),
        Copy(_M + "mlp.linear_fc2.weight", _X + "down_proj.weight"))
_MOE = (Copy(_M + "pre_mlp_layernorm.weight", _L + "norm.weight"),
        Copy(_M + "mlp.router.weight", _X + "gate.weight"),
        ExactCopy(_M + "mlp.router.expert_bias", _X + "gate.e_score_correction_bias"),
        Copy(_M + "mlp.experts.experts.linear_fc1.weight", _X + "experts.{e}.up_proj.weight"),
        Copy(_M + "mlp.experts.experts.linear_fc2.weight", _X + "experts.{e}.down_proj.weight"),
        Copy(_M + "mlp.shared_experts.linear_fc1.weight", _X + "shared_experts.up_proj.weight"),
        Copy(_M + "mlp.shared_experts.linear_fc2.weight", _X + "shared_experts.down_proj.weight"))
_LATENT = (Copy(_M + "mlp.fc1_latent_proj.weight", _X + "fc1_latent_proj.weight"),
           Copy(_M + "mlp.fc2_latent_proj.weight", _X + "fc2_latent_proj.weight"))
_GLOBAL = (Vocab("embedding.word_embeddings.weight", "backbone.embeddings.weight"),
           Copy("decoder.final_norm.weight", "backbone.norm_f.weight"),
           Vocab("output_layer.weight", "lm_head.weight"))
_KINDS = {hybrid.ATTENTION: _ATTENTION, hybrid.MLP: _MLP, hybrid.MOE: _MOE}
# transformers' block types (config.json `layers_block_type`, new and legacy names) ↔ the pattern's symbols.
_BLOCK_TYPES = {"linear_attention": hybrid.MAMBA, "mamba": hybrid.MAMBA, "full_attention": hybrid.ATTENTION,
                "attention": hybrid.ATTENTION, "mlp": hybrid.MLP, "moe": hybrid.MOE}
_HF_BLOCK = {hybrid.MAMBA: "mamba", hybrid.ATTENTION: "attention", hybrid.MLP: "mlp", hybrid.MOE: "moe"}
# Every rule the family can produce (the registry's table; `mapping_for` expands them per model).
MAPPING = (*_GLOBAL, *_ATTENTION, *_MLP, *_MOE, *_LATENT)


class NemotronHFamily(Family):
    """NemotronHForCausalLM both ways. Every `NemotronHConfig` field is mapped or refused (docs/hf.md
    "Nemotron-H"): mapped: vocab_size, hidden_size, layers_block_type (or the legacy hybrid_override_pattern) ↔
    hybrid_layer_pattern, num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings,
    attention_dropout, hidden_dropout, intermediate_size, ssm_state_size, mamba_num_heads, mamba_head_dim, n_groups,
    conv_kernel, chunk_size, time_step_min / max / floor, n_routed_experts, num_experts_per_tok,
    moe_intermediate_size, moe_shared_expert_intermediate_size, routed_scaling_factor, n_group, topk_group,
    moe_latent_size (LatentMoE: Transformer Engine only, pretrain/rules/hybrid.py),
    layer_norm_epsilon, tie_word_embeddings. Refused unless at the value our model computes: attention_bias, mlp_bias,
    use_bias, mamba_proj_bias (false), use_conv_bias (true), mlp_hidden_act (relu2), mamba_hidden_act (silu),
    sliding_window (null), time_step_limit ([0, inf]: Megatron-Core's training scan clamps nothing), norm_topk_prob
    (true), num_nextn_predict_layers (0), residual_in_fp32 (false), layer_norm_epsilon with
    Mamba layers (1e-5: Megatron-Core's gated mixer norm). Kept from the imported config.json, as they decide nothing
    in training: use_cache, num_logits_to_keep, use_mamba_kernels, mamba_ssm_cache_dtype, expand (transformers' mixer
    reads heads × head_dim), n_shared_experts (transformers builds one shared MLP of
    moe_shared_expert_intermediate_size whatever it says), moe_shared_expert_overlap, mtp_layers_block_type (MTP
    refused), output_router_logits, initializer_range, rescale_prenorm_residual, token ids and unknown keys.
    """

    config_class: ClassVar[str] = "NemotronHConfig"

    def mapping_for(self, m: Any) -> tuple[MappingRule, ...]:
        """The rules of model `m`, one per Megatron key, following its layer pattern."""
        rules: list[MappingRule] = list(_GLOBAL)
        for i, kind in enumerate(m.hybrid_layer_pattern or ""):
            layer = _mamba(m) if kind == hybrid.MAMBA else _KINDS[kind]
            if kind == hybrid.MOE and m.moe_latent_size:
                layer = (*layer, *_LATENT)
            rules += [r.at(i, i) for r in layer]
        return tuple(rules)

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any,
                     base: Mapping | None = None) -> Any:
        import transformers

        arch = self.hf_architecture
        self.require_fixed_fields(m)
        if m.mtp_num_layers:
            raise ConversionError(f"model.mtp_num_layers={m.mtp_num_layers} cannot be expressed as {arch}: "
                                  "transformers' NemotronH builds no MTP layer (it drops mtp.* weights on load), so "
                                  "the bridge maps none; export a run without MTP")
        for key, value in (("sliding_window", None), ("softmax_type", "vanilla"),
                           ("moe_router_score_function", "sigmoid"), ("moe_router_pre_softmax", False),
                           ("moe_layer_freq", 1)):
            require(m, key, value, arch)
        if not hybrid.is_hybrid(m):
            raise ConversionError(f"model.hybrid_layer_pattern is null: a {arch} needs one")
        counts = hybrid.counts(m)
        if counts[hybrid.MAMBA] and m.layernorm_epsilon != 1e-5:
            raise ConversionError(f"model.layernorm_epsilon={m.layernorm_epsilon} cannot be expressed as {arch}: "
                                  "its Mamba mixers normalise with layer_norm_epsilon, Megatron-Core's with 1e-5")
        heads = m.num_attention_heads
        kept = {k: v for k, v in (base or {}).items() if k in ("rope_theta",)}
        fields = dict(
            vocab_size=vocab, hidden_size=m.hidden_size, layers_block_type=[_HF_BLOCK[c] for c in
                                                                             m.hybrid_layer_pattern],
            num_attention_heads=heads, num_key_value_heads=m.num_query_groups or heads,
            head_dim=m.kv_channels or m.hidden_size // heads, max_position_embeddings=m.max_position_embeddings
            or m.seq_length, attention_bias=False, attention_dropout=m.attention_dropout, sliding_window=None,
            intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size, mlp_hidden_act="relu2", mlp_bias=False,
            ssm_state_size=m.mamba_state_dim, mamba_num_heads=hybrid.mamba_num_heads(m),
            mamba_head_dim=m.mamba_head_dim, mamba_hidden_act="silu", n_groups=m.mamba_num_groups,
            conv_kernel=m.mamba_conv_kernel, chunk_size=m.mamba_chunk_size, time_step_min=m.mamba_dt_min,
            time_step_max=m.mamba_dt_max, time_step_floor=m.mamba_dt_init_floor, time_step_limit=(0.0, math.inf),
            use_conv_bias=True, mamba_proj_bias=False, use_bias=False, residual_in_fp32=False, norm_topk_prob=True,
            moe_latent_size=m.moe_latent_size, num_nextn_predict_layers=0, layer_norm_epsilon=m.layernorm_epsilon,
            hidden_dropout=m.hidden_dropout, tie_word_embeddings=m.share_embeddings_and_output_weights,
            architectures=[arch], dtype=str(dtype).removeprefix("torch."), **_moe_hf_fields(m, arch))
        return self.hf_config(getattr(transformers, self.config_class), {**kept, **fields}, bos=bos, eos=eos,
                              base=base)

    def config_json(self, hf_cfg: Any) -> dict:
        """transformers' diff dict, with the layer types under their released names."""
        out = hf_cfg.to_diff_dict()
        out["layers_block_type"] = [_HF_BLOCK[_BLOCK_TYPES[t]] for t in hf_cfg.layers_block_type]
        return out

    def from_hf_config(self, cfg: Any) -> dict:
        for key, want, why in (
                ("attention_bias", False, "Nemotron-H's attention has no biases"),
                ("mlp_bias", False, "squared-ReLU MLPs without biases"), ("use_bias", False, "no biases"),
                ("mamba_proj_bias", False, "Megatron-Core's MambaMixer has no projection biases"),
                ("use_conv_bias", True, "Megatron-Core's MambaMixer convolution has a bias"),
                ("mlp_hidden_act", "relu2", "Megatron-Core's squared_relu"),
                ("mamba_hidden_act", "silu", "the mixer's convolution activation is silu"),
                ("sliding_window", None, "full attention only"), ("norm_topk_prob", True,
                 "Megatron-Core renormalises sigmoid top-k weights"),
                ("num_nextn_predict_layers", 0, "transformers' NemotronH builds no MTP layer (it drops mtp.* "
                 "weights on load), so the bridge maps none; model.mtp_num_layers / mtp_layer_pattern train new ones "
                 "on Megatron-Core 0.19+"),
                ("residual_in_fp32", False, "residuals in the model's dtype")):
            _refuse(cfg, key, getattr(cfg, key, want) == want, why)
        limit = tuple(float(x) for x in cfg.time_step_limit)
        _refuse(cfg, "time_step_limit", limit == (0.0, math.inf), "Megatron-Core's training scan clamps no time step")
        pattern = "".join(_BLOCK_TYPES.get(t, "?") for t in cfg.layers_block_type)
        _refuse(cfg, "layers_block_type", "?" not in pattern, f"block types other than {sorted(_BLOCK_TYPES)}")
        if hybrid.MAMBA in pattern:
            _refuse(cfg, "layer_norm_epsilon", float(cfg.layer_norm_epsilon) == 1e-5,
                    "Megatron-Core's Mamba mixer normalises with eps 1e-5")
        experts = cfg.n_routed_experts if hybrid.MOE in pattern else None
        groups, group_topk, topk = cfg.n_group or 1, cfg.topk_group or 1, cfg.num_experts_per_tok
        if experts:
            _refuse(cfg, "n_group", experts % groups == 0, f"{experts} experts split into equal groups")
            _refuse(cfg, "topk_group", groups == group_topk or topk // group_topk == 2,
                    "Megatron-Core ranks groups by their top num_experts_per_tok/topk_group scores, transformers by 2")
        heads = cfg.num_attention_heads
        context = int(cfg.max_position_embeddings)
        moe = {"num_moe_experts": experts, "moe_ffn_hidden_size": cfg.moe_intermediate_size,
               "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
               "moe_router_topk": topk, "moe_router_topk_scaling_factor": float(cfg.routed_scaling_factor),
               "moe_router_num_groups": groups if groups > 1 else None,
               "moe_router_group_topk": group_topk if groups > 1 else None, "moe_latent_size": cfg.moe_latent_size,
               **_ROUTER} if experts else \
            {"num_moe_experts": None}
        return {
            **self.fixed_fields, "family": self.name, "num_layers": len(pattern), "hybrid_layer_pattern": pattern,
            "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.intermediate_size, "num_attention_heads": heads,
            "rotary_base": 10000.0, "rope_scaling": False, "sliding_window": None,  # no RoPE: the defaults stand
            "num_query_groups": cfg.num_key_value_heads or heads,
            "kv_channels": cfg.head_dim if cfg.head_dim * heads != cfg.hidden_size else None,
            "layernorm_epsilon": float(cfg.layer_norm_epsilon),
            "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings), "vocab_size": cfg.vocab_size,
            "max_position_embeddings": context, "seq_length": min(context, 8192),
            "hidden_dropout": float(cfg.hidden_dropout or 0.0),
            "attention_dropout": float(cfg.attention_dropout or 0.0),
            "mamba_state_dim": cfg.ssm_state_size, "mamba_head_dim": cfg.mamba_head_dim,
            "mamba_num_heads": cfg.mamba_num_heads, "mamba_num_groups": cfg.n_groups,
            "mamba_conv_kernel": cfg.conv_kernel, "mamba_chunk_size": cfg.chunk_size,
            "mamba_dt_min": float(cfg.time_step_min), "mamba_dt_max": float(cfg.time_step_max),
            "mamba_dt_init_floor": float(cfg.time_step_floor), **moe,
        }


def _moe_hf_fields(m: Any, arch: str) -> dict:
    """NemotronHConfig's MoE fields of model `m` (none without experts: transformers' defaults or the imported
    config.json's then stand, unused)."""
    if not m.num_moe_experts:
        return {}
    require(m, "moe_router_enable_expert_bias", True, arch)  # transformers' router always has its bias
    if not m.moe_shared_expert_intermediate_size:
        raise ConversionError(f"model.moe_shared_expert_intermediate_size is null: {arch}'s MoE layers always have "
                              "a shared expert")
    groups, group_topk = m.moe_router_num_groups or 1, m.moe_router_group_topk or 1
    if groups > group_topk and m.moe_router_topk // group_topk != 2:
        raise ConversionError(f"model.moe_router_topk={m.moe_router_topk} / moe_router_group_topk={group_topk} != 2: "
                              f"{arch} ranks expert groups by their top-2 scores")
    return dict(n_routed_experts=m.num_moe_experts, num_experts_per_tok=m.moe_router_topk,
                moe_intermediate_size=m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size,
                moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                routed_scaling_factor=float(m.moe_router_topk_scaling_factor or 1.0), n_group=groups,
                topk_group=group_topk)


FAMILY = NemotronHFamily(name="nemotron_h", hf_architecture="NemotronHForCausalLM", hf_model_type="nemotron_h",
                         presets=PRESETS, mapping=MAPPING, fixed_fields=_FIXED)
