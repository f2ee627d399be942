"""Pipeline placement rules: `parallel.pipeline_layout` and `parallel.account_for_{embedding,loss}_in_pipeline_split`,
with Megatron-Core's own checks (its `PipelineParallelLayerLayout` and `TransformerConfig` rules), and the
per-stage placement printed as a note."""

from __future__ import annotations

from pretrain.config import ModelConfig, ParallelConfig
from pretrain.layout import Layout
from pretrain.problems import Report

LAYOUT = "parallel.pipeline_layout"
EMBEDDING = "parallel.account_for_embedding_in_pipeline_split"
LOSS = "parallel.account_for_loss_in_pipeline_split"
UNEVEN = ("parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage")


def explicit_placement(p: ParallelConfig) -> bool:
    """The parallel section `p` places layers by a layout string or by counting the embedding / loss in the split."""
    return p.pipeline_layout is not None or p.account_for_embedding_in_pipeline_split or \
        p.account_for_loss_in_pipeline_split


def placement_rules(r: Report, m: ModelConfig, p: ParallelConfig) -> None:
    """The placement options exclude each other as in Megatron-Core, and each one splits the model's layers."""
    uneven = [k for k, v in zip(UNEVEN, (p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage))
              if v is not None]
    split = [k for k, v in ((EMBEDDING, p.account_for_embedding_in_pipeline_split),
                            (LOSS, p.account_for_loss_in_pipeline_split)) if v]
    if p.pipeline_layout is not None and (uneven or split):
        r.error((LAYOUT, *uneven, *split), f"{LAYOUT} places every layer itself: it cannot be combined with "
                f"{', '.join(uneven + split)} (Megatron-Core refuses both)", f"remove {', '.join(uneven + split)}")
        return
    if split and uneven:
        r.error((*split, *uneven), f"{', '.join(split)} cannot be combined with {', '.join(uneven)} (Megatron-Core "
                "refuses both)", "choose one way to place the layers")
        return
    if p.pipeline_layout is not None:
        _layout_rules(r, m, p)
    elif split:
        _split_rules(r, m, p, split)


def _layout_rules(r: Report, m: ModelConfig, p: ParallelConfig) -> None:
    """Megatron-Core's PipelineParallelLayerLayout checks, and parallel.virtual_pipeline against the stage count."""
    from pretrain.placement import PlacementError, check_layout, shown

    try:
        vp, standalone = check_layout(p.pipeline_layout, p.pipeline, m.num_layers, m.mtp_num_layers)
    except PlacementError as e:
        r.error((LAYOUT, "parallel.pipeline", "model.num_layers") + (("model.mtp_num_layers",) if m.mtp_num_layers
                                                                     else ()),
                f"{LAYOUT}={shown(p.pipeline_layout)} {e}",
                "one `|`-separated stage per pipeline rank × virtual stage, E first, L last, "
                f"{m.num_layers} `t` and {m.mtp_num_layers or 0} `m` (after the last `t`, in a last virtual stage)")
        return
    want = vp if vp > 1 else None
    if p.virtual_pipeline != want:
        stages = vp * p.pipeline
        r.error((LAYOUT, "parallel.virtual_pipeline"),
                f"{LAYOUT} has {stages} stages = parallel.pipeline={p.pipeline} × {vp} virtual stages, but "
                f"parallel.virtual_pipeline={p.virtual_pipeline or 'null'}", f"set parallel.virtual_pipeline={want}"
                if want else "set parallel.virtual_pipeline=null")
    if standalone:
        r.error((LAYOUT, "model.mtp_num_layers"), f"{LAYOUT} puts the MTP layers on a pipeline rank other than the "
                "last (Megatron-Core's mtp_standalone): not supported by this trainer",
                "place the `m` layers in the last pipeline rank's last stage, e.g. `...|tmL`")


def _split_rules(r: Report, m: ModelConfig, p: ParallelConfig, split: list[str]) -> None:
    """What Megatron-Core's TransformerConfig asserts for the embedding / loss counted as layers of the split."""
    vp = p.virtual_pipeline if p.virtual_pipeline and p.virtual_pipeline >= 2 else 1
    total = m.num_layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
    if p.pipeline < 2:
        r.error((*split, "parallel.pipeline"), f"{', '.join(split)} needs parallel.pipeline > 1",
                "set parallel.pipeline >= 2, or remove it")
    elif total % (p.pipeline * vp):
        r.error((*split, "model.num_layers", "parallel.pipeline") + (("parallel.virtual_pipeline",) if vp > 1 else ()),
                f"model.num_layers={m.num_layers} + {total - m.num_layers} (embedding / loss counted as layers) = "
                f"{total} is not divisible by pipeline stages {p.pipeline}{f'×{vp}' if vp > 1 else ''} = "
                f"{p.pipeline * vp}", "choose a stage count dividing "
                f"{total}, or a parallel.pipeline_layout")


def placement_note(r: Report, m: ModelConfig, lay: Layout | None) -> None:
    """The per-stage placement of an explicit or uneven placement (model section `m`), as a note (nothing for an
    even split)."""
    if lay is None or r.errors:
        return
    from pretrain.placement import placement_lines

    lines = placement_lines(lay, m.num_layers, m.mtp_num_layers)
    if lines:
        r.notes.append("\n      ".join(lines))
