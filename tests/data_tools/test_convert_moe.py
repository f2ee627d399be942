"""HF bridge for MoE families: a random transformers Mixtral / Qwen3-MoE imports with equal logits (≤ 1e-4 fp32,
Megatron in its own 1-rank process) and exports back bit-identical, tensor by tensor, in the per-expert
checkpoint names the Hub uses; expert extra state and (layer, expert) slices land where the trainer loads them."""

from __future__ import annotations

import json

import pytest
import torch

from data_tools.convert import CheckpointReader, export_to_hf, import_from_hf, write_random_hf
from tests.data_tools.test_convert import hf_logits, megatron_logits, safetensors_dir, tokenizer_dir  # noqa: F401


def mixtral(**kw):
    from transformers import MixtralConfig

    return MixtralConfig(**{**dict(vocab_size=32000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2,
                                   tie_word_embeddings=False), **kw})


def qwen3_moe(**kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**dict(vocab_size=32000, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    max_position_embeddings=64, rms_norm_eps=1e-6, num_experts=4,
                                    num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False), **kw})


@pytest.mark.parametrize("name,make", [("mixtral", mixtral), ("qwen3_moe", qwen3_moe),
                                       ("qwen3_moe_no_topk_norm", lambda: qwen3_moe(norm_topk_prob=False))])
def test_moe_import_matches_hf_logits_and_export_is_bit_identical(tmp_path, tokenizer_dir, name, make):  # noqa: F811
    src = tmp_path / "hf"
    write_random_hf(src, make(), seed=1, std=0.05)
    for f in tokenizer_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    ckpt = tmp_path / "ckpt"
    summary = import_from_hf(src, ckpt, progress=False)
    family = summary["family"]
    stored = CheckpointReader(ckpt).tensors
    fc1 = stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    hidden, ffn = (64, 96) if family == "mixtral" else (64, 48)
    assert tuple(fc1.size) == (2, 4, 2 * ffn, hidden)  # [layers, experts, gate; up, hidden]
    assert tuple(stored["decoder.layers.mlp.router.weight"].size) == (2, 4, hidden)
    assert ("decoder.layers.self_attention.q_layernorm.weight" in stored) == (family == "qwen3_moe")

    tokens = torch.randint(0, 32000, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(src, tokens)
    got = megatron_logits(ckpt, tokens, tmp_path)
    diff = (got - ref).abs().max().item()
    print(f"{name}: HF → Megatron logits max abs diff {diff:.3g}")
    assert got.shape == ref.shape and diff <= 1e-4

    back = tmp_path / "back"
    export_to_hf(ckpt, back, progress=False)
    original, exported = safetensors_dir(src), safetensors_dir(back)
    assert set(exported) == set(original)
    assert "model.layers.1.{}.experts.3.{}.weight".format(*(("block_sparse_moe", "w2") if family == "mixtral"
                                                            else ("mlp", "down_proj"))) in exported
    for key, t in original.items():
        assert exported[key].dtype == t.dtype and torch.equal(exported[key], t), key
    config = json.loads((back / "config.json").read_text())
    assert config["num_experts_per_tok"] == 2
    if family == "qwen3_moe":
        assert config["norm_topk_prob"] == (name == "qwen3_moe") and config["num_experts"] == 4
    assert torch.equal(hf_logits(back, tokens), ref)
