"""The CPU context-parallel attention's pieces in one process (fp64): the hand-written ring backward (GQA, causal,
packed documents, attention dropout) against autograd's numerical gradient, the ring's output against the plain
masked attention, and the THD token order against the bshd zigzag order. Across ranks the module is checked through
`train()` (tests/pretrain/test_context_parallel.py)."""

from __future__ import annotations

import contextlib

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from model_providers.core import cp_layout
from model_providers.core.cp_attention import attend
from model_providers.core.cp_ring import ring_attention

S, B, HEADS, GROUPS, D = 8, 2, 4, 2, 3  # GQA: two heads per query group


def _inputs(seed: int, s: int = S, b: int = B):
    gen = torch.Generator().manual_seed(seed)
    shape = (s, b)
    q = torch.randn(*shape, HEADS, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*shape, GROUPS, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*shape, GROUPS, D, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _seeded_fork(seed: int):
    """An RNG context that draws the same dropout masks at every call (gradcheck calls forward many times)."""

    @contextlib.contextmanager
    def fork():
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            yield

    return fork


def _packed(lengths: list[int]) -> PackedSeqParams:
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def test_ring_backward_matches_numerical_gradient_with_dropout():
    q, k, v = (x[:4, :1, : x.shape[2] // 2].detach().requires_grad_() for x in _inputs(0))  # 2 heads, 1 group
    places = [cp_layout.placement(4, 1, 0)]

    def ring(q, k, v):
        return ring_attention(q, k, v, places, 0, None, 0.37, True, 0.25, _seeded_fork(7))

    assert torch.autograd.gradcheck(ring, (q, k, v), eps=1e-6, atol=1e-8)


def test_ring_matches_masked_attention_on_packed_documents():
    """One sequence of three documents (THD, batch 1): the ring's block and `attend` give the same output and
    gradients; a document's tokens never see another document's."""
    q, k, v = _inputs(1, s=S + 4, b=1)
    places = [cp_layout.placement(S + 4, 1, 0, _packed([5, 4, 3]))]
    got = ring_attention(q, k, v, places, 0, None, 0.5, True)
    want = attend(q, k, v, cp_layout.allowed(places[0], places[0], True), 0.5)
    assert torch.allclose(got, want, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, expected))
    ok = cp_layout.allowed(places[0], places[0], True)
    assert not ok[5:, :5].any() and ok[4, 0] and not ok[0, 4]


def test_thd_order_of_one_document_is_the_zigzag_order():
    """A single unpadded document of length s split over CP ranks takes the same tokens as
    `get_batch_on_this_cp_rank` (chunks r and 2·CP−1−r); padding tokens are marked invalid."""
    for cp in (2, 4):
        cu = torch.tensor([0, 8 * cp], dtype=torch.int32)
        for rank in range(cp):
            assert torch.equal(cp_layout.thd_partition_index(cu, cp, rank),
                               cp_layout.zigzag_positions(8, cp, rank))
    packed = _packed([3])
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens_q, cu_seqlens_kv=packed.cu_seqlens_q,
                             cu_seqlens_q_padded=torch.tensor([0, 4], dtype=torch.int32),
                             cu_seqlens_kv_padded=torch.tensor([0, 4], dtype=torch.int32), max_seqlen_q=4,
                             max_seqlen_kv=4)
    place = cp_layout.placement(2, 2, 1, packed)  # rank 1 of CP2: chunks 1 and 2 of 4 → tokens 1, 2
    assert place.pos.tolist() == [1, 2] and place.valid.tolist() == [True, True]
    place = cp_layout.placement(2, 2, 0, packed)  # rank 0: tokens 0 and 3 (3 is padding)
    assert place.pos.tolist() == [0, 3] and place.valid.tolist() == [True, False]


def test_window_mask_is_megatrons_and_the_ring_honours_it():
    """A window of left size 2 (transformers' sliding_window 3): the placement mask equals the complement of
    Megatron-Core's `get_sliding_window_causal_mask` (what `DotProductAttention` applies at one rank), per document
    under THD; the ring's output and hand-written gradients equal masked attention's, with a numerical check."""
    from unittest import mock

    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    places = [cp_layout.placement(S, 1, 0)]
    ok = cp_layout.allowed(places[0], places[0], True, window=2)
    ones = torch.ones
    with mock.patch.object(torch, "ones", lambda *a, device=None, **k: ones(*a, **k)):  # it asks for CUDA
        megatron = get_sliding_window_causal_mask(S, S, (2, 0))
    assert torch.equal(ok, ~megatron)
    q, k, v = _inputs(2, s=S + 4, b=1)
    places = [cp_layout.placement(S + 4, 1, 0, _packed([5, 4, 3]))]
    ok = cp_layout.allowed(places[0], places[0], True, window=2)
    assert ok[4, 2] and not ok[4, 1] and not ok[5, 4] and ok.sum(dim=1).max() == 3
    got = ring_attention(q, k, v, places, 0, None, 0.5, True, window=2)
    want = attend(q, k, v, ok, 0.5)
    assert torch.allclose(got, want, atol=1e-12)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, expected))
    small = [x[:6].detach().requires_grad_() for x in _inputs(3, s=6, b=1)]
    six = [cp_layout.placement(6, 1, 0)]
    assert torch.autograd.gradcheck(lambda q, k, v: ring_attention(q, k, v, six, 0, None, 0.4, True, window=1),
                                    tuple(small), eps=1e-6, atol=1e-8)
