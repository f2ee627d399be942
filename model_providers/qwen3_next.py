"""Qwen3-Next family (Qwen3-Next-80B-A3B): Gated DeltaNet linear attention on three layers of four, output-gated full
attention with partial RoPE on the fourth, zero-centred RMSNorms, and in every layer an MoE of top-k routed SwiGLU
experts plus one shared expert behind a sigmoid gate; a Multi-Token Prediction layer. Every piece is a Megatron-Core
option or module: `experimental_attention_variant="gated_delta_net"` with `linear_attention_freq` (Qwen's
`full_attention_interval`), `attention_output_gate`, `rotary_percent`, `layernorm_zero_centered_gamma`,
`moe_shared_expert_gate`, `mtp_num_layers`; on CPU the Gated DeltaNet is `model_providers/core/linear_attention.py`.

HF `Qwen3NextForCausalLM` ↔ ours (docs/hf.md "Qwen3-Next"): per layer, `linear_attn.in_proj_qkvz` + `in_proj_ba`
(grouped per key head) ↔ `self_attention.in_proj` ([q; k; v; z; b; a]), `conv1d`, `A_log`, `dt_bias`, `out_proj`
as they are, the gated output norm `linear_attn.norm` (plain weight) ↔ `out_norm` (zero-centred: HF − 1); the
attention's `q_proj` (query and gate per head) + `k_proj` + `v_proj` ↔ the gated `linear_qkv`; the other norms are
zero-centred on both sides (copied). The MTP layer as released checkpoints keep it (`mtp.fc`, `mtp.pre_fc_norm_*`,
`mtp.norm`, `mtp.layers.0.*`: a full-attention MoE layer); transformers builds none. Routing: softmax over all
experts, top k, renormalised (`norm_topk_prob`) = Megatron's softmax over the top-k logits. Shapes follow the released
config.json and Megatron-Bridge's `Qwen3NextModelProvider80B_A3B`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from model_providers.core.family import Family, require, shape
from model_providers.core.linear_layers import linear_pattern
from model_providers.core.mapping import (
    ConversionError,
    Copy,
    GatedQKV,
    GateUp,
    GDNInProj,
    ShiftedNorm,
    SplitRows,
    Vocab,
)
from model_providers.core.yarn import refuse as _refuse
from model_providers.llama import ROTARY_BUFFERS

# What makes a model a Qwen3-Next (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
          "position_embedding_type": "rope", "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": True,
          "experimental_attention_variant": "gated_delta_net", "attention_output_gate": True,
          "layernorm_zero_centered_gamma": True, "moe_shared_expert_gate": True, "moe_router_score_function": "softmax",
          "multi_latent_attention": False}
_COMMON = {"family": "qwen3_next", **_FIXED, "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0,
           "attention_dropout": 0.0, "layernorm_epsilon": 1e-6, "rotary_base": 1e7, "rotary_percent": 0.25,
           "kv_channels": 256, "linear_attention_freq": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
           "moe_router_pre_softmax": False, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.001,
           "moe_router_dtype": "fp32", "vocab_size": 151936, "seq_length": 4096, "max_position_embeddings": 262144}

PRESETS: dict[str, dict] = {
    # CPU-sized Qwen3-Next: 4 layers alternating Gated DeltaNet (1, 3) and gated full attention (2, 4: the last layer
    # full, as MTP needs); GDN 2 key / 4 value heads of 16; attention 4 heads / 2 groups of 32 with RoPE on 8
    # dimensions; 4 experts of 32 (top-2) and a gated shared expert of 32; zero-centred norms; sequence 128 (two
    # 64-token chunks of the delta rule).
    "tiny_qwen3_next": shape(_COMMON, 4, 64, 128, 4, 2, kv_channels=32, linear_attention_freq=2,
                             linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, num_moe_experts=4, moe_ffn_hidden_size=32,
                             moe_shared_expert_intermediate_size=32, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                             seq_length=128, vocab_size=None, max_position_embeddings=None, rotary_base=10000.0),
    # Qwen3-Next-80B-A3B (Base / Instruct / Thinking): 48 layers (12 full attention), 512 experts top-10 + 1 shared,
    # MTP depth 1.
    "qwen3_next_80b_a3b": shape(_COMMON, 48, 2048, 5120, 16, 2, num_moe_experts=512, moe_ffn_hidden_size=512,
                                moe_shared_expert_intermediate_size=512, moe_router_topk=10, mtp_num_layers=1),
}

_M = "decoder.layers.{i}."
_L = "model.layers.{i}."
_A, _G = _L + "self_attn.", _L + "linear_attn."


def _attention(prefix: str, hf: str) -> tuple:
    a = hf + "self_attn."
    return (Copy(prefix + "self_attention.linear_qkv.layer_norm_weight", hf + "input_layernorm.weight"),
            GatedQKV(prefix + "self_attention.linear_qkv.weight", (a + "q_proj.weight", a + "k_proj.weight",
                                                                   a + "v_proj.weight")),
            Copy(prefix + "self_attention.q_layernorm.weight", a + "q_norm.weight"),
            Copy(prefix + "self_attention.k_layernorm.weight", a + "k_norm.weight"),
            Copy(prefix + "self_attention.linear_proj.weight", a + "o_proj.weight"))


def _gdn(m: Any, grouped: bool) -> tuple:
    """Gated DeltaNet's rules (Qwen3-Next: the grouped in_proj_qkvz / in_proj_ba; Qwen3.5: four flat projections)."""
    p, g = _M + "self_attention.", _G
    hf_in = (g + "in_proj_qkvz.weight", g + "in_proj_ba.weight") if grouped else \
        (g + "in_proj_qkv.weight", g + "in_proj_z.weight", g + "in_proj_b.weight", g + "in_proj_a.weight")
    qk, v = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    return (Copy(p + "in_proj.layer_norm_weight", _L + "input_layernorm.weight"),
            GDNInProj(p + "in_proj.weight", hf_in, key_heads=m.linear_num_key_heads,
                      value_heads=m.linear_num_value_heads, key_dim=m.linear_key_head_dim,
                      value_dim=m.linear_value_head_dim, grouped=grouped),
            SplitRows(p + "conv1d.weight", g + "conv1d.weight", rows=(("query", qk), ("key", qk), ("value", v))),
            Copy(p + "A_log", g + "A_log"),
            Copy(p + "dt_bias", g + "dt_bias"), ShiftedNorm(p + "out_norm.weight", g + "norm.weight"),
            Copy(p + "out_proj.weight", g + "out_proj.weight"))


