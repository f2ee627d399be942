"""Every pair and triple of {TP+SP, PP, VP, CP (each comm type), EP, FSDP, distributed optimizer, document masks, MTP,
recompute, sliding window, attention sinks, Gated DeltaNet layers} and every pair of those with {a pipeline layout
string, the embedding and loss in the split, Muon} that `validate` accepts builds every Megatron-Core config object
training builds,
in-process, in seconds (`tests/pretrain/combinations.py`; the same matrix trains in `make test-all`:
`test_feature_matrix.py`).

Megatron-Core asserts many combinations at build time (TransformerConfig's `__post_init__`, the layer specs of each
pipeline stage, the DDP and optimizer configs): a combination `validate` accepts but Megatron refuses would kill
every rank after launch. The specs read this rank's pipeline stage from Megatron's parallel state; here each stage
is built in turn with the parallel state's pipeline rank and sizes patched (no process group)."""

from __future__ import annotations

import collections
import contextlib
import time
from unittest import mock

from model_providers.core.model_plan import model_plan
from pretrain.__main__ import main
from pretrain.config import load_config
from pretrain.layout import derive_layout
from pretrain.validate import validate
from tests.pretrain.combinations import (
    PLACEMENTS,
    case_name,
    combinations,
    config_name,
    overrides,
    placement_world,
    world_size,
)

# The reasons validate gives for the combinations it refuses (their keys), each for a stated limitation.
REFUSALS = {
    ("optimizer.fsdp", "parallel.pipeline"),  # Megatron-FSDP without pipeline parallelism (megatron-core 0.16.1)
    ("optimizer.fsdp", "parallel.expert"),  # Megatron-FSDP's gradient norm under EP (0.16.1)
    ("data.reset_attention_mask", "parallel.context", "parallel.virtual_pipeline"),  # gloo, VP on 2 stages
    ("model.sliding_window", "parallel.cp_comm_type"),  # Transformer Engine: windows under CP only with a2a/all_gather
    ("model.softmax_type", "parallel.cp_comm_type"),  # sinks: not in the CPU ring (p2p); TE under CP: a2a only
    ("optimizer.name", "optimizer.fsdp"),  # Muon needs whole matrices: Megatron-Core builds it over Megatron DDP only
    ("optimizer.name", "optimizer.distributed"),  # ... and refuses it inside the distributed optimizer
    ("model.experimental_attention_variant", "parallel.context"),  # Gated DeltaNet: no context parallelism
    # Gated DeltaNet on GPUs: packed documents need megatron-core 0.19+ (GatedDeltaNet's NotImplementedError before)
    ("model.experimental_attention_variant", "data.reset_attention_mask"),
    # the hybrid Mamba model (pretrain/rules/hybrid.py): what it does not wire, each with its reason
    *(("model.hybrid_layer_pattern", key) for key in (
        "model.mtp_num_layers", "model.recompute_granularity", "model.sliding_window", "model.softmax_type",
        "parallel.virtual_pipeline", "parallel.pipeline_layout", "parallel.account_for_embedding_in_pipeline_split",
        "parallel.account_for_loss_in_pipeline_split", "optimizer.fsdp", "model.experimental_attention_variant",
        "model.attention_output_gate", "model.layernorm_zero_centered_gamma")),
    # ... and tiny_nemotron_h's 6 layers do not split over 2 × 2 virtual stages, nor fit the 4-layer layout string
    ("model.num_layers", "parallel.pipeline", "parallel.virtual_pipeline"),
    ("parallel.pipeline_layout", "parallel.pipeline", "model.num_layers"),
}


@contextlib.contextmanager
def _pipeline_stage(layout, pp_rank: int):
    """Megatron's parallel state as pipeline rank `pp_rank` of `layout` sees it (what the specs read)."""
    from megatron.core import parallel_state as ps

    with mock.patch.object(ps, "get_pipeline_model_parallel_rank", lambda: pp_rank), \
            mock.patch.object(ps, "get_pipeline_model_parallel_world_size", lambda: layout.pp), \
            mock.patch.object(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: layout.virtual_pipeline):
        yield


def build_megatron_configs(cfg, world: int) -> None:
    """The config objects `pretrain.run.setup.build_training` builds: TransformerConfig (the project's builder), every
    pipeline stage's decoder and MTP block specs, the DDP and optimizer configs."""
    from model_providers.core import hybrid, mamba_builder
    from model_providers.core.builder import transformer_config
    from model_providers.core.sequences import packed_sequences
    from model_providers.core.specs import decoder_block_spec, mtp_block_spec
    from pretrain.run.setup import ddp_config, optimizer_config

    layout = derive_layout(cfg, world, vocab_size=32000)
    config = transformer_config(model_plan(cfg), layout)
    if hybrid.is_hybrid(cfg.model):  # Megatron-Core's MambaStack picks each stage's layers itself
        mamba_builder.local_stack_spec(config, cfg.model, packed_sequences(cfg.data))
    for pp_rank in range(layout.pp if not hybrid.is_hybrid(cfg.model) else 0):
        with _pipeline_stage(layout, pp_rank):
            for vp in range(layout.vp):
                stage = vp if layout.virtual_pipeline else None
                packed = packed_sequences(cfg.data)
                decoder_block_spec(config, layout.use_te, vp_stage=stage, packed_sequences=packed)
                mtp_block_spec(config, layout.use_te, vp_stage=stage, packed_sequences=packed)
    ddp_config(cfg.optimizer, cfg.rerun, gloo=not layout.on_gpu)
    optimizer_config(cfg.optimizer, layout)


