"""Pairs and triples of parallelism and training features, as config overrides on the tiny configs: the class of
layouts `validate` must either accept (then they train) or refuse with a reason. Shared by the cheap in-process
check (`test_feature_combinations.py`: validate, then build every Megatron-Core config object training builds) and
the training matrix of `make test-all` (`test_feature_matrix.py`). And the kinds of pipeline stage a layout string
can place (PLACEMENTS), each trained against one rank (`test_pipeline_layout.py`)."""

from __future__ import annotations

import itertools

from tests.pretrain.doc_helpers import FLAGS

# name: overrides. CP comm types exclude each other; VP includes PP.
FEATURES = {
    "tp_sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
    "pp": ["parallel.pipeline=2"],
    "vp": ["parallel.pipeline=2", "parallel.virtual_pipeline=2"],
    "cp_p2p": ["parallel.context=2", "parallel.cp_comm_type=p2p"],
    "cp_a2a": ["parallel.context=2", "parallel.cp_comm_type=a2a"],
    "cp_all_gather": ["parallel.context=2", "parallel.cp_comm_type=all_gather"],
    "ep": ["parallel.expert=2"],
    "fsdp": ["optimizer.fsdp=true"],
    "distopt": ["optimizer.distributed=true"],
    "docs": FLAGS,
    "mtp": ["model.mtp_num_layers=1"],
    "recompute": ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"],
    # sliding-window attention shorter than the sequence, on alternate layers (1 and 3; 2 and 4 full)
    "swa": ["model.sliding_window=32", "model.window_attn_skip_freq=2"],
    # attention sinks (GPT-OSS): one learnable logit per head in every softmax
    "sinks": ["model.softmax_type=learnable"],
    # pipeline placement on PP2: a layout string with uneven stages (1 and 3 layers), and the embedding and loss
    # counted as layers (3 and 3 with them)
    "layout": ["parallel.pipeline=2", "parallel.pipeline_layout=Et|tttL"],
    "account": ["parallel.pipeline=2", "parallel.account_for_embedding_in_pipeline_split=true",
                "parallel.account_for_loss_in_pipeline_split=true"],
    # the edge placements on PP2 × VP2: the embedding alone, then every layer, an empty stage, the loss alone (with
    # "mtp": the MTP layer and the loss alone, `...||mL`)
    "layout_edges": ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.pipeline_layout=E|tttt||L"],
    "muon": ["optimizer.name=muon"],
    # Qwen3-Next's layers: Gated DeltaNet on layers 1 and 3 (2 key / 4 value heads of 16), output-gated attention on
    # 2 and 4, zero-centred norms
    "gdn": ["model.experimental_attention_variant=gated_delta_net", "model.linear_attention_freq=2",
            "model.linear_num_key_heads=2", "model.linear_num_value_heads=4", "model.linear_key_head_dim=16",
            "model.linear_value_head_dim=16", "model.attention_output_gate=true",
            "model.layernorm_zero_centered_gamma=true"],
    # a hybrid Mamba model (tiny_nemotron_h: Megatron-Core's MambaModel, pattern M*M-ME) instead of a GPT
    "hybrid": [],
}
PIPELINE = {"pp", "vp", "layout", "account", "layout_edges"}
LAYOUTS = {"layout", "layout_edges"}  # a layout string places every layer: with "mtp", the `m` goes before the `L`
EXCLUSIVE = [{"cp_p2p", "cp_a2a", "cp_all_gather"}, PIPELINE]
# in pairs with every other feature, not in triples (time)
PAIRS_ONLY = {"layout", "layout_edges", "account", "muon", "hybrid"}
DATA_PARALLEL = {"ep", "fsdp", "distopt"}  # need two data-parallel ranks


def _allowed(names: tuple[str, ...]) -> bool:
    return all(len(group & set(names)) <= 1 for group in EXCLUSIVE)


def combinations(sizes=(2, 3)) -> list[tuple[str, ...]]:
    """Every pair and triple of FEATURES that does not combine two of one exclusive group (PAIRS_ONLY: pairs)."""
    return [c for k in sizes for c in itertools.combinations(FEATURES, k)
            if _allowed(c) and (k == 2 or not PAIRS_ONLY & set(c))]


def config_name(names) -> str:
    """tiny_nemotron_h for a hybrid model, tiny_moe for expert parallelism, else tiny_llama."""
    if "hybrid" in names:
        return "tiny_nemotron_h"
    return "tiny_moe" if "ep" in names else "tiny_llama"


def world_size(names) -> int:
    """TP × PP × CP × DP of the combination (DP 2 when a feature needs data-parallel ranks)."""
    tp = 2 if "tp_sp" in names else 1
    pp = 2 if PIPELINE & set(names) else 1
    cp = 2 if any(n.startswith("cp_") for n in names) else 1
    dp = 2 if DATA_PARALLEL & set(names) else 1
    return tp * pp * cp * dp


def overrides(names) -> list[str]:
    out = [o for n in names for o in FEATURES[n]]
    if "mtp" in names and LAYOUTS & set(names):
        out = [o[:-1] + "mL" if o.startswith("parallel.pipeline_layout=") else o for o in out]
    if "mtp" in names and "hybrid" in names:  # a hybrid MTP depth's layers (Nemotron 3 Super's; 0.19+ only)
        out.append("model.mtp_layer_pattern='*E'")
    return out


def case_name(names) -> str:
    return "+".join(names)


# The kinds of pipeline stage a layout string can place, each on its own (4 decoder layers; PP = world size): every
# one `validate` accepts trains to the one-rank loss and grad norm (`test_pipeline_layout.py`) and builds every
# stage's Megatron-Core specs (`test_feature_combinations.py`). name: (config, overrides)
PLACEMENTS = {
    "embedding_alone": ("tiny_llama", ["parallel.pipeline=2", "parallel.pipeline_layout=E|ttttL"]),
    "loss_alone": ("tiny_llama", ["parallel.pipeline=2", "parallel.pipeline_layout=Etttt|L"]),
    "embedding_and_loss": ("tiny_llama", ["parallel.pipeline_layout=EttttL"]),  # one stage holds both (PP1)
    "empty_stage_vp2": ("tiny_llama", ["parallel.pipeline=2", "parallel.virtual_pipeline=2",
                                       "parallel.pipeline_layout=Ett||t|tL"]),
    "edges_alone_vp2": ("tiny_llama", FEATURES["layout_edges"]),
    "empty_stages_pp4": ("tiny_llama", ["parallel.pipeline=4", "parallel.pipeline_layout=Ett|||ttL"]),
    "mtp_alone": ("tiny_deepseek", ["parallel.pipeline=2", "parallel.pipeline_layout=Etttt|mL"]),
    "mtp_alone_vp2": ("tiny_deepseek", ["parallel.pipeline=2", "parallel.virtual_pipeline=2",
                                        "parallel.pipeline_layout=Ett|t|t|mL"]),
    "mtp_and_edges_vp2": ("tiny_deepseek", ["parallel.pipeline=2", "parallel.virtual_pipeline=2",
                                            "parallel.pipeline_layout=E|tt|tt|mL"]),
}


def placement_world(overrides: list[str]) -> int:
    """The pipeline size of a PLACEMENTS entry (its world size)."""
    return next((int(o.split("=")[1]) for o in overrides if o.startswith("parallel.pipeline=")), 1)
