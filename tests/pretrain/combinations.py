"""Pairs and triples of parallelism and training features, as config overrides on the tiny configs: the class of
layouts `validate` must either accept (then they train) or refuse with a reason. Shared by the cheap in-process
check (`test_feature_combinations.py`: validate, then build every Megatron-Core config object training builds) and
the training matrix of `make test-all` (`test_feature_matrix.py`)."""

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
    "muon": ["optimizer.name=muon"],
    # a hybrid Mamba model (tiny_nemotron_h: Megatron-Core's MambaModel, pattern M*M-ME) instead of a GPT
    "hybrid": [],
}
EXCLUSIVE = [{"cp_p2p", "cp_a2a", "cp_all_gather"}, {"pp", "vp", "layout", "account"}]
PAIRS_ONLY = {"layout", "account", "muon", "hybrid"}  # in pairs with every other feature, not in triples (test time)
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
    pp = 2 if {"pp", "vp", "layout", "account"} & set(names) else 1
    cp = 2 if any(n.startswith("cp_") for n in names) else 1
    dp = 2 if DATA_PARALLEL & set(names) else 1
    return tp * pp * cp * dp


def overrides(names) -> list[str]:
    return [o for n in names for o in FEATURES[n]]


def case_name(names) -> str:
    return "+".join(names)
