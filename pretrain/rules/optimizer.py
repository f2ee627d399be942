"""Muon (optimizer.name=muon, optimizer.muon.*): what Megatron-Core's Muon supports, refused with the reason."""

from __future__ import annotations

from pretrain.config import ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
from pretrain.layout import Layout, use_transformer_engine
from pretrain.problems import Report


def muon_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, optimizer: OptimizerConfig,
               train: TrainConfig, lay: Layout | None, te_on_gpu: bool) -> None:
    """Muon's settings and the features it combines with (docs/training.md "Muon")."""
    o = optimizer
    if o.name != "muon":
        return
    m = o.muon
    from pretrain.compat.muon import COEFFICIENTS_FIXED, LAYER_WISE_FP32, MCORE, emerging_optimizers_missing

    missing = emerging_optimizers_missing()
    if missing:
        r.error("optimizer.name", f"optimizer.name=muon: {missing}",
                "run `make install` (or pip install emerging-optimizers), or set optimizer.name=adamw")
    if o.fsdp:
        r.error(("optimizer.name", "optimizer.fsdp"), "optimizer.name=muon does not run with Megatron-FSDP: "
                "Megatron-Core builds Muon over Megatron DDP only (Newton-Schulz needs each weight matrix whole, "
                "FSDP shards them flat)", "set optimizer.fsdp=false (optimizer.muon.layer_wise=true shards the "
                "optimizer over data parallel)")
    if o.distributed:
        r.error(("optimizer.name", "optimizer.distributed"), "optimizer.name=muon does not run inside the "
                "distributed optimizer: Megatron-Core refuses it ('muon with dist optimizer is not supported': the "
                "distributed optimizer shards the flat gradient buffer, Muon needs whole matrices)",
                "set optimizer.distributed=false; optimizer.muon.layer_wise=true shards Muon over data parallel "
                "by whole matrices (Megatron-Core's LayerWiseDistributedOptimizer)")
    if o.overlap_param_gather and m.layer_wise:
        r.error(("optimizer.overlap_param_gather", "optimizer.muon.layer_wise"), "optimizer.overlap_param_gather "
                "belongs to the distributed optimizer; the layer-wise optimizer all-gathers after its step",
                "set optimizer.overlap_param_gather=false")
    precision = lay.precision if lay is not None else train.precision
    if precision == "fp16":
        r.error(("optimizer.name", "train.precision"), "optimizer.name=muon does not run in fp16: Megatron-Core's "
                "Muon has no loss scaling", "set train.precision=bf16 (or fp32)")
    if m.layer_wise and precision == "fp32":
        r.error(("optimizer.muon.layer_wise", "train.precision"), f"optimizer.muon.layer_wise needs a 16-bit run on "
                f"megatron-core {MCORE}: {LAYER_WISE_FP32}", "set train.precision=bf16, or "
                "optimizer.muon.layer_wise=false (every data-parallel rank then updates every matrix)")
    if COEFFICIENTS_FIXED and m.coefficient_type != "quintic":
        r.error("optimizer.muon.coefficient_type", f"optimizer.muon.coefficient_type={m.coefficient_type}: "
                f"megatron-core {MCORE} always uses the quintic Newton-Schulz coefficients",
                "set optimizer.muon.coefficient_type=quintic (other sets need megatron-core >= 0.19)")
    tp = max(parallel.tensor, parallel.expert_tensor or 1)
    if tp > 1 and m.tp_mode == "blockwise":
        r.notes.append("optimizer.muon.tp_mode=blockwise (Megatron-Core's default): at tensor parallelism > 1 each "
                       "rank "
                       "orthogonalises its own shard of a matrix, not the whole matrix as one rank does; "
                       "tp_mode=duplicated (all-gather, every rank the whole) or distributed (split over TP) "
                       "orthogonalise the whole matrix")
    use_te = lay.use_te if lay is not None else use_transformer_engine(model.transformer_impl, te_on_gpu)
    if m.qk_clip and not use_te:
        r.error(("optimizer.muon.qk_clip", "model.transformer_impl"), "optimizer.muon.qk_clip needs Transformer "
                "Engine's core attention: Megatron-Core records each head's max attention logit only there (the "
                "local spec's DotProductAttention does not), so QK-clip would have nothing to clip by",
                "set optimizer.muon.qk_clip=false, or run on GPUs with Transformer Engine")
