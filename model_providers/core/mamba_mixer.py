"""Megatron-Core's Mamba-2 mixer where the `mamba_ssm` / `causal_conv1d` CUDA kernels are absent (CPU, and GPUs
without those packages): `CpuMambaMixer`, a layer-spec submodule in place of `MambaMixer`.

It is Megatron-Core's `MambaMixer` (subclassed: the same parameters, names, TP split, checkpoint layout, context-
parallel all-to-all) with the two pieces that need the kernels replaced by plain PyTorch: the causal depthwise
convolution (`model_providers/core/causal_conv1d.py`) and the chunked SSD scan with its gated group RMSNorm
(`model_providers/core/ssd.py`). The forward is the training path of `MambaMixer` (`_ssm_training`:
`mamba_split_conv1d_scan_combined` without a fused norm, then `RMSNormGated` by groups): in_proj → [z, x, B, C,
dt] → conv1d + silu over [x, B, C] → SSD scan with the D skip, gated by silu(z) → group RMSNorm (eps 1e-5, one
group per `mamba_num_groups`, as Megatron-Core builds it) → out_proj. Packed documents (`PackedSeqParams`, THD)
become the per-token document index `seq_idx` of both pieces, so no state crosses a document boundary; under
context parallelism Megatron-Core's all-to-all runs and the THD token order is restored with our CP layout's partition
indices (Megatron-Core takes Transformer Engine's). Inference (a key/value cache) is not supported here.

Releases: 0.16.1–0.18 keep the convolution as an `nn.Conv1d` (`mixer.conv1d.weight`), 0.19+ as two parameters
(`mixer.conv1d_weight`); both store them under `conv1d.weight` / `conv1d.bias` in checkpoints. The mixer builds
whichever form its release's `MambaMixer` (and `MambaContextParallel`) uses, found from the class itself.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import nn

from model_providers.core.causal_conv1d import causal_conv1d
from model_providers.core.ssd import gated_rms_norm, ssd_scan

NORM_EPS = 1e-5  # Megatron-Core's MambaMixer builds its gated RMSNorm with this epsilon (not layernorm_epsilon)


@functools.lru_cache(maxsize=1)
def mamba_kernels_available() -> bool:
    """True when Megatron-Core's `MambaMixer` can run: CUDA with the `mamba_ssm` and `causal_conv1d` packages."""
    if not torch.cuda.is_available():
        return False
    from megatron.core.ssm import mamba_mixer

    return bool(getattr(mamba_mixer, "HAVE_MAMBA_SSM", False)) and getattr(mamba_mixer, "causal_conv1d_fn", None)


def _conv_as_parameters() -> bool:
    """Whether this release's `MambaMixer` holds its convolution as `conv1d_weight` / `conv1d_bias` (0.19+)."""
    return "conv1d_weight" in MambaMixer.__init__.__code__.co_names


def _mark_tp(param: torch.Tensor) -> None:
    """A parameter split over TP by rows (what Megatron-Core's mixer sets, plus the split dim our init reads)."""
    param.tensor_model_parallel = True
    param.partition_dim = 0
    param.partition_stride = 1


class GroupRMSNorm(MegatronModule):
    """The mixer's gated RMSNorm as Megatron-Core calls it: the gate is already applied (in the scan), so this is an
    RMSNorm over groups of channels, times `weight`. Stored as `norm.weight`, split over TP by rows."""

    def __init__(self, config, hidden_size: int, group_size: int, eps: float = NORM_EPS):
        super().__init__(config)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        _mark_tp(self.weight)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(y, self.weight, self.group_size, self.eps)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"weight": 0}, sharded_offsets)


