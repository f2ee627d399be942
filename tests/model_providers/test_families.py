"""Model families: the registry finds every family module, each family's HF config goes both ways, and
adding a family is adding one file (shown end to end through `python -m pretrain validate`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model_providers
from model_providers import FAMILIES, all_presets, family_for_hf, get_family
from model_providers.core.mapping import ConversionError
from pretrain.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_registry_holds_every_family_module_and_unique_presets():
    modules = sorted(p.stem for p in Path(model_providers.__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    assert sorted(FAMILIES) == modules  # every top-level module is a family
    presets = all_presets()
    for family in FAMILIES.values():
        for name, fields in family.presets.items():
            assert presets[name] is fields and fields["family"] == family.name
            for key, value in family.fixed_fields.items():
                assert fields[key] == value, (name, key)


def test_llama31_config_has_llama3_rope_scaling(tmp_path):
    from transformers import AutoConfig

    m = load_config(None, ["model.preset=llama31_8b"]).model
    llama = get_family("llama")
    cfg = llama.to_hf_config(m, 128256, bos=128000, eos=128001, dtype=torch.bfloat16)
    text = llama.config_json(cfg)
    assert text["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert text["rope_theta"] == 500000.0 and text["num_key_value_heads"] == 8 and text["architectures"] == [
        "LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(text))
    loaded = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    assert loaded.rope_parameters["rope_type"] == "llama3" and loaded.rope_parameters["factor"] == 8.0
    assert family_for_hf(loaded) is llama
    fields = llama.from_hf_config(loaded)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "rotary_base", "rope_scaling", "rope_scaling_factor"):
        assert fields[key] == getattr(m, key), key


def test_unsupported_model_config_names_the_field():
    m = load_config(None, ["model.preset=tiny_llama", "model.add_qkv_bias=true"]).model
    with pytest.raises(ConversionError, match="add_qkv_bias"):
        get_family("llama").to_hf_config(m, 32000, bos=1, eos=2, dtype=torch.float32)


def test_unknown_hf_model_type_is_refused():
    from transformers import MambaConfig

    with pytest.raises(ConversionError, match=r"model_type 'mamba' .* is not supported"):
        family_for_hf(MambaConfig())


TOY_FAMILY = '''
"""A toy family: a Llama under another name, to show that a family is one file."""
from model_providers.llama import FAMILY as _LLAMA, LlamaFamily

FAMILY = LlamaFamily(name="toy", hf_architecture="ToyForCausalLM", hf_model_type="toy",
                     presets={"toy_tiny": {**_LLAMA.presets["tiny_llama"], "family": "toy"}},
                     mapping=_LLAMA.mapping, fixed_fields=_LLAMA.fixed_fields)
'''


def test_a_new_family_is_one_new_file(tmp_path):
    """Copy the package, add one file, and the config, validator and trainer's model builder know the family."""
    shutil.copytree(ROOT / "model_providers", tmp_path / "model_providers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "model_providers" / "toy.py").write_text(TOY_FAMILY)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pretrain", "validate", "tiny_llama", "model.preset=toy_tiny",
                           "--world-size", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "config OK" in proc.stdout, proc.stdout + proc.stderr
    bad = subprocess.run([sys.executable, "-m", "pretrain", "validate", "tiny_llama", "model.family=nope"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "model.family='nope' is not one of " in bad.stderr and ", toy" in bad.stderr


# --------------------------------------------------------------------------------------------------
# Released models: presets against their config.json and published parameter counts
# --------------------------------------------------------------------------------------------------

# config.json of released models (architecture keys as published).
RELEASED = {
    "llama32_1b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {
            "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
            "rope_type": "llama3"}, "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 128256},
    "mistral_7b": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000},
    "qwen25_7b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28, "model_type": "qwen2",
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064},
    "qwen3_8b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "mixtral_8x7b": {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32000},
    "qwen3_30b_a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
}
# openai/gpt-oss-20b and -120b as released (MXFP4 experts: quantization_config; the import dequantizes them).
_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_key_value_heads": 8, "output_router_logits": False,
    "pad_token_id": 199999, "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0", "use_cache": True,
    "vocab_size": 201088}