def test_every_accepted_pair_and_triple_builds_megatron_configs():
    start = time.perf_counter()
    accepted, refused, failed = [], collections.defaultdict(list), {}
    for names in combinations():
        cfg = load_config(config_name(names), ["data.mock=true", *overrides(names)])
        report = validate(cfg, world_size(names))
        if not report.ok:
            for problem in report.errors:
                refused[problem.keys].append(case_name(names))
            continue
        accepted.append(names)
        try:
            build_megatron_configs(cfg, world_size(names))
        except Exception as exc:  # noqa: BLE001 - every Megatron refusal, reported together
            failed[case_name(names)] = f"{type(exc).__name__}: {exc}"
    total = len(combinations())
    print(f"{total} pairs and triples: {len(accepted)} accepted (every Megatron-Core config built), "
          f"{total - len(accepted)} refused, in {time.perf_counter() - start:.1f} s")
    for keys, cases in refused.items():
        print(f"  refused [{', '.join(keys)}]: {len(cases)}, e.g. {cases[0]}")
    assert not failed, failed
    assert set(refused) <= REFUSALS, set(refused) - REFUSALS
    assert len(accepted) >= 200  # the matrix is not refused wholesale


def test_every_placement_kind_builds_megatron_configs():
    """Every kind of pipeline stage a layout string places (the embedding alone, the loss alone, both, an empty
    stage, the MTP layer and the loss alone, ...) is accepted and builds every stage's specs: the MTP block's layer is
    the model's last decoder layer, not the stage's (a stage holding `mL` has no decoder layer)."""
    for name, (config, extra) in PLACEMENTS.items():
        cfg = load_config(config, ["data.mock=true", *extra])
        report = validate(cfg, placement_world(extra), files=False)
        assert report.ok, (name, report.text())
        build_megatron_configs(cfg, placement_world(extra))


def test_every_pair_and_triple_accepted_for_gpus_builds_its_transformer_config():
    """The same matrix as a GPU job with Transformer Engine (`validate --world-size N` on a login node): every
    combination accepted builds its TransformerConfig (TE's version checks answered as by a recent TE; the TE layer
    specs and DDP need TE and a GPU, and are not built here)."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.transformer.transformer_config as tc

    from model_providers.core.builder import transformer_config

    accepted, failed = 0, {}
    with mock.patch.object(tc, "is_te_min_version", lambda *a, **k: True), \
            mock.patch.object(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None):
        for names in combinations():
            cfg = load_config(config_name(names), ["data.mock=true", *overrides(names)])
            world = world_size(names)
            report = validate(cfg, world, te_on_gpu=True, cuda_available=True, files=False)
            assert {p.keys for p in report.errors} <= REFUSALS, report.text()
            if report.ok:
                accepted += 1
                try:
                    transformer_config(model_plan(cfg),
                                       derive_layout(cfg, world, vocab_size=32000, on_gpu=True, te=True))
                except Exception as exc:  # noqa: BLE001 - every Megatron refusal, reported together
                    failed[case_name(names)] = f"{type(exc).__name__}: {exc}"
    print(f"on GPUs with TE: {accepted} of {len(combinations())} accepted, every TransformerConfig built")
    assert not failed, failed
    assert accepted >= 200


def test_dense_model_builds_with_packed_documents_under_cp_and_pp():
    """The dense models keep no token dispatcher, but Megatron-Core checks its default (allgather) against
    variable_seq_lengths (CP > 1, PP > 1, packed documents): the builder sets one that allows it."""
    names = ("pp", "cp_p2p", "docs")
    cfg = load_config("tiny_llama", ["data.mock=true", *overrides(names)])
    assert validate(cfg, 4).ok
    build_megatron_configs(cfg, 4)


def test_allgather_dispatcher_with_variable_lengths_is_refused(capsys):
    """MoE with the allgather dispatcher and packed documents under CP × PP: one line, exit 2 (Megatron-Core's
    TransformerConfig raises ValueError for it)."""
    base = ["validate", "tiny_moe", "--world-size", "4", "model.moe_token_dispatcher_type=allgather"]
    assert main([*base, *overrides(("pp", "cp_p2p", "docs"))]) == 2
    err = capsys.readouterr().err
    assert "[model.moe_token_dispatcher_type, data.reset_attention_mask, parallel.context, parallel.pipeline]" in err
    assert "Traceback" not in err and "use model.moe_token_dispatcher_type=alltoall" in err
    assert main([*base, *overrides(("pp", "cp_p2p"))]) == 0  # no documents: every microbatch has one length
    cfg = load_config("tiny_moe", ["model.moe_token_dispatcher_type=allgather", *overrides(("pp", "cp_p2p"))])
    build_megatron_configs(cfg, 4)
