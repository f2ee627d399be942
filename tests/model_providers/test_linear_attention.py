"""Gated DeltaNet's CPU pieces against transformers' reference PyTorch paths (`transformers.models.qwen3_next`):
the causal depthwise conv1d, the chunked gated delta rule (Megatron-Core's `torch_chunk_gated_delta_rule`, per
document) with L2-normed queries and keys, and the whole layer (`TorchGatedDeltaNet`: in_proj, conv, rule, gated
output norm, out_proj) — forward and gradients; packed documents equal the documents run alone.

The kernels compute in fp32 on both sides (transformers' and Megatron-Core's rules cast to fp32), so fp32 tolerances:
1e-5 relative on outputs and gradients. Across ranks the layer is checked through `train()`
(tests/pretrain/test_qwen3_next.py)."""

from __future__ import annotations

import json

import pytest
import torch

from model_providers.core.causal_conv1d import causal_conv1d
from model_providers.core.gated_delta_rule import gated_delta_rule, l2norm

DOCS = [(0, 23), (23, 63), (63, 70)]  # 70 tokens: one 64-token chunk and a part, boundaries inside the chunk


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _seq_idx(bounds, seq):
    idx = torch.zeros(1, seq, dtype=torch.int32)
    for n, (a, b) in enumerate(bounds):
        idx[0, a:b] = n
    return idx


def test_causal_conv1d_matches_transformers_forward_and_gradients():
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 12, 70, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, generator=gen, dtype=torch.float64, requires_grad=True)
    for act in ("silu", None):
        got = causal_conv1d(x, w, bias, act)
        want = causal_conv1d_fn(x, w, bias, activation=act)
        assert _rel(got, want) < 1e-13, act
        dy = torch.randn(got.shape, generator=gen, dtype=torch.float64)
        g1 = torch.autograd.grad((got * dy).sum(), (x, w, bias))
        g2 = torch.autograd.grad((want * dy).sum(), (x, w, bias))
        assert all(_rel(a, b) < 1e-13 for a, b in zip(g1, g2)), act


def test_causal_conv1d_does_not_mix_packed_documents():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 70, generator=gen)
    w, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    packed = causal_conv1d(x, w, bias, "silu", seq_idx=_seq_idx(DOCS, 70))
    alone = torch.cat([causal_conv1d(x[..., a:b], w, bias, "silu") for a, b in DOCS], dim=-1)
    assert torch.equal(packed, alone)
    assert not torch.equal(causal_conv1d(x, w, bias, "silu")[..., 23:26], packed[..., 23:26])  # taps cross otherwise


def _rule_inputs(seed: int, b: int = 2, s: int = 70, h: int = 4, dk: int = 16, dv: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, h, dk, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen, requires_grad=True)
    g = (-2 * torch.rand(b, s, h, generator=gen)).requires_grad_()
    beta = torch.rand(b, s, h, generator=gen).requires_grad_()
    return q, k, v, g, beta


@pytest.mark.mcore
def test_gated_delta_rule_matches_transformers_forward_and_gradients():
    """Ours (l2norm, then Megatron-Core's chunked rule) = transformers' chunked rule with the norm in the kernel, and
    its token-by-token recurrence, in value and in the gradients of q, k, v, g and beta."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    inputs = _rule_inputs(2)
    q, k, v, g, beta = inputs
    got = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)
    dy = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    ours = torch.autograd.grad((got * dy).sum(), inputs)
    for name, reference in (("chunked", torch_chunk_gated_delta_rule), ("recurrent", torch_recurrent_gated_delta_rule)):
        want, _ = reference(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        theirs = torch.autograd.grad((want * dy).sum(), inputs)
        assert _rel(got, want) < 1e-5, name
        rels = [_rel(a, b) for a, b in zip(ours, theirs)]
        print(name, f"forward {_rel(got, want):.1e}", "grads q k v g beta", [f"{r:.1e}" for r in rels])
        assert max(rels) < 1e-5, (name, rels)


@pytest.mark.mcore
def test_gated_delta_rule_resets_at_document_boundaries():
    q, k, v, g, beta = (t[:1].detach() for t in _rule_inputs(4))
    packed = gated_delta_rule(q, k, v, g, beta, bounds=DOCS)
    alone = torch.cat([gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b]) for a, b in DOCS],
                      dim=1)
    assert torch.equal(packed, alone)
    assert not torch.allclose(gated_delta_rule(q, k, v, g, beta)[:, 23:], packed[:, 23:])


@pytest.mark.slow
@pytest.mark.mcore
def test_gdn_layer_matches_transformers_and_packed_documents(tmp_path):
    """`TorchGatedDeltaNet` (Megatron-Core's GatedDeltaNet, our forward) = transformers' `Qwen3NextGatedDeltaNet` with
    the same weights (in_proj regrouped, out_norm zero-centred): output, input gradient and every weight gradient; three
    packed documents (THD) = each alone, and = transformers' layer on each alone. One rank (a pool case)."""
    from tests.pool import run_case
    from tests.pretrain.ckpt_helpers import log_text

    out = tmp_path / "gdn.json"
    rc = run_case(1, "tests.model_providers.gdn_layer_worker", [str(out)], tmp_path / "gdn.log", timeout=600)
    assert rc == 0, log_text(tmp_path / "gdn.log")[-4000:]
    r = json.loads(out.read_text())
    print(json.dumps(r))
    assert r["forward"] < 1e-5 and r["input_grad"] < 1e-5, r
    assert max(r["grads"].values()) < 1e-5, r["grads"]
    assert r["packed"] < 1e-6 and r["packed_grads"] < 1e-6 and r["packed_vs_hf"] < 1e-5, r
