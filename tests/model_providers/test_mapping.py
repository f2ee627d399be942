"""HF mapping rules: each rule's two directions are inverse, and QKV regrouping keeps heads with their KV."""

from __future__ import annotations

import pytest
import torch

from model_providers.core.mapping import QKV, RULES, Dims


@pytest.mark.parametrize("op,shapes", [
    ("split_qkv", [(32, 16), (16, 16), (16, 16)]),  # 8 heads of 4, 4 groups
    ("split_qkv", [(32,), (16,), (16,)]),  # the same rule on a QKV bias (Qwen2)
    ("split_gate_up", [(24, 16), (24, 16)]),
    ("fused_qkv", [(16, 48)]),
    ("fused_qkv_bias", [(48,)]),
    ("transpose", [(16, 24)]),
    ("vocab", [(100, 16)]),
    ("copy", [(7, 3)]),
    ("layer_experts", [(3, 5)]),
    ("layer_experts_transpose", [(3, 6, 5)]),
    ("layer_experts_gate_up", [(3, 16, 24)]),  # GPT-OSS gate_up_proj [experts, hidden, 2 x ffn]
    ("layer_experts_gate_up", [(3, 24)]),  # ... and its bias
])
def test_rules_are_inverse(op, shapes):
    d = Dims(num_heads=8 if op == "split_qkv" else 4, num_groups=4, head_dim=4, hidden=16, vocab=100,
             padded_vocab=128)
    rule = RULES[op]("decoder.layers.x", tuple(f"hf{i}" for i in range(len(shapes))))
    ts = [torch.randn(s) for s in shapes]
    meg = rule.from_hf(ts, d)
    back = rule.to_hf(meg, d)
    assert len(back) == len(ts) and all(torch.equal(a, b) for a, b in zip(ts, back))
    if op == "vocab":
        assert meg.shape[0] == 128 and torch.count_nonzero(meg[100:]) == 0


def test_split_qkv_groups_heads_with_their_kv():
    # 4 query heads in 2 groups, head_dim 1, hidden 1: Megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    d = Dims(num_heads=4, num_groups=2, head_dim=1, hidden=1, vocab=1, padded_vocab=1)
    fused = torch.tensor([[0.0], [1], [10], [20], [2], [3], [11], [21]])
    q, k, v = QKV("w", ("q", "k", "v")).to_hf(fused, d)
    assert q.flatten().tolist() == [0, 1, 2, 3]
    assert k.flatten().tolist() == [10, 11] and v.flatten().tolist() == [20, 21]
    bias = QKV("b", ("q", "k", "v")).to_hf(fused.flatten(), d)
    assert [t.tolist() for t in bias] == [[0, 1, 2, 3], [10, 11], [20, 21]]


def test_rule_names_and_stacking():
    rule = QKV("decoder.layers.self_attention.linear_qkv.weight", ("m.{i}.q", "m.{i}.k", "m.{i}.v"))
    assert rule.stacked and rule.hf_names(3) == ["m.3.q", "m.3.k", "m.3.v"]
    assert not RULES["vocab"]("output_layer.weight", "lm_head.weight").stacked


def test_layer_experts_gate_up_interleaves_gate_and_up():
    """GPT-OSS's fused gate_up_proj [experts, hidden, 2·ffn] holds gate at even, up at odd columns; Megatron's fc1
    [experts, 2·ffn, hidden] the gate rows then the up rows. One layer converts at once; Megatron stores one slice
    per (layer, expert)."""
    from model_providers.core.mapping import EXPERTS_PREFIX, LayerExpertsGateUp

    d = Dims(num_heads=1, num_groups=1, head_dim=1, hidden=1, vocab=1, padded_vocab=1, num_experts=2)
    rule = LayerExpertsGateUp(EXPERTS_PREFIX + "linear_fc1.bias", "model.layers.{i}.mlp.experts.gate_up_proj_bias")
    fc1_bias = torch.tensor([[0.0, 1, 10, 11], [2, 3, 12, 13]])  # per expert: gate 0 1, up 10 11
    assert rule.to_hf(fc1_bias, d)[0].tolist() == [[0, 10, 1, 11], [2, 12, 3, 13]]
    weight = torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)  # [experts, 2·ffn, hidden]
    hf = LayerExpertsGateUp(EXPERTS_PREFIX + "linear_fc1.weight", "g").to_hf(weight, d)[0]
    assert hf.shape == (2, 3, 4) and torch.equal(hf[:, :, 0::2], weight[:, :2].transpose(1, 2))
    assert torch.equal(hf[:, :, 1::2], weight[:, 2:].transpose(1, 2))
    assert rule.indices(2, 2) == [0, 1] and rule.stack_dims == 1 and rule.hf_names(1) == [
        "model.layers.1.mlp.experts.gate_up_proj_bias"]
    assert rule.storage_slices(2, 2) == ((2, 2), [(0, 0), (0, 1), (1, 0), (1, 1)])