# Released GPT-OSS keys no model field decides (kept from an imported config.json) or the export never writes.
_GPT_OSS_UNMAPPED = {"experts_per_token", "initial_context_length", "pad_token_id", "quantization_config"}
for _name, _layers, _experts in (("gpt_oss_20b", 24, 32), ("gpt_oss_120b", 36, 128)):
    RELEASED[_name] = {**_GPT_OSS, "num_hidden_layers": _layers, "num_local_experts": _experts,
                       "layer_types": ["sliding_attention", "full_attention"] * (_layers // 2)}
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 as released (norm_eps, rope_theta, partial_rotary_factor: keys
# transformers' NemotronH does not read; it has no RoPE).
RELEASED["nemotron3_nano"] = {
    "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2, "expand": 2, "head_dim": 128, "hidden_dropout": 0.0,
    "hidden_size": 2688, "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "initializer_range": 0.02, "intermediate_size": 1856, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64,
    "mamba_hidden_act": "silu", "mamba_num_heads": 64, "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144, "mlp_bias": False, "mlp_hidden_act": "relu2", "model_type": "nemotron_h",
    "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "n_groups": 8,
    "n_routed_experts": 128, "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2,
    "num_logits_to_keep": 1, "pad_token_id": 0, "partial_rotary_factor": 1.0, "rescale_prenorm_residual": True,
    "residual_in_fp32": False, "rope_theta": 10000, "routed_scaling_factor": 2.5, "sliding_window": None,
    "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_max": 0.1,
    "time_step_min": 0.001, "topk_group": 1, "torch_dtype": "bfloat16", "transformers_version": "4.55.4",
    "use_bias": False, "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": 131072}
_NEMOTRON_H_UNMAPPED = {"norm_eps", "rope_theta", "partial_rotary_factor", "pad_token_id"}
# Parameter counts as published (model cards / the Hub), in billions, with the digits given there.
PUBLISHED = {"llama32_1b": "1.24", "llama32_3b": "3.21", "mistral_7b": "7.24", "mistral_7b_v03": "7.25",
             "qwen25_0p5b": "0.49", "qwen25_7b": "7.62", "qwen25_72b": "72.7", "qwen3_0p6b": "0.6",
             "qwen3_8b": "8.19", "qwen3_32b": "32.8", "mixtral_8x7b": "46.7", "qwen3_30b_a3b": "30.5",
             "gpt_oss_20b": "20.9", "gpt_oss_120b": "116.8",  # gpt-oss: the model card (arXiv 2508.10925)
             "nemotron3_nano": "31.6"}  # the Hub's count of NVIDIA-Nemotron-3-Nano-30B-A3B (its card rounds to 30B)
_ARCH_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "layernorm_epsilon", "rotary_base", "rope_scaling", "share_embeddings_and_output_weights", "vocab_size",
                "max_position_embeddings", "sliding_window", "add_qkv_bias", "qk_layernorm", "family")
_MOE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
               "moe_aux_loss_coeff")


def _head_dim(fields) -> int:
    get = fields.get if isinstance(fields, dict) else lambda k: getattr(fields, k)
    return get("kv_channels") or get("hidden_size") // get("num_attention_heads")


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_preset_is_the_released_config(tmp_path, preset):
    """The released config.json imports as the preset, and the preset exports as what transformers reads from it."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(RELEASED[preset]))
    released = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    m = load_config(None, [f"model.preset={preset}"]).model
    family = family_for_hf(released)
    fields = family.from_hf_config(released)
    assert family.name == m.family and _head_dim(fields) == _head_dim(m)
    keys = _ARCH_FIELDS + (_MOE_FIELDS if m.num_moe_experts else ())
    assert {k: fields[k] for k in keys} == {k: getattr(m, k) for k in keys}
    if m.rope_scaling:
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            suffix = "" if key == "factor" else "_" + key
            assert fields[f"rope_scaling{suffix}"] == getattr(m, f"rope_scaling{suffix}")
    ours = family.to_hf_config(m, m.vocab_size, bos=released.bos_token_id, eos=released.eos_token_id,
                               dtype=torch.bfloat16).to_dict()
    theirs = released.to_dict()
    differ = {k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)}
    unmapped = {"gpt_oss": _GPT_OSS_UNMAPPED, "nemotron_h": _NEMOTRON_H_UNMAPPED}.get(m.family, set())
    assert differ <= {"_name_or_path", "transformers_version", "max_window_layers", "use_mrope", *unmapped}, differ


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_parameter_count_matches_published(preset):
    """The planner's count equals the transformers model's (built on the meta device) and rounds to the
    published figure."""
    from transformers import AutoModelForCausalLM

    from pretrain.plan import count_parameters

    cfg = load_config(None, [f"model.preset={preset}"])
    m = cfg.model
    ours = count_parameters(cfg, m.vocab_size)
    hf_cfg = get_family(m.family).to_hf_config(m, m.vocab_size, bos=None, eos=None, dtype=torch.bfloat16)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_cfg).parameters())
    digits = len(PUBLISHED[preset].split(".")[1])
    print(f"{preset}: {ours:,} parameters ({ours / 1e9:.{digits}f}B; published {PUBLISHED[preset]}B)")
    assert ours == theirs
    assert f"{ours / 1e9:.{digits}f}" == PUBLISHED[preset]


def test_every_preset_goes_to_transformers_and_back():
    """Each preset of each HF family: model fields → transformers config → model fields (the training length,
    a training setting, aside)."""
    for name in all_presets():
        m = load_config(None, [f"model.preset={name}"]).model
        family = get_family(m.family)
        vocab = m.vocab_size or 32000
        fields = family.from_hf_config(family.to_hf_config(m, vocab, bos=1, eos=2, dtype=torch.float32))
        for key, value in fields.items():
            if key in ("seq_length", "kv_channels", "vocab_size") or (key == "max_position_embeddings"
                                                                      and m.max_position_embeddings is None):
                continue
            assert value == getattr(m, key), (name, key, value, getattr(m, key))
        assert _head_dim(fields) == _head_dim(m), name


def test_window_layer_patterns_go_to_transformers_and_back():
    """Qwen2's windowed layers: every layer (max_window_layers 0), the last ones (max_window_layers), any other
    pattern (layer_types; an integer window_attn_skip_freq comes back as its 0/1 list); transformers reads the same
    layers as windowed. MistralForCausalLM windows every layer: a pattern is refused naming the field."""
    from model_providers.core.windows import windowed_layers

    for freq, hf_key, hf_value in ((None, "max_window_layers", 0), ([0, 0, 1, 1], "max_window_layers", 2),
                                   ([1, 0, 1, 0], "layer_types", None), (2, "layer_types", None)):
        m = load_config(None, ["model.preset=tiny_qwen2", "model.sliding_window=16",
                               f"model.window_attn_skip_freq={json.dumps(freq)}"]).model
        hf = get_family("qwen2").to_hf_config(m, 32000, bos=1, eos=2, dtype=torch.float32)
        if hf_value is not None:
            assert getattr(hf, hf_key) == hf_value, freq
        assert hf.layer_types == ["sliding_attention" if w else "full_attention" for w in windowed_layers(m)], freq
        fields = get_family("qwen2").from_hf_config(hf)
        back = load_config(None, ["model.preset=tiny_qwen2", "model.sliding_window=16",
                                  f"model.window_attn_skip_freq={json.dumps(fields['window_attn_skip_freq'])}"]).model
        assert fields["sliding_window"] == 16 and windowed_layers(back) == windowed_layers(m), (freq, fields)
    m = load_config(None, ["model.preset=tiny_mistral_swa", "model.window_attn_skip_freq=2"]).model
    with pytest.raises(ConversionError, match=r"model.window_attn_skip_freq=2 cannot be expressed as "
                                              r"MistralForCausalLM \(needs None\)"):
        get_family("mistral").to_hf_config(m, 32000, bos=1, eos=2, dtype=torch.float32)
