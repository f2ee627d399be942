"""Megatron-Core's own answer to "which layers does this pipeline chunk build", asked rank by rank (its functions
read the pipeline rank and sizes from `parallel_state`, which is set here for each question, no process group)."""

from __future__ import annotations

from unittest import mock


def megatron_chunks(tc, pp: int, vp: int) -> dict[tuple[int, int], tuple[int, int, bool]]:
    """{(pipeline rank, virtual stage): (first decoder layer, decoder layers, builds the MTP layers)} of the
    `TransformerConfig` `tc` on `pp` stages of `vp` chunks, from Megatron-Core's own functions."""
    import megatron.core.parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import get_mtp_num_layers_to_build
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = {}
    for rank in range(pp):
        for stage in range(vp):
            v = stage if vp > 1 else None
            with mock.patch.object(ps, "get_pipeline_model_parallel_rank", return_value=rank), \
                    mock.patch.object(ps, "get_pipeline_model_parallel_world_size", return_value=pp), \
                    mock.patch.object(ps, "get_virtual_pipeline_model_parallel_world_size",
                                      return_value=vp if vp > 1 else None):
                mtp = bool(tc.mtp_num_layers) and bool(get_mtp_num_layers_to_build(tc, vp_stage=v, pp_rank=rank))
                out[(rank, stage)] = (get_transformer_layer_offset(tc, vp_stage=v, pp_rank=rank),
                                      get_num_layers_to_build(tc, vp_stage=v, pp_rank=rank), mtp)
    return out
