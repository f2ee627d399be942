"""MoE families (mixtral, qwen3_moe): HF config both ways for every preset, routing semantics, per-expert mapping
rules (one (layer, expert) slice at a time) and the refusals that name the field."""

from __future__ import annotations

import json

import pytest
import torch

from model_providers import family_for_hf, get_family
from model_providers.core.family import dims, hf_parameter_shapes
from model_providers.core.mapping import ConversionError, GateUp
from pretrain.config import load_config

FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
          "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax", "qk_layernorm",
          "rotary_base", "layernorm_epsilon", "moe_aux_loss_coeff")


@pytest.mark.parametrize("preset,arch", [("tiny_moe", "MixtralForCausalLM"), ("mixtral_8x7b", "MixtralForCausalLM"),
                                         ("tiny_qwen3_moe", "Qwen3MoeForCausalLM"),
                                         ("qwen3_30b_a3b", "Qwen3MoeForCausalLM"),
                                         ("qwen3_235b_a22b", "Qwen3MoeForCausalLM")])
def test_hf_config_both_ways(tmp_path, preset, arch):
    from transformers import AutoConfig

    m = load_config(None, [f"model.preset={preset}"]).model
    family = get_family(m.family)
    vocab = m.vocab_size or 32000
    cfg = family.to_hf_config(m, vocab, bos=1, eos=2, dtype=torch.bfloat16)
    text = family.config_json(cfg)
    assert text["architectures"] == [arch] and text["rope_theta"] == m.rotary_base
    (tmp_path / "config.json").write_text(json.dumps(text))
    loaded = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    assert family_for_hf(loaded) is family
    fields = family.from_hf_config(loaded)
    for key in FIELDS:
        want = getattr(m, key)
        if key == "moe_ffn_hidden_size" and m.family == "mixtral":
            want = None  # Mixtral's experts are ffn_hidden_size wide
        assert fields.get(key, None) == want, (key, fields.get(key), want)


def test_qwen3_moe_config_json_spells_num_experts_and_norm_topk_prob():
    m = load_config(None, ["model.preset=qwen3_30b_a3b"]).model
    family = get_family("qwen3_moe")
    text = family.config_json(family.to_hf_config(m, 151936, bos=None, eos=151645, dtype=torch.bfloat16))
    assert text["num_experts"] == 128 and "num_local_experts" not in text
    assert text["norm_topk_prob"] is True and text["moe_intermediate_size"] == 768 and text["head_dim"] == 128
    m = load_config(None, ["model.preset=qwen3_30b_a3b", "model.moe_router_pre_softmax=true"]).model
    assert family.config_json(family.to_hf_config(m, 151936, bos=None, eos=None, dtype=torch.bfloat16))[
        "norm_topk_prob"] is False


def test_refusals_name_the_field():
    from transformers import Qwen3MoeConfig

    m = load_config(None, ["model.preset=tiny_moe", "model.moe_ffn_hidden_size=64"]).model
    with pytest.raises(ConversionError, match="moe_ffn_hidden_size=64 differs from model.ffn_hidden_size=128"):
        get_family("mixtral").to_hf_config(m, 32000, bos=1, eos=2, dtype=torch.float32)
    m = load_config(None, ["model.preset=tiny_moe", "model.qk_layernorm=true"]).model
    with pytest.raises(ConversionError, match="model.qk_layernorm=True cannot be expressed as MixtralForCausalLM"):
        get_family("mixtral").to_hf_config(m, 32000, bos=1, eos=2, dtype=torch.float32)
    sparse_every_other = Qwen3MoeConfig(num_hidden_layers=4, decoder_sparse_step=2)
    with pytest.raises(ConversionError, match=r"layers \[0, 2\] have a dense MLP"):
        get_family("qwen3_moe").from_hf_config(sparse_every_other)


def test_hf_names_are_per_expert_checkpoint_names():
    """transformers ≥ 5 fuses experts in memory; the names planned are those save_pretrained writes."""
    m = load_config(None, ["model.preset=tiny_qwen3_moe"]).model
    family = get_family("qwen3_moe")
    shapes = hf_parameter_shapes(family.to_hf_config(m, 32000, bos=None, eos=None, dtype=torch.float32))
    assert shapes["model.layers.3.mlp.experts.7.gate_proj.weight"] == (64, 128)
    assert shapes["model.layers.0.mlp.experts.0.down_proj.weight"] == (128, 64)
    assert shapes["model.layers.0.mlp.gate.weight"] == (8, 128)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (32,)
    assert not any("gate_up_proj" in name for name in shapes)
    rules = {r.megatron: r for r in family.mapping}
    fc1 = rules["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.stack_dims == 2 and rules["decoder.layers.mlp.router.weight"].stack_dims == 1
    assert fc1.indices(2, 3) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert fc1.hf_names((3, 7)) == ["model.layers.3.mlp.experts.7.gate_proj.weight",
                                    "model.layers.3.mlp.experts.7.up_proj.weight"]
    d = dims(m, 32000, 32000)
    assert d.num_experts == 8
    gate, up = torch.randn(64, 128), torch.randn(64, 128)
    assert isinstance(fc1, GateUp) and all(torch.equal(a, b) for a, b in zip(fc1.to_hf(fc1.from_hf([gate, up], d), d),
                                                                              (gate, up)))
