"""The CPU Mamba-2 pieces (`causal_conv1d`, `ssd_scan`, `gated_rms_norm`, `CpuMambaMixer`) against transformers'
reference PyTorch path (`transformers.models.nemotron_h`: `causal_conv1d_fn`, `mamba2_chunk_scan`,
`NemotronHRMSNormGated`, `NemotronHMamba2Mixer` in training mode), forward and gradients, fp32 ≤ 1e-5 relative;
the scan against the plain per-token recurrence in fp64; packed documents (`seq_idx` / THD `PackedSeqParams`)
against the same documents run one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from model_providers.core.causal_conv1d import causal_conv1d
from model_providers.core.ssd import gated_rms_norm, ssd_scan

H = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
DOCS = (11, 17, 9)  # three packed documents, 37 tokens: chunk 8 splits them at different offsets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 99) -> list[torch.Tensor]:
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return list(torch.autograd.grad((out * probe).sum(), inputs))


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _scan_inputs(dtype=torch.float32, b=2, s=sum(DOCS), h=4, p=8, g=2, n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return dict(x=r(b, s, h, p), dt=r(b, s, h), A=-torch.rand(h, generator=gen, dtype=torch.float64).to(dtype) * 4,
                B=r(b, s, g, n), C=r(b, s, g, n), D=r(h), dt_bias=r(h), z=r(b, s, h, p))


def _recurrence(x, dt, A, B, C, D, seq_idx=None):
    """h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t, y_t = C_t h_t + D x_t, one token after another (fp64)."""
    b, s, h, p = x.shape
    rep = h // B.shape[2]
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1])
    out = []
    for t in range(s):
        if seq_idx is not None and t:
            state = state * (seq_idx[:, t] == seq_idx[:, t - 1]).to(x.dtype)[:, None, None, None]
        state = state * torch.exp(A * dt[:, t])[..., None, None] + (dt[:, t, :, None, None] * x[:, t, ..., None]
                                                                      * B[:, t, :, None, :])
        out.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(out, dim=1)


def test_causal_conv1d_equals_transformers_forward_and_gradients():
    gen = torch.Generator().manual_seed(1)
    x, w, bias = torch.randn(2, 6, 37, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    ours_in, ref_in = _leaves(x, w, bias), _leaves(x, w, bias)
    ours = causal_conv1d(*ours_in, activation="silu")
    ref = H.causal_conv1d_fn(*ref_in, activation="silu")
    assert _rel(ours, ref) <= 1e-6
    for a, b in zip(_grads(ours, ours_in), _grads(ref, ref_in)):
        assert _rel(a, b) <= 1e-6


def test_ssd_scan_equals_transformers_and_the_recurrence():
    i = _scan_inputs()
    dt = F.softplus(i["dt"] + i["dt_bias"])
    names = ("x", "dt", "A", "B", "C", "D")
    ours_in = _leaves(i["x"], dt, i["A"], i["B"], i["C"], i["D"])
    ours = ssd_scan(*ours_in[:5], 8, D=ours_in[5])
    ref_in = _leaves(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"])
    ref = H.mamba2_chunk_scan(*ref_in[:5], 8, D=ref_in[5], dt_bias=ref_in[6], dt_softplus=True)
    assert _rel(ours, ref) <= 1e-5
    g_ours, g_ref = _grads(ours, ours_in), _grads(ref, ref_in)
    for name, a, b in zip(names, g_ours, g_ref):
        if name == "dt":
            continue
        assert _rel(a, b) <= 1e-5, name
    # dt: ours is d/d(softplus(dt + bias)); transformers' is d/d(dt) = ours · sigmoid(dt + bias)
    assert _rel(g_ours[1] * torch.sigmoid(i["dt"] + i["dt_bias"]), g_ref[1]) <= 1e-5
    # fp64: the chunked scan is the per-token recurrence, forward and gradients
    i64 = {k: v.double() for k, v in i.items()}
    leaves64 = _leaves(i64["x"], F.softplus(i64["dt"] + i64["dt_bias"]), i64["A"], i64["B"], i64["C"], i64["D"])
    chunked, plain = ssd_scan(*leaves64[:5], 8, D=leaves64[5]), _recurrence(*leaves64)
    assert _rel(chunked, plain) <= 1e-12
    for a, b in zip(_grads(chunked, leaves64), _grads(plain, leaves64)):
        assert _rel(a, b) <= 1e-12


def test_gated_rms_norm_equals_transformers():
    gen = torch.Generator().manual_seed(2)
    y, z, w = torch.randn(3, 5, 32, generator=gen), torch.randn(3, 5, 32, generator=gen), torch.randn(32, generator=gen)
    norm = H.NemotronHRMSNormGated(32, group_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(w)
    ours_in, ref_in = _leaves(y, z), _leaves(y, z)
    ours, ref = gated_rms_norm(ours_in[0], w, 8, 1e-5, z=ours_in[1]), norm(*ref_in)
    assert _rel(ours, ref) <= 1e-6
    for a, b in zip(_grads(ours, ours_in), _grads(ref, ref_in)):
        assert _rel(a, b) <= 1e-6


def test_packed_documents_equal_documents_run_separately():
    """`seq_idx` resets the convolution and the scan state at every document start (fp64: ≤ 1e-12)."""
    i = {k: v.double()[:1] if v.dim() > 1 else v.double() for k, v in _scan_inputs(seed=3).items()}
    seq_idx = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))[None]
    dt = F.softplus(i["dt"] + i["dt_bias"])
    packed_in = _leaves(i["x"], dt, i["B"], i["C"])
    packed = ssd_scan(packed_in[0], packed_in[1], i["A"], packed_in[2], packed_in[3], 8, D=i["D"], seq_idx=seq_idx)
    conv_x = torch.randn(1, 6, sum(DOCS), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    conv_w = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    conv_in = _leaves(conv_x)
    conv = causal_conv1d(conv_in[0], conv_w, None, "silu", seq_idx=seq_idx)
    g_packed, g_conv = _grads(packed, packed_in), _grads(conv, conv_in)
    start = 0
    for n in DOCS:
        doc = slice(start, start + n)
        alone_in = _leaves(i["x"][:, doc], dt[:, doc], i["B"][:, doc], i["C"][:, doc])
        alone = ssd_scan(alone_in[0], alone_in[1], i["A"], alone_in[2], alone_in[3], 8, D=i["D"])
        assert _rel(packed[:, doc], alone) <= 1e-12
        probe = torch.randn(packed.shape, generator=torch.Generator().manual_seed(99), dtype=packed.dtype)[:, doc]
        for a, b in zip(g_packed, torch.autograd.grad((alone * probe).sum(), alone_in)):
            assert _rel(a[:, doc], b) <= 1e-12
        c_in = _leaves(conv_x[:, :, doc])
        c_alone = causal_conv1d(c_in[0], conv_w, None, "silu")
        assert torch.equal(conv[:, :, doc], c_alone)  # same taps, same order: the same bits
        probe = torch.randn(conv.shape, generator=torch.Generator().manual_seed(99), dtype=conv.dtype)[:, :, doc]
        assert torch.equal(g_conv[0][:, :, doc], torch.autograd.grad((c_alone * probe).sum(), c_in)[0])
        start += n


@pytest.fixture
def one_rank():
    """Megatron-Core's parallel state on a one-rank gloo group in this process (ended after the test)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _mixers(pg, chunk: int = 8):
    """Our mixer (Megatron-Core's local linear layers) and transformers' with the same weights (random A, dt
    bias, D, norm and conv bias so that every parameter matters)."""
    from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import NemotronHConfig

    from model_providers.core.mamba_mixer import CpuMambaMixer

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, mamba_state_dim=16,
                               mamba_head_dim=8, mamba_num_groups=2, mamba_num_heads=8, use_cpu_initialization=True,
                               is_hybrid_model=True)
    ours = CpuMambaMixer(config, MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                         d_model=64, chunk_size=chunk, pg_collection=pg, layer_number=1)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for param in ours.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.5 if param.dim() == 1 else 0.1))
    hf_config = NemotronHConfig(hidden_size=64, layers_block_type=["mamba"], mamba_num_heads=8, mamba_head_dim=8,
                                n_groups=2, ssm_state_size=16, chunk_size=chunk, layer_norm_epsilon=1e-5)
    theirs = H.NemotronHMamba2Mixer(hf_config, layer_idx=0)
    named = {_hf_name(k): v for k, v in ours.named_parameters()}
    theirs.load_state_dict({k: named[k].detach().clone() for k in theirs.state_dict()})
    return ours.train(), theirs.train()


