"""One Gated DeltaNet layer, ours (`TorchGatedDeltaNet` from the local spec) against transformers'
`Qwen3NextGatedDeltaNet` with the same weights: forward and every gradient; packed documents (THD) against each document
alone. Run on one rank (a pool case): `python -m tests.model_providers.gdn_layer_worker OUT.json`.

Writes {"forward": rel, "grads": {name: rel}, "packed": rel, "packed_grads": rel} (relative L2 differences) to OUT.json.
"""

from __future__ import annotations

import json
import sys

H, NK, NV, DK, DV, WIDTH, EPS = 32, 2, 4, 8, 6, 4, 1e-6


def _rel(a, b) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def _models():
    import torch
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from model_providers.core.linear_attention import _gdn_spec

    cfg = TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=4, normalization="RMSNorm", layernorm_epsilon=EPS,
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False, use_cpu_initialization=True,
        layernorm_zero_centered_gamma=True, experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
        linear_conv_kernel_dim=WIDTH, linear_key_head_dim=DK, linear_value_head_dim=DV, linear_num_key_heads=NK,
        linear_num_value_heads=NV, hidden_dropout=0.0, attention_dropout=0.0)
    ours = build_module(_gdn_spec(cfg, False), config=cfg, layer_number=1,
                        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    hf_cfg = Qwen3NextConfig(hidden_size=H, linear_conv_kernel_dim=WIDTH, linear_key_head_dim=DK,
                             linear_value_head_dim=DV, linear_num_key_heads=NK, linear_num_value_heads=NV,
                             num_hidden_layers=2, rms_norm_eps=EPS, hidden_act="silu")
    hf = Qwen3NextGatedDeltaNet(hf_cfg, 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        hf.A_log.uniform_(0.0, 2.0, generator=gen)
        hf.norm.weight.add_(1.0)
        # HF groups in_proj_qkvz per key head [q, k, v, z] and in_proj_ba per key head [b, a]; Megatron-Core's in_proj
        # is [q all heads; k; v; z; b; a]. The zero-centred out_norm stores HF's weight − 1.
        r = NV // NK
        q, k, v, z = hf.in_proj_qkvz.weight.view(NK, 2 * DK + 2 * r * DV, H).split([DK, DK, r * DV, r * DV], dim=1)
        b, a = hf.in_proj_ba.weight.view(NK, 2 * r, H).split([r, r], dim=1)
        ours.in_proj.weight.copy_(torch.cat([t.reshape(-1, H) for t in (q, k, v, z, b, a)]))
        ours.conv1d.weight.copy_(hf.conv1d.weight)
        ours.A_log.copy_(hf.A_log)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.out_norm.weight.copy_(hf.norm.weight - 1.0)
        ours.out_proj.weight.copy_(hf.out_proj.weight)
    return ours, hf


def _grads(module) -> dict:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def _hf_grads_as_ours(hf) -> dict:
    """transformers' gradients under our parameter names (in_proj regrouped as the weights were)."""
    import torch

    g = {name: p.grad for name, p in hf.named_parameters()}
    r = NV // NK
    q, k, v, z = g["in_proj_qkvz.weight"].view(NK, -1, H).split([DK, DK, r * DV, r * DV], dim=1)
    b, a = g["in_proj_ba.weight"].view(NK, 2 * r, H).split([r, r], dim=1)
    return {"in_proj.weight": torch.cat([t.reshape(-1, H) for t in (q, k, v, z, b, a)]),
            "conv1d.weight": g["conv1d.weight"], "A_log": g["A_log"], "dt_bias": g["dt_bias"],
            "out_norm.weight": g["norm.weight"], "out_proj.weight": g["out_proj.weight"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import torch
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.run.runtime import init_distributed

    init_distributed()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    try:
        ours, hf = _models()
        x = torch.randn(2, 70, H, generator=torch.Generator().manual_seed(1))  # 70: a chunk of 64 and a part chunk
        dy = torch.randn(2, 70, H, generator=torch.Generator().manual_seed(2))
        xh, xo = x.clone().requires_grad_(), x.transpose(0, 1).contiguous().requires_grad_()
        yh = hf(xh)
        yo = ours(xo, None)[0].transpose(0, 1)
        (yh * dy).sum().backward()
        (yo * dy).sum().backward()
        want, got = _hf_grads_as_ours(hf), _grads(ours)
        result = {"forward": _rel(yo, yh), "input_grad": _rel(xo.grad.transpose(0, 1), xh.grad),
                  "grads": {n: _rel(got[n], want[n]) for n in want}}
        # Packed documents: one THD row of three documents against each document alone.
        lengths = [23, 40, 7]
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        row = x[:1].transpose(0, 1).contiguous().requires_grad_()
        ours.zero_grad()
        y_packed = ours(row, None, packed_seq_params=packed)[0]
        (y_packed * dy[:1].transpose(0, 1)).sum().backward()
        grads_packed = _grads(ours)
        ours.zero_grad()
        alone, starts = [], cu.tolist()
        for a, b in zip(starts[:-1], starts[1:]):
            y = ours(row[a:b].detach(), None)[0]
            (y * dy[:1, a:b].transpose(0, 1)).sum().backward()
            alone.append(y)
        y_alone = torch.cat(alone)
        result["packed"] = _rel(y_packed, y_alone)
        result["packed_grads"] = max(_rel(grads_packed[n], p.grad) for n, p in ours.named_parameters())
        hf_alone = torch.cat([hf(x[:1, a:b]) for a, b in zip(starts[:-1], starts[1:])], dim=1)
        result["packed_vs_hf"] = _rel(y_packed.transpose(0, 1), hf_alone)
        print(json.dumps(result, indent=1))
        with open(argv[0], "w") as f:
            json.dump(result, f)
    finally:
        parallel_state.destroy_model_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
