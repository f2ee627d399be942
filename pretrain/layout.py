"""The derived layout: every fact computed from the config and the world size, computed once.

    plan = pretrain.run_plan.resolve(cfg, world_size)   # once per process; every stage reads plan.layout

Validation, model building, the runtime, the training loop, checkpoints, the HF bridge and the planner all
read these fields instead of re-deriving them: data-parallel size, "virtual pipeline or 1", the padded
vocabulary, the resolved precision, the Transformer Engine / local spec choice and the defaulted shape fields.
Pure data: no process groups, no torch at import.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from pretrain.compat import mcore
from pretrain.config import Config, OptimizerConfig, ParallelConfig

RESOLUTIONS: Counter[str] = Counter()  # per process: "layout" (derive_layout), "tokenizer" (pretrain.run_plan)


class LayoutError(ValueError):
    """The world size cannot hold the configured model-parallel sizes."""


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Vocabulary rounded up to a multiple of divisible_by × TP (Megatron's convention; its one owner here)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """`auto` is bf16 on GPU and fp32 on CPU."""
    if precision == "auto":
        return "bf16" if on_gpu else "fp32"
    return precision


@dataclass(frozen=True)
class ModelShape:
    """The shape fields whose config value may be null, with Megatron's defaults applied."""

    ffn_hidden_size: int  # null: 4 × hidden
    num_query_groups: int  # null: one group per head (multi-head attention)
    head_dim: int  # model.kv_channels; null: hidden / heads
    moe_ffn_hidden_size: int | None  # one expert's FFN size (None for a dense model); null: ffn_hidden_size


def model_shape(m) -> ModelShape:
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    return ModelShape(ffn_hidden_size=ffn,
                      num_query_groups=m.num_query_groups or m.num_attention_heads,
                      head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
                      moe_ffn_hidden_size=(m.moe_ffn_hidden_size or ffn) if m.num_moe_experts else None)


def resolved_model_fields(model: dict[str, Any], vocab: int | None) -> dict[str, Any]:
    """The model section's fields from a dict (as a run_config.yaml holds them; absent: the default) with their null
    defaults applied as `model_shape` applies them (null ffn_hidden_size = 4 × hidden, …), and a null vocab_size the
    tokenizer's `vocab` (the resume contract compares these)."""
    import dataclasses
    from types import SimpleNamespace

    from pretrain.config import ModelConfig

    values = {f.name: model.get(f.name, f.default) for f in dataclasses.fields(ModelConfig)}
    shape = model_shape(SimpleNamespace(**values))
    return {**values, "ffn_hidden_size": shape.ffn_hidden_size, "num_query_groups": shape.num_query_groups,
            "kv_channels": shape.head_dim, "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
            "vocab_size": values["vocab_size"] or vocab}


@dataclass(frozen=True)
class ExpertLayout:
    """How MoE expert layers split the world: expert TP × EP × expert DP × PP (Megatron-Core's expert groups).

    Experts are laid out independently of attention ("MoE parallel folding"): EP may span TP, CP and DP
    ranks of the attention layers, as long as expert TP × EP divides world / PP.
    """

    ep: int  # parallel.expert
    etp: int  # parallel.expert_tensor (null: parallel.tensor)
    edp: int  # expert data parallel: world / (etp × ep × pp); gradients of an expert are reduced over it


def expert_tensor_size(p: ParallelConfig) -> int:
    """Expert tensor parallelism: parallel.expert_tensor, else parallel.tensor (Megatron-Core's default)."""
    return p.expert_tensor or p.tensor


