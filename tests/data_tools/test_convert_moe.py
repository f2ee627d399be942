"""HF bridge for MoE families, beyond the per-family round trips of test_hf_families.py: a random transformers
Mixtral and Qwen3-MoE (with and without `norm_topk_prob`) import with the HF model's logits (≤ 1e-4 fp32; Megatron
in one 1-rank worker process for the three) and expert weights stored as Megatron stores them: [layers, experts,
...] with global expert indices, one (layer, expert) slice per HF tensor; the export is bit-identical."""

from __future__ import annotations

import json

import torch

from pretrain.hf.export import export_to_hf
from pretrain.hf.hf_import import import_from_hf
from pretrain.hf.readers import CheckpointReader
from tests.data_tools.hf_random import write_random_hf
from tests.data_tools.test_convert import PY, WORKER, hf_logits, run, safetensors_dir, tokenizer_dir  # noqa: F401


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


MODELS = {"mixtral": mixtral(), "qwen3_moe": qwen3_moe(), "qwen3_moe_no_topk_norm": qwen3_moe(norm_topk_prob=False)}


def test_moe_import_matches_hf_logits_and_export_is_bit_identical(tmp_path, tokenizer_dir):  # noqa: F811
    tokens = torch.randint(0, 32000, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    jobs = []
    for name, hf_cfg in MODELS.items():
        src, ckpt = tmp_path / f"hf_{name}", tmp_path / f"ckpt_{name}"
        write_random_hf(src, hf_cfg, seed=1, std=0.05)
        for f in tokenizer_dir.iterdir():
            (src / f.name).write_bytes(f.read_bytes())
        family = import_from_hf(src, ckpt, progress=False)["family"]
        stored = CheckpointReader(ckpt).tensors
        ffn = 96 if family == "mixtral" else 48
        assert tuple(stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (2, 4, 2 * ffn, 64)
        assert tuple(stored["decoder.layers.mlp.experts.experts.linear_fc2.weight"].size) == (2, 4, 64, ffn)
        assert tuple(stored["decoder.layers.mlp.router.weight"].size) == (2, 4, 64)
        assert ("decoder.layers.self_attention.q_layernorm.weight" in stored) == (family == "qwen3_moe")
        jobs += [str(ckpt), str(tmp_path / "tokens.pt"), str(tmp_path / f"logits_{name}.pt")]
    run([PY, str(WORKER), "logits", *jobs])

    for name in MODELS:
        src, ckpt = tmp_path / f"hf_{name}", tmp_path / f"ckpt_{name}"
        ref = hf_logits(src, tokens)
        got = torch.load(tmp_path / f"logits_{name}.pt", weights_only=True)
        diff = (got - ref).abs().max().item()
        print(f"{name}: HF → Megatron logits max abs diff {diff:.3g}")
        assert got.shape == ref.shape and diff <= 1e-4

        back = tmp_path / f"back_{name}"
        export_to_hf(ckpt, back, progress=False)
        original, exported = safetensors_dir(src), safetensors_dir(back)
        assert set(exported) == set(original)
        for key, t in original.items():
            assert exported[key].dtype == t.dtype and torch.equal(exported[key], t), key
        config = json.loads((back / "config.json").read_text())
        if name.startswith("qwen3_moe"):
            assert config["norm_topk_prob"] == (name == "qwen3_moe") and config["num_experts"] == 4
        assert torch.equal(hf_logits(back, tokens), ref)