class CpuMambaMixer(MambaMixer):
    """Megatron-Core's `MambaMixer` on plain PyTorch (module docstring). Takes `MambaMixer`'s arguments; the
    initial values are redrawn by the builder's layout-invariant initialisation."""

    def __init__(self, config, submodules, d_model, d_conv=4, conv_init=None, expand=2, A_init_range=(1, 16),
                 D_has_hdim=False, rmsnorm=True, norm_before_gate=False, dt_min=0.001, dt_max=0.1, dt_init="random",
                 dt_scale=1.0, dt_init_floor=1e-4, bias=False, conv_bias=True, chunk_size=128, layer_number=None,
                 pg_collection=None, pp_layer_offset=0, **_unused):
        MegatronModule.__init__(self, config)
        if bias or D_has_hdim or norm_before_gate or not rmsnorm:
            raise ValueError("CpuMambaMixer: only Megatron-Core's defaults (no bias, D per head, the gated norm "
                             "after the gate) are implemented")
        self.config, self.d_model, self.d_conv, self.conv_init = config, d_model, d_conv, conv_init
        self.expand, self.D_has_hdim, self.rmsnorm, self.norm_before_gate = expand, D_has_hdim, rmsnorm, False
        self.chunk_size, self.layer_number, self.pp_layer_offset = chunk_size, layer_number, pp_layer_offset
        self.dt_min, self.dt_max, self.dt_init_floor, self.A_init_range = dt_min, dt_max, dt_init_floor, A_init_range
        self.pg_collection, self.tp_group = pg_collection, pg_collection.tp
        self.use_mem_eff_path, self.cached_batch_size, self.activation = True, None, "silu"
        self.d_state, self.headdim = config.mamba_state_dim, config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        self.nheads = config.mamba_num_heads or int(expand * d_model) // self.headdim
        self.d_inner = self.nheads * self.headdim
        tp = self.tp_group.size()
        self.nheads_local_tp, self.d_inner_local_tp = self.nheads // tp, self.d_inner // tp
        self.ngroups_local_tp = self.ngroups // tp
        dtype = config.params_dtype
        self.in_proj = build_module(
            submodules.in_proj, d_model, self.d_inner * 2 + 2 * self.ngroups * self.d_state + self.nheads,
            config=config, init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", tp_group=self.tp_group)
        conv_dim = self.d_inner_local_tp + 2 * self.ngroups_local_tp * self.d_state
        conv_weight = nn.Parameter(torch.empty(conv_dim, 1, d_conv, dtype=dtype))
        conv_bias_param = nn.Parameter(torch.zeros(conv_dim, dtype=dtype)) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(self.nheads_local_tp, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.nheads_local_tp, dtype=torch.float32))  # fp32, as Megatron-Core
        self.D = nn.Parameter(torch.ones(self.nheads_local_tp, dtype=torch.float32))
        cp_kwargs = dict(cp_group=pg_collection.cp, d_inner_local_tp=self.d_inner_local_tp,
                         nheads_local_tp=self.nheads_local_tp, ngroups_local_tp=self.ngroups_local_tp,
                         d_state=self.d_state, dt_bias_cp1=self.dt_bias, A_log_cp1=self.A_log, D_cp1=self.D,
                         D_has_hdim=False)
        if _conv_as_parameters():
            self.conv1d_weight, self.conv1d_bias = conv_weight, conv_bias_param
            cp_kwargs.update(conv1d_weight_cp1=conv_weight, conv1d_bias_cp1=conv_bias_param, conv1d_padding=d_conv - 1)
        else:
            self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1, bias=conv_bias,
                                    dtype=dtype)
            self.conv1d.weight, self.conv1d.bias = conv_weight, conv_bias_param
            cp_kwargs.update(conv1d_cp1=self.conv1d)
        for param in (conv_weight, conv_bias_param, self.dt_bias, self.A_log, self.D):
            if param is not None:
                _mark_tp(param)
        with torch.no_grad():
            bound = 1.0 / math.sqrt(d_conv) if conv_init is None else conv_init
            conv_weight.uniform_(-bound, bound)
        self.norm = GroupRMSNorm(config, self.d_inner_local_tp, self.d_inner_local_tp // self.ngroups_local_tp)
        self.out_proj = build_module(
            submodules.out_proj, self.d_inner, d_model, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=self.tp_group)
        self.cp = MambaContextParallel(**cp_kwargs)

    def forward(self, hidden_states, inference_context=None, *, inference_params=None, packed_seq_params=None):
        """hidden_states (seq, batch, hidden) → (output, output bias), as `MambaMixer.forward` in training."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("CpuMambaMixer has no inference cache (use Megatron-Core's MambaMixer)")
        zxBCdt, _ = self.in_proj(hidden_states)
        thd_cp = packed_seq_params is not None and self.cp.cp_size > 1
        if not thd_cp:
            zxBCdt = self.cp.pre_conv_ssm(zxBCdt, packed_seq_params)
            y = self.cp.post_conv_ssm(self._scan(zxBCdt, packed_seq_params), packed_seq_params)
            return self.out_proj(self.norm(y))
        # Packed documents under CP: Megatron-Core reorders THD tokens with Transformer Engine's partition indices;
        # here its all-to-all runs on the zigzag path and the order is fixed with the same indices (cp_layout).
        from megatron.core.ssm.mamba_context_parallel import (
            _redo_attention_load_balancing,
            _undo_attention_load_balancing,
        )

        cp = self.cp.cp_size
        order = _thd_order(packed_seq_params, cp)  # the global position of each token, CP ranks concatenated
        gathered = _redo_attention_load_balancing(self.cp.pre_conv_ssm(zxBCdt, None), cp, None)
        full = torch.empty_like(gathered)
        full[order] = gathered
        y = self._scan(full, packed_seq_params)[order]
        y = self.cp.post_conv_ssm(_undo_attention_load_balancing(y, cp, None), None)
        return self.out_proj(self.norm(y))

    def _scan(self, zxBCdt: torch.Tensor, packed_seq_params) -> torch.Tensor:
        """conv1d + SSD scan + gate on this rank's heads: (seq, batch, projections) → (seq, batch, d_inner)."""
        cp = self.cp
        heads, groups, state = cp.nheads_local_tpcp, cp.ngroups_local_tpcp, self.d_state
        inner = heads * self.headdim
        zxBCdt = zxBCdt.transpose(0, 1)  # (batch, seq, ...)
        batch, seq, _ = zxBCdt.shape
        z, xBC, dt = torch.split(zxBCdt, [inner, inner + 2 * groups * state, heads], dim=-1)
        seq_idx = document_index(packed_seq_params, seq) if packed_seq_params is not None else None
        xBC = causal_conv1d(xBC.transpose(1, 2), cp.get_conv1d_weight().squeeze(1), cp.get_conv1d_bias(),
                            self.activation, seq_idx).transpose(1, 2)
        x, B, C = torch.split(xBC, [inner, groups * state, groups * state], dim=-1)
        dt = F.softplus(dt.float() + cp.get_dt_bias().float())
        A = -torch.exp(cp.get_A_log().float())
        y = ssd_scan(x.reshape(batch, seq, heads, self.headdim), dt, A, B.reshape(batch, seq, groups, state),
                     C.reshape(batch, seq, groups, state), self.chunk_size, D=cp.get_D(),
                     z=z.reshape(batch, seq, heads, self.headdim), seq_idx=seq_idx)
        return y.reshape(batch, seq, inner).to(zxBCdt.dtype).transpose(0, 1)


def _thd_order(packed_seq_params, cp: int) -> torch.Tensor:
    """Where each token of the CP ranks' THD shares (rank 0's, then rank 1's, ...) sits in the packed sequence."""
    from model_providers.core.cp_layout import thd_partition_index

    cu = packed_seq_params.cu_seqlens_q_padded
    return torch.cat([thd_partition_index(cu, cp, rank) for rank in range(cp)])


def document_index(packed_seq_params, total: int) -> torch.Tensor:
    """(1, total) int32: the document of each token of a THD microbatch (the padded cumulative lengths when given,
    as Megatron-Core's mixer reads them); tokens after the last document form one more."""
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    bounds = torch.cat([cu.to(torch.long), torch.tensor([total], dtype=torch.long, device=cu.device)])
    lengths = (bounds[1:] - bounds[:-1]).clamp(min=0)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)[None].to(torch.int32)
