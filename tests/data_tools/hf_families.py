"""Tiny HF models of every family, written as released models are (config.json in the released style, tokenizer
files, generation_config.json), for the HF bridge tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

# One config.json per family in the style of the released files (pre-v5 `rope_theta`/`rope_scaling`, `torch_dtype`,
# keys transformers drops or normalises), tiny: 2 layers, GQA. Vocabularies are not multiples of 256, so the
# padding differs between TP1 (import) and TP2 (training).
CONFIGS: dict[str, dict] = {
    # Llama-3.2 style: tied embeddings, explicit head_dim, Llama-3 RoPE scaling with non-default low/high/original.
    "llama": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "max_position_embeddings": 4096, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 8.0, "low_freq_factor": 2.0,
                         "original_max_position_embeddings": 1024, "rope_type": "llama3"},
        "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 32003,
    },
    # Mistral-7B-v0.1 style: a sliding window on every layer, shorter than the training length (16 < 64).
    "mistral": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 512,
        "model_type": "mistral", "num_attention_heads": 8, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 16, "tie_word_embeddings": False,
        "torch_dtype": "float32", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32005,
    },
    # Qwen2.5-0.5B style: q/k/v biases, tied embeddings, a sliding_window transformers ignores (use_sliding_window
    # false), a key transformers does not know (use_mrope).
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 50256, "eos_token_id": 50256,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 160,
        "max_position_embeddings": 32768, "max_window_layers": 2, "model_type": "qwen2", "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "float32",
        "transformers_version": "4.43.1", "use_cache": True, "use_mrope": False, "use_sliding_window": False,
        "vocab_size": 50304,
    },
    # Qwen3 style: QK-norm, head_dim 32 with hidden 64 / 4 heads, untied; use_sliding_window with max_window_layers
    # 1: layer 0 full, layer 1 windowed (16 < the training length 64).
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 50256, "eos_token_id": 50256, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 40960, "max_window_layers": 1,
        "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 16,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": True, "vocab_size": 50260,
    },
    # Mixtral-8x7B style: 4 experts of 96, top-2, no sliding window.
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": False,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.36.0.dev0",
        "use_cache": True, "vocab_size": 32007,
    },
    # Qwen3-30B-A3B style: QK-norm, head_dim 32, 4 experts of 48 (intermediate_size unused), top-2, norm_topk_prob.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 50256, "decoder_sparse_step": 1, "eos_token_id": 50256, "head_dim": 32, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 40960,
        "max_window_layers": 2, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 48,
        "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.51.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 50261,
    },
    # DeepSeek-V3 style: MLA (q LoRA 32, KV rank 16, rope width 8), YaRN with mscale != mscale_all_dim, one dense
    # layer then 2 MoE layers of 8 experts + 1 shared, sigmoid top-2 within 1 of 2 groups, weights × 2.5, one MTP
    # layer stored as the extra decoder layer 3 (with copies of the embedding and the head).
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001, "bos_token_id": 1, "eos_token_id": 2, "ep_size": 1, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "kv_lora_rank": 16, "max_position_embeddings": 64, "model_type": "deepseek_v3", "moe_intermediate_size": 32,
        "moe_layer_freq": 1, "n_group": 2, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 0.707, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 16, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "torch_dtype": "float32",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 16, "vocab_size": 32009,
    },
    # gpt-oss-20b style: 2 layers, windowed (16 < the training length 64) then full, head_dim 32 ≠ hidden / heads,
    # sinks, biases, 4 experts of 32 (top-2; MXFP4 needs multiples of 32) with the clamped SwiGLU, YaRN (factor 4
    # over 16 positions, truncate false), the released extra keys (experts_per_token, initial_context_length), aux
    # loss off (output_router_logits false) at the released coefficient.
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "bos_token_id": 50256, "eos_token_id": 50256, "experts_per_token": 2, "head_dim": 32, "hidden_act": "silu",
        "hidden_size": 64, "initial_context_length": 16, "initializer_range": 0.02, "intermediate_size": 32,
        "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 64,
        "model_type": "gpt_oss", "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": False, "pad_token_id": 50256,
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0,
                                                "original_max_position_embeddings": 16, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 16, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.55.0.dev0",
        "use_cache": True, "vocab_size": 50270,
    },
    # NVIDIA-Nemotron-3-Nano-30B-A3B style: the released keys (hybrid_override_pattern, norm_eps, rope_theta,
    # partial_rotary_factor: the last three not read by transformers), 6 layers M*M-ME: Mamba-2 (8 heads of 8 in 2
    # groups, state 16, chunk 8 < the training length 64), attention without RoPE, a squared-ReLU MLP, an MoE layer of
    # 4 squared-ReLU experts (top-2, sigmoid, expert bias, weights × 2.5) and a shared expert.
    "nemotron_h": {
        "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "chunk_size": 8, "conv_kernel": 4, "eos_token_id": 2, "expand": 2, "head_dim": 16,
        "hidden_dropout": 0.0, "hidden_size": 64, "hybrid_override_pattern": "M*M-ME", "initializer_range": 0.02,
        "intermediate_size": 96, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 8, "mamba_hidden_act": "silu",
        "mamba_num_heads": 8, "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32",
        "max_position_embeddings": 262144, "mlp_bias": False, "mlp_hidden_act": "relu2", "model_type": "nemotron_h",
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48, "n_group": 1, "n_groups": 2,
        "n_routed_experts": 4, "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 6, "num_key_value_heads": 2,
        "num_logits_to_keep": 1, "pad_token_id": 0, "partial_rotary_factor": 1.0, "rescale_prenorm_residual": True,
        "residual_in_fp32": False, "rope_theta": 10000, "routed_scaling_factor": 2.5, "sliding_window": None,
        "ssm_state_size": 16, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_max": 0.1,
        "time_step_min": 0.001, "topk_group": 1, "torch_dtype": "float32", "transformers_version": "4.55.4",
        "use_bias": False, "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": 32011,
    },
}
FAMILIES = tuple(CONFIGS)
# The training length each family is imported with (Mistral, Qwen3: longer than their sliding windows).
SEQ_LENGTH = {"llama": 64, "mistral": 64, "qwen2": 64, "qwen3": 64, "mixtral": 64, "qwen3_moe": 64, "deepseek_v3": 64,
              "gpt_oss": 64, "nemotron_h": 64}
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
# Which tokenizer each family ships: SentencePiece (Llama/Mistral) or byte-level BPE tokenizer.json (Qwen).
TOKENIZER = {"llama": "sentencepiece", "mistral": "sentencepiece", "qwen2": "bpe", "qwen3": "bpe",
             "mixtral": "sentencepiece", "qwen3_moe": "bpe", "deepseek_v3": "sentencepiece", "gpt_oss": "bpe",
             "nemotron_h": "sentencepiece"}


def tokenizer_files(kind: str, directory: Path) -> Path:
    """A transformers tokenizer directory (with a chat template) from the embedded tokenizer files."""
    from transformers import AutoTokenizer

    from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER

    source = directory.with_name(directory.name + "_source")
    source.mkdir(parents=True)
    if kind == "sentencepiece":
        (source / "tokenizer.model").write_bytes(Path(MISTRAL_TOKENIZER).read_bytes())
        (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    else:
        (source / "vocab.json").write_bytes(Path(GPT2_VOCAB).read_bytes())
        (source / "merges.txt").write_bytes(Path(GPT2_MERGES).read_bytes())
        (source / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(directory))
    if kind == "sentencepiece":
        (directory / "tokenizer.model").write_bytes(Path(MISTRAL_TOKENIZER).read_bytes())
    return directory


# Tensors drawn at another scale than the rest (name suffix: factor): DeepSeek's router sharp enough that tokens route
# differently (and group limiting changes the choice), its expert bias small but not zero.
# GPT-OSS's experts' gate/up large enough that the SwiGLU clamp (±7) acts, its sinks large enough to matter.
SCALES = {"deepseek_v3": {"mlp.gate.weight": 4.0, "mlp.gate.e_score_correction_bias": 0.2},
          "nemotron_h": {"mixer.gate.weight": 4.0, "mixer.gate.e_score_correction_bias": 0.2},
          "gpt_oss": {"mlp.experts.gate_up_proj": 20.0, "self_attn.sinks": 10.0}}


def _scaled(family: str):
    """The default tensor edit of `write_hf_model`: the family's SCALES."""
    def edit(name: str, tensor):
        factor = next((x for suffix, x in SCALES.get(family, {}).items() if name.endswith(suffix)), None)
        return tensor if factor is None else tensor * factor
    return edit