def _hf_name(name: str) -> str:
    """transformers' name of a mixer parameter (Megatron-Core 0.19+ holds the convolution as `conv1d_weight`)."""
    return {"conv1d_weight": "conv1d.weight", "conv1d_bias": "conv1d.bias"}.get(name, name)


def _named_grads(module, out, seed=98):
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    params = {_hf_name(k): v for k, v in module.named_parameters()}
    return dict(zip(params, torch.autograd.grad((out * probe).sum(), list(params.values()))))


def test_cpu_mamba_mixer_equals_transformers_mixer(one_rank):
    """Megatron-Core's mixer on the CPU pieces = transformers' NemotronHMamba2Mixer: output and every parameter's
    gradient (fp32, ≤ 1e-5 relative); hidden states are (seq, batch, hidden) on ours, (batch, seq, hidden) there."""
    ours, theirs = _mixers(one_rank)
    x = torch.randn(sum(DOCS), 2, 64, generator=torch.Generator().manual_seed(7))
    out, bias = ours(x)
    ref = theirs(x.transpose(0, 1)).transpose(0, 1)
    assert bias is None and _rel(out, ref) <= 1e-5
    g_ours = _named_grads(ours, out)
    g_ref = _named_grads(theirs, ref.contiguous())
    assert set(g_ours) == set(g_ref)
    for name in g_ref:
        assert _rel(g_ours[name], g_ref[name]) <= 1e-5, name


def test_cpu_mamba_mixer_packed_documents_equal_transformers_per_document(one_rank):
    """THD packed documents (`PackedSeqParams`, one row): each document's output and the parameter gradients = the
    documents through transformers' mixer one at a time."""
    ours, theirs = _mixers(one_rank)
    x = torch.randn(sum(DOCS), 1, 64, generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0, *DOCS]).cumsum(0).to(torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=max(DOCS), max_seqlen_kv=max(DOCS))
    out, _ = ours(x, packed_seq_params=packed)
    refs = []
    start = 0
    for n in DOCS:
        refs.append(theirs(x[start:start + n].transpose(0, 1)).transpose(0, 1))
        start += n
    ref = torch.cat(refs)
    assert _rel(out, ref) <= 1e-5
    g_ours, g_ref = _named_grads(ours, out), _named_grads(theirs, ref.contiguous())
    for name in g_ref:
        assert _rel(g_ours[name], g_ref[name]) <= 1e-5, name
