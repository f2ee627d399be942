"""Qwen3.5-MoE family (the text model of Qwen3.5-35B-A3B and its siblings): Qwen3-Next's layers — Gated DeltaNet on
three layers of four, output-gated full attention with partial RoPE, zero-centred RMSNorms, top-k routed experts plus
a gated shared expert in every layer, an MTP layer — under transformers' `Qwen3_5MoeForCausalLM` (`model_type`
qwen3_5_moe_text). The same Megatron-Core model as `qwen3_next` (`model_providers/qwen3_next.py`); what differs is the
HF side: Gated DeltaNet's input projection is four flat tensors (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`) instead of two grouped per key head, every layer is MoE and the top-k weights are always renormalised
(the config has no `decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`, `intermediate_size`), and RoPE is the
multimodal one of Qwen3-VL (`mrope_section`, `mrope_interleaved`), which on text (the same position on all three axes)
is plain RoPE on `partial_rotary_factor` of each head.

Released checkpoints are the vision-language `Qwen3_5MoeForConditionalGeneration` (`model.language_model.*`, experts
fused per layer, a vision tower); this family reads and writes the text model as transformers' `Qwen3_5MoeForCausalLM`
saves it (docs/hf.md "Qwen3.5-MoE").
"""

from __future__ import annotations

from typing import Any, ClassVar

from model_providers.core.family import shape
from model_providers.core.mapping import ConversionError
from model_providers.core.yarn import refuse as _refuse
from model_providers.llama import ROTARY_BUFFERS
from model_providers.qwen3_next import _COMMON as _NEXT_COMMON
from model_providers.qwen3_next import _FIXED, MAPPING, Qwen3NextFamily

_COMMON = {**_NEXT_COMMON, "family": "qwen3_5_moe", "vocab_size": 248320, "max_position_embeddings": 262144}


def _mrope(m: Any) -> dict:
    """Multimodal RoPE sections for a model exported without a released config.json: Qwen3.5's [11, 11, 10] over its
    32 rotary frequencies, the same thirds (rounded up, first) for other widths (any split is plain RoPE on text)."""
    n = int((m.kv_channels or m.hidden_size // m.num_attention_heads) * m.rotary_percent) // 2
    a = -(-n // 3)
    b = -(-(n - a) // 2)
    return {"mrope_section": [a, b, n - a - b], "mrope_interleaved": True}


PRESETS: dict[str, dict] = {
    # Qwen3.5-35B-A3B's text model (transformers' Qwen3_5MoeTextConfig defaults): 40 layers (10 full attention),
    # 256 experts top-8 + 1 shared, Gated DeltaNet 16 key / 32 value heads, MTP depth 1.
    "qwen3_5_35b_a3b": shape(_COMMON, 40, 2048, 512, 16, 2, num_moe_experts=256, moe_ffn_hidden_size=512,
                             moe_shared_expert_intermediate_size=512, moe_router_topk=8, mtp_num_layers=1),
}


class Qwen35MoeFamily(Qwen3NextFamily):
    """Qwen3_5MoeForCausalLM both ways: `Qwen3NextFamily`'s mapping and fields, with the flat GDN projections, every
    layer MoE, renormalised top-k and the text positions of multimodal RoPE (`mrope_section` and `mrope_interleaved`
    kept from the imported config.json, else Qwen3.5's)."""

    config_class: ClassVar[str] = "Qwen3_5MoeTextConfig"
    grouped_in_proj: ClassVar[bool] = False
    has_dense_layers: ClassVar[bool] = False

    def hf_extra(self, m: Any) -> dict:
        if m.moe_layer_freq != 1 or m.moe_router_pre_softmax:
            raise ConversionError(f"model.moe_layer_freq={m.moe_layer_freq!r} / model.moe_router_pre_softmax="
                                  f"{m.moe_router_pre_softmax} cannot be expressed as {self.hf_architecture} (every "
                                  "layer MoE, top-k weights renormalised)")
        return {}

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any,
                     base: Any = None) -> Any:
        released = dict((base or {}).get("rope_parameters") or {})
        mrope = {k: released.get(k, v) for k, v in _mrope(m).items()}
        cfg = super().to_hf_config(m, vocab, bos=bos, eos=eos, dtype=dtype, base=base)
        cfg.rope_parameters = {**cfg.rope_parameters, **mrope}
        return cfg

    def config_json(self, hf_cfg: Any) -> dict:
        """transformers' keys (its config class keeps `rope_parameters`, with the multimodal sections)."""
        out = hf_cfg.to_diff_dict()
        out["rope_parameters"] = dict(hf_cfg.rope_parameters)
        if int(getattr(hf_cfg, "mtp_num_hidden_layers", 0) or 0):
            out["mtp_use_dedicated_embeddings"] = False
        return out

    def from_hf_config(self, cfg: Any) -> dict:
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        _refuse(cfg, "rope_parameters", rope.get("mrope_interleaved", True) in (True, False),
                "mrope_interleaved true or false")
        fields = super().from_hf_config(cfg)
        return {**fields, "ffn_hidden_size": cfg.moe_intermediate_size, "moe_router_pre_softmax": False}


FAMILY = Qwen35MoeFamily(name="qwen3_5_moe", hf_architecture="Qwen3_5MoeForCausalLM", hf_model_type="qwen3_5_moe_text",
                         presets=PRESETS, mapping=MAPPING, fixed_fields=_FIXED, hf_ignored=ROTARY_BUFFERS)