def write_hf_model(family: str, directory: Path, tokenizers: dict[str, Path], seed: int = 1,
                   edit: Callable | None = None) -> Path:
    """A random transformers model of `family` saved as a released model directory is; `edit(name, tensor)` gives
    each stored tensor (default: the family's SCALES applied)."""
    from transformers import AutoConfig

    from tests.data_tools.hf_random import write_random_hf

    config = CONFIGS[family]
    hf_cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    write_random_hf(directory, hf_cfg, seed=seed, std=0.05)
    if edit is not None or family in SCALES:
        from safetensors.torch import load_file, save_file

        edit = edit or _scaled(family)
        for f in directory.glob("*.safetensors"):
            tensors = load_file(str(f))
            save_file({name: edit(name, t) for name, t in tensors.items()}, str(f), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in tokenizers[TOKENIZER[family]].iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    bos_text = "<s>" if TOKENIZER[family] == "sentencepiece" else "<|endoftext|>"
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": {"content": bos_text, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}}, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": [eos], "do_sample": True, "temperature": 0.6, "top_p": 0.9,
         "transformers_version": config["transformers_version"]}, indent=2) + "\n")
    return directory


def hf_model(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32).eval()


def safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def non_weight_files(directory: Path) -> dict[str, bytes]:
    """Every file of an HF directory but the weights and their index."""
    return {p.name: p.read_bytes() for p in directory.iterdir()
            if p.is_file() and p.suffix != ".safetensors" and p.name != "model.safetensors.index.json"}