def expert_layout(p: ParallelConfig, world: int) -> ExpertLayout | None:
    """The expert layout of the parallel section `p`, or None when world / PP is not divisible by expert TP × EP."""
    etp = expert_tensor_size(p)
    per_stage = etp * p.expert * p.pipeline
    if per_stage < 1 or world % per_stage:
        return None
    return ExpertLayout(ep=p.expert, etp=etp, edp=world // per_stage)


def fsdp_sharding(o: OptimizerConfig) -> str | None:
    """What Megatron-FSDP shards (optimizer.fsdp_sharding of the optimizer section `o`, default optim_grads_params),
    None without FSDP."""
    return (o.fsdp_sharding or "optim_grads_params") if o.fsdp else None


def use_transformer_engine(transformer_impl: str, te_available: bool) -> bool:
    """The spec choice: TE when asked for, the local spec when asked for, else TE where it is usable."""
    if transformer_impl == "local":
        return False
    if transformer_impl == "transformer_engine":
        return True
    return te_available


@dataclass(frozen=True)
class Layout:
    """The parallel layout, numerics and defaulted shape of one run on `world` ranks."""

    world: int
    tp: int
    pp: int
    vp: int  # virtual pipeline stages per rank: 1 without interleaving
    cp: int
    dp: int
    sp: bool
    mbs: int
    gbs: int
    precision: str  # resolved: "bf16" | "fp16" | "fp32"
    distributed: bool  # distributed optimizer
    use_te: bool  # Transformer Engine spec (else the local spec)
    on_gpu: bool
    vocab_size: int | None  # true vocabulary (None: not known yet, e.g. validation without a tokenizer)
    padded_vocab: int | None
    ffn_hidden_size: int
    num_query_groups: int
    head_dim: int
    moe_ffn_hidden_size: int | None  # None: dense model
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel (resolved: parallel.tensor when unset)
    edp: int = 1  # expert data parallel
    moe_loss_scale: int = 1  # on the router aux/z-loss coefficients: pretrain.compat.mcore.moe_router_loss_scale
    fsdp_sharding: str | None = None  # Megatron-FSDP's data_parallel_sharding_strategy; None: no Megatron-FSDP
    first_stage_layers: int | None = None  # parallel.num_layers_in_first_pipeline_stage (uneven pipeline)
    last_stage_layers: int | None = None  # parallel.num_layers_in_last_pipeline_stage
    pipeline_layout: str | None = None  # parallel.pipeline_layout (Megatron-Core's pipeline_model_parallel_layout)
    embedding_in_split: bool = False  # parallel.account_for_embedding_in_pipeline_split
    loss_in_split: bool = False  # parallel.account_for_loss_in_pipeline_split

    @property
    def moe(self) -> bool:
        return self.moe_ffn_hidden_size is not None

    @property
    def virtual_pipeline(self) -> int | None:
        """Megatron's encoding: None without interleaving."""
        return self.vp if self.vp > 1 else None

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def num_microbatches(self) -> int:
        return self.gbs // (self.mbs * self.dp)

    @property
    def bytes_per_value(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def params_dtype(self) -> Any:
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.precision]

    def chunk_layers(self, num_layers: int, pp_rank: int, vp_stage: int) -> tuple[int, int]:
        """(first global layer, layers) of one model chunk: `chunk_layer_range`, or `pretrain.placement`'s for an
        explicit layout string or the embedding / loss counted in the split."""
        from pretrain import placement

        if self.pipeline_layout is not None:
            return placement.layout_chunk_range(self.pipeline_layout, self.pp, pp_rank, vp_stage)
        if self.embedding_in_split or self.loss_in_split:
            return placement.split_chunk_range(num_layers, self.pp, self.vp, pp_rank, vp_stage,
                                               self.embedding_in_split, self.loss_in_split)
        return chunk_layer_range(num_layers, self.pp, self.vp, pp_rank, vp_stage, self.first_stage_layers,
                                 self.last_stage_layers)

    @property
    def mtp_chunk(self) -> tuple[int, int]:
        """(pipeline rank, virtual stage) of the chunk holding the MTP layers (the last one unless the layout
        places them elsewhere)."""
        from pretrain.placement import mtp_chunk

        return mtp_chunk(self.pipeline_layout, self.pp, self.vp)

    def describe(self) -> str:
        vp = f" × VP{self.vp}" if self.vp > 1 else ""
        experts = f"; experts ETP{self.etp} × EP{self.ep} × EDP{self.edp}" if self.moe else ""
        return f"TP{self.tp} × PP{self.pp}{vp} × CP{self.cp} × DP{self.dp}{experts}"


def chunk_layer_range(num_layers: int, pp: int, vp: int, pp_rank: int, vp_stage: int, first: int | None = None,
                      last: int | None = None) -> tuple[int, int]:
    """(offset, count) of the decoder layers of model chunk (pp_rank, vp_stage), as Megatron-Core's
    `get_transformer_layer_offset` / `get_num_layers_to_build` place them: an even split, or with uneven stages
    (`first` / `last` layers on the first / last stage, each split over the virtual stages) the rest shared by the
    middle stages; virtual stage v of every rank before v + 1 of any."""
    if pp == 1 or (first is None and last is None):
        per = num_layers // (pp * vp)
        return (vp_stage * pp + pp_rank) * per, per
    f, lst = first or 0, last or 0
    middle_stages = pp - (first is not None) - (last is not None)
    per_middle = (num_layers - f - lst) // vp // middle_stages if middle_stages else 0  # per chunk of a middle stage
    per_vp_stage = f // vp + middle_stages * per_middle + lst // vp  # layers of one virtual stage, all ranks
    base = vp_stage * per_vp_stage
    if pp_rank == 0 and first is not None:
        return base, f // vp
    if pp_rank == pp - 1 and last is not None:
        return base + f // vp + middle_stages * per_middle, lst // vp
    return base + f // vp + (pp_rank - (first is not None)) * per_middle, per_middle


def te_available() -> bool:
    """True when CUDA is present and Transformer Engine's torch extension imports."""
    from model_providers.core.specs import transformer_engine_available

    return transformer_engine_available()


def derive_layout(cfg: Config, world: int, *, vocab_size: int | None = None, on_gpu: bool | None = None,
                  te: bool | None = None) -> Layout:
    """The layout of `cfg` on `world` ranks. `vocab_size`: the tokenizer's, when model.vocab_size is unset.

    `on_gpu` defaults to this machine's CUDA availability; `te` to whether Transformer Engine is usable here.
    """
    RESOLUTIONS["layout"] += 1
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if on_gpu is None:
        from pretrain.compat.cuda import cuda_available

        on_gpu = cuda_available()
    if te is None:
        te = te_available() if on_gpu else False
    model_parallel = p.tensor * p.pipeline * p.context
    if world < 1 or world % model_parallel:
        raise LayoutError(f"world size {world} is not divisible by tensor×pipeline×context = {model_parallel}")
    experts = expert_layout(cfg.parallel, world)
    if experts is None:
        raise LayoutError(f"world size {world} is not divisible by expert_tensor×expert×pipeline")
    vocab = m.vocab_size or vocab_size
    return Layout(
        world=world, tp=p.tensor, pp=p.pipeline, vp=p.virtual_pipeline or 1, cp=p.context,
        dp=world // model_parallel, sp=p.sequence_parallel, mbs=t.micro_batch_size, gbs=t.global_batch_size,
        precision=resolve_precision(t.precision, on_gpu), distributed=cfg.optimizer.distributed,
        use_te=use_transformer_engine(m.transformer_impl, te), on_gpu=on_gpu, vocab_size=vocab,
        padded_vocab=padded_vocab_size(vocab, m.make_vocab_size_divisible_by, p.tensor) if vocab else None,
        **vars(model_shape(m)), **vars(experts), moe_loss_scale=mcore.moe_router_loss_scale(p.tensor, p.context),
        fsdp_sharding=fsdp_sharding(cfg.optimizer),
        first_stage_layers=p.num_layers_in_first_pipeline_stage, last_stage_layers=p.num_layers_in_last_pipeline_stage,
        pipeline_layout=p.pipeline_layout, embedding_in_split=p.account_for_embedding_in_pipeline_split,
        loss_in_split=p.account_for_loss_in_pipeline_split,
    )