def _moe(prefix: str, hf: str) -> tuple:
    e, s = hf + "mlp.experts.{e}.", hf + "mlp.shared_expert."
    return (Copy(prefix + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
            Copy(prefix + "mlp.router.weight", hf + "mlp.gate.weight"),
            GateUp(prefix + "mlp.experts.experts.linear_fc1.weight", (e + "gate_proj.weight", e + "up_proj.weight")),
            Copy(prefix + "mlp.experts.experts.linear_fc2.weight", e + "down_proj.weight"),
            GateUp(prefix + "mlp.shared_experts.linear_fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight")),
            Copy(prefix + "mlp.shared_experts.linear_fc2.weight", s + "down_proj.weight"),
            Copy(prefix + "mlp.shared_experts.gate_weight", hf + "mlp.shared_expert_gate.weight"))


def _dense(prefix: str, hf: str) -> tuple:
    return (Copy(prefix + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight"),
            GateUp(prefix + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")),
            Copy(prefix + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight"))


def _mtp() -> tuple:
    """The MTP layer (`mtp.layers.0.`) as Qwen3-Next checkpoints store it: one projection and three norms around one
    full-attention MoE layer; the embedding and output head are the model's."""
    p, t, h = "mtp.layers.{i}.", "mtp.layers.{i}.transformer_layer.", "mtp.layers.{i}."
    return (Copy(p + "eh_proj.weight", "mtp.fc.weight"), Copy(p + "enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
            Copy(p + "hnorm.weight", "mtp.pre_fc_norm_hidden.weight"), Copy(p + "final_layernorm.weight",
                                                                            "mtp.norm.weight"),
            *_attention(t, h), *_moe(t, h))


_GLOBAL = (Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
           Copy("decoder.final_layernorm.weight", "model.norm.weight"),
           Vocab("output_layer.weight", "lm_head.weight"))


class Qwen3NextFamily(Family):
    """Qwen3NextForCausalLM both ways. Every `Qwen3NextConfig` field is mapped or refused (docs/hf.md "Qwen3-Next"):

    num_hidden_layers, hidden_size, intermediate_size (the dense layers' FFN), num_attention_heads,
    num_key_value_heads, head_dim, vocab_size, max_position_embeddings, rms_norm_eps, attention_dropout,
    tie_word_embeddings: the model fields of those meanings; rope_parameters: rope_theta → rotary_base,
    partial_rotary_factor → rotary_percent, rope_type default only; layer_types (or full_attention_interval) →
    linear_attention_freq (N when every N-th layer is full attention, else a 1/0 list); linear_conv_kernel_dim,
    linear_key_head_dim, linear_value_head_dim, linear_num_key_heads, linear_num_value_heads: the same names;
    num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size (> 0), norm_topk_prob
    (= not moe_router_pre_softmax), router_aux_loss_coef (moe_aux_loss_coeff, aux_loss balancing), decoder_sparse_step
    and mlp_only_layers (→ moe_layer_freq); hidden_act: silu only; attention_bias: false only; mtp_num_hidden_layers
    (config.json only): 0 or 1 (→ mtp_num_layers); mtp_use_dedicated_embeddings: false only. initializer_range,
    use_cache, output_router_logits, token ids and unknown keys come from the imported config.json.
    """

    config_class: ClassVar[str] = "Qwen3NextConfig"
    grouped_in_proj: ClassVar[bool] = True  # in_proj_qkvz / in_proj_ba (Qwen3.5: four flat projections)
    has_dense_layers: ClassVar[bool] = True  # decoder_sparse_step / mlp_only_layers exist (not in Qwen3.5-MoE)

    # ---- the mapping ----------------------------------------------------------------------------------

    def mapping_for(self, m: Any) -> tuple:
        linear, moe = linear_pattern(m.num_layers, m.linear_attention_freq), _moe_pattern(m)
        rules: list = list(_GLOBAL)
        for i in range(m.num_layers):
            mixer = _gdn(m, self.grouped_in_proj) if linear[i] else _attention(_M, _L)
            mlp = _moe(_M, _L) if moe[i] else _dense(_M, _L)
            rules += [r.at(i, i) for r in (*mixer, *mlp)]
        if m.mtp_num_layers:
            rules += [r.at(0, 0) for r in _mtp()]
        return tuple(rules)

    def hf_shapes(self, hf_cfg: Any) -> dict[str, tuple[int, ...]]:
        """transformers' tensors plus the MTP layer it does not build (a full-attention MoE layer's shapes, the
        projection and three norms), as released checkpoints store it."""
        shapes = super().hf_shapes(hf_cfg)
        if _mtp_layers(hf_cfg):
            h = hf_cfg.hidden_size
            full = next(i for i, t in enumerate(hf_cfg.layer_types) if t == "full_attention")
            moe = next(i for i in range(hf_cfg.num_hidden_layers) if f"model.layers.{i}.mlp.gate.weight" in shapes)
            for i, part in ((full, ("input_layernorm.", "self_attn.")), (moe, ("post_attention_layernorm.", "mlp."))):
                src = f"model.layers.{i}."
                shapes.update({"mtp.layers.0." + k[len(src):]: v for k, v in list(shapes.items())
                               if k.startswith(src) and k[len(src):].startswith(part)})
            shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)})
        return shapes

    def config_for_weights(self, hf_cfg: Any, names: Callable[[], set[str]]) -> tuple[Any, str | None]:
        """Without MTP tensors (transformers' `save_pretrained` drops them) the model is imported without MTP."""
        mtp = _mtp_layers(hf_cfg)
        if not mtp or any(n.startswith("mtp.") for n in names()):
            return hf_cfg, None
        out = copy.deepcopy(hf_cfg)
        out.mtp_num_hidden_layers = 0
        return out, (f"config.json: mtp_num_hidden_layers={mtp} but the weights have no MTP layer (mtp.*; "
                     "transformers' save_pretrained leaves it out): imported without MTP (model.mtp_num_layers=1 "
                     "trains a new one)")

    # ---- HF config both ways --------------------------------------------------------------------------

    def hf_extra(self, m: Any) -> dict:
        """The config kwargs Qwen3.5-MoE's class does not have (its layers are all MoE, always renormalised)."""
        moe = _moe_pattern(m)
        return {"intermediate_size": m.ffn_hidden_size or 4 * m.hidden_size, "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, x in enumerate(moe) if not x],
                "norm_topk_prob": not m.moe_router_pre_softmax}

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any,
                     base: Mapping | None = None) -> Any:
        import transformers

        arch = self.hf_architecture
        self.require_fixed_fields(m)
        for key, value in (("sliding_window", None), ("rope_scaling", False), ("softmax_type", "vanilla"),
                           ("moe_router_num_groups", None), ("moe_router_topk_scaling_factor", None),
                           ("moe_router_enable_expert_bias", False), ("glu_linear_offset", 0.0),
                           ("activation_func_clamp_value", None)):
            require(m, key, value, arch)
        if m.num_moe_experts is None or not m.moe_shared_expert_intermediate_size:
            raise ConversionError(f"model.num_moe_experts and model.moe_shared_expert_intermediate_size are needed: a "
                                  f"{arch} has routed experts and a shared expert")
        if (m.mtp_num_layers or 0) > 1:
            raise ConversionError(f"model.mtp_num_layers={m.mtp_num_layers} cannot be expressed as {arch} (one MTP "
                                  "layer)")
        linear = linear_pattern(m.num_layers, m.linear_attention_freq)
        heads = m.num_attention_heads
        fields = dict(
            vocab_size=vocab, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=heads,
            num_key_value_heads=m.num_query_groups or heads, head_dim=m.kv_channels or m.hidden_size // heads,
            hidden_act="silu", max_position_embeddings=m.max_position_embeddings or m.seq_length,
            rms_norm_eps=m.layernorm_epsilon, tie_word_embeddings=m.share_embeddings_and_output_weights,
            rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base),
                             "partial_rotary_factor": float(m.rotary_percent)},
            attention_bias=False, attention_dropout=m.attention_dropout,
            layer_types=["linear_attention" if x else "full_attention" for x in linear],
            linear_conv_kernel_dim=m.linear_conv_kernel_dim, linear_key_head_dim=m.linear_key_head_dim,
            linear_value_head_dim=m.linear_value_head_dim, linear_num_key_heads=m.linear_num_key_heads,
            linear_num_value_heads=m.linear_num_value_heads, num_experts=m.num_moe_experts,
            num_experts_per_tok=m.moe_router_topk, moe_intermediate_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
            shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            router_aux_loss_coef=m.moe_aux_loss_coeff, architectures=[arch], dtype=str(dtype).removeprefix("torch."),
            **self.hf_extra(m))
        if m.mtp_num_layers or (base or {}).get("mtp_num_hidden_layers") is not None:
            fields["mtp_num_hidden_layers"] = m.mtp_num_layers or 0
        # layer_types decides the pattern: an imported full_attention_interval (transformers' shorthand) is not kept
        base = {k: v for k, v in (base or {}).items() if k != "full_attention_interval"}
        return self.hf_config(getattr(transformers, self.config_class), fields, bos=bos, eos=eos, base=base)

    def config_json(self, hf_cfg: Any) -> dict:
        """As released configs spell it: `rope_theta`, `partial_rotary_factor`, `full_attention_interval` instead of
        `layer_types` (when the layers follow one) and, with an MTP layer, `mtp_use_dedicated_embeddings`."""
        out = hf_cfg.to_diff_dict()
        rope = hf_cfg.rope_parameters
        out["rope_theta"], out["partial_rotary_factor"] = rope["rope_theta"], rope.get("partial_rotary_factor", 1.0)
        freq = _freq_of(list(hf_cfg.layer_types))
        if isinstance(freq, int):
            out["full_attention_interval"] = freq
            out.pop("layer_types", None)
        if _mtp_layers(hf_cfg):
            out["mtp_use_dedicated_embeddings"] = False
        return out

    def from_hf_config(self, cfg: Any) -> dict:
        _refuse(cfg, "hidden_act", cfg.hidden_act == "silu", "only silu (SwiGLU)")
        _refuse(cfg, "attention_bias", not cfg.attention_bias, "projections without biases")
        _refuse(cfg, "mtp_num_hidden_layers", _mtp_layers(cfg) in (0, 1), "one MTP layer at most")
        _refuse(cfg, "mtp_use_dedicated_embeddings", not getattr(cfg, "mtp_use_dedicated_embeddings", False),
                "the MTP layer shares the model's embedding")
        _refuse(cfg, "shared_expert_intermediate_size", (cfg.shared_expert_intermediate_size or 0) > 0,
                "Qwen3-Next's MoE layers have a shared expert")
        types = list(cfg.layer_types)
        bad = sorted(set(types) - {"linear_attention", "full_attention"})
        _refuse(cfg, "layer_types", not bad and len(types) == cfg.num_hidden_layers, f"unknown layer types {bad}"
                if bad else "one type per layer")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rtype = rope.get("rope_type", rope.get("type", "default"))
        _refuse(cfg, "rope_parameters", rtype == "default", f"rope_type {rtype!r}: default RoPE only")
        heads, context = cfg.num_attention_heads, int(cfg.max_position_embeddings)
        moe = self._moe_layers(cfg)
        return {
            **self.fixed_fields, "family": self.name, "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "ffn_hidden_size": getattr(cfg, "intermediate_size", None) or
            cfg.moe_intermediate_size, "num_attention_heads": heads, "num_query_groups": cfg.num_key_value_heads,
            "kv_channels": cfg.head_dim, "layernorm_epsilon": float(cfg.rms_norm_eps),
            "rotary_base": float(rope.get("rope_theta", 10000.0)),
            "rotary_percent": float(rope.get("partial_rotary_factor", 1.0)), "rope_scaling": False,
            "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings), "vocab_size": cfg.vocab_size,
            "max_position_embeddings": context, "seq_length": min(context, 4096), "sliding_window": None,
            "hidden_dropout": 0.0, "attention_dropout": float(cfg.attention_dropout or 0.0),
            "linear_attention_freq": _freq_of(types), "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
            "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
            "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
            "num_moe_experts": cfg.num_experts, "moe_router_topk": cfg.num_experts_per_tok,
            "moe_ffn_hidden_size": cfg.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "moe_router_pre_softmax": not getattr(cfg, "norm_topk_prob", True),
            "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": float(cfg.router_aux_loss_coef),
            "moe_layer_freq": 1 if all(moe) else moe, "mtp_num_layers": _mtp_layers(cfg) or None,
        }

    def _moe_layers(self, cfg: Any) -> list[int]:
        """1 where transformers builds an MoE layer (decoder_sparse_step, mlp_only_layers), per layer."""
        if not self.has_dense_layers:
            return [1] * cfg.num_hidden_layers
        step, dense = max(int(cfg.decoder_sparse_step), 1), set(cfg.mlp_only_layers or [])
        if cfg.num_experts <= 0:
            raise ConversionError("config.json: num_experts=0 is not supported (Qwen3-Next's layers are MoE)")
        return [int(i not in dense and (i + 1) % step == 0) for i in range(cfg.num_hidden_layers)]


def _moe_pattern(m: Any) -> list[int]:
    freq = m.moe_layer_freq
    return [int(i % freq == 0) for i in range(m.num_layers)] if isinstance(freq, int) else list(freq)


def _mtp_layers(cfg: Any) -> int:
    return int(getattr(cfg, "mtp_num_hidden_layers", 0) or 0)


def _freq_of(types: list[str]) -> int | list[int]:
    """Our linear_attention_freq of HF layer types: N when every N-th layer (and only those) is full attention."""
    pattern = [int(t == "linear_attention") for t in types]
    for n in range(2, len(pattern) + 1):
        if pattern == linear_pattern(len(pattern), n):
            return n
    return pattern


# Every rule the family can produce (the registry's table; `mapping_for` picks and expands them per model).
MAPPING = (*_GLOBAL, *_attention(_M, _L), *_moe(_M, _L), *_dense(_M, _L), *_mtp())
FAMILY = Qwen3NextFamily(name="qwen3_next", hf_architecture="Qwen3NextForCausalLM", hf_model_type="qwen3_next",
                         presets=PRESETS, mapping=MAPPING, fixed_fields=_FIXED, hf_ignored=ROTARY_BUFFERS)