def hf_mtp(directory: Path, model):
    """transformers' Multi-Token Prediction module for `model` (loaded from `directory`), with the MTP layers'
    weights from the checkpoint files (transformers' own loader matches only layer 61, DeepSeek-V3's)."""
    from safetensors.torch import load_file
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_layers import MtpModel
    from transformers.modeling_utils import LoadStateDictConfig

    layers = model.config.num_hidden_layers
    mtp = MtpModel(model, model.config.num_mtp_layers)
    state = {}
    for f in directory.glob("*.safetensors"):
        state.update({k: v for k, v in load_file(str(f)).items()
                      if k.startswith("model.layers.") and int(k.split(".")[2]) >= layers})
    info, _ = convert_and_load_state_dict_in_model(model=mtp, state_dict=state, load_config=LoadStateDictConfig(
        weight_mapping=mtp.get_weight_conversions(model), dtype=torch.float32))
    assert set(info.missing_keys) <= {"embed_tokens.weight", "shared_head.weight"}, info.missing_keys
    mtp.tie_with_main_model(model)
    return mtp.eval()


def hf_mtp_loss(mtp, hidden: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> float:
    """The depth-1 MTP loss Megatron-Core computes: at position i the MTP layer sees the main model's final hidden
    state i and the embedding of token i+1, and predicts token i+2 (labels[i+1]); the loss mask moves along, the
    last position has none. `hidden` [b, s, h] (after the final norm), `tokens`/`labels`/`mask` [b, s]."""
    from torch.nn.functional import cross_entropy

    s = tokens.shape[1]
    positions = torch.arange(s - 1).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        out = mtp.forward_layer(0, hidden[:, : s - 1], positions, None, input_ids=tokens[:, 1:])
        logits = mtp._project_to_logits(out)
    per_token = cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1).float()
    return (per_token * m).sum().item() / m.sum().item()
