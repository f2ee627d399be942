"""Context-parallel validation (pretrain/rules/context.py): what Transformer Engine and the CPU CP attention can run,
exact messages, GPU machines simulated (`cuda_available`, `te_on_gpu`)."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.validate import validate


def report(overrides: list[str], world: int, gpu: bool = False):
    return validate(load_config("tiny_llama", overrides), world, te_on_gpu=gpu, cuda_available=gpu, files=False)


def errors(overrides: list[str], world: int, gpu: bool = False) -> list[str]:
    return [str(p) for p in report(overrides, world, gpu).errors]


A2A_GROUPS = ("[parallel.cp_comm_type, parallel.context, model.num_attention_heads, model.num_query_groups] "
              "parallel.cp_comm_type=a2a gives each CP rank 1/8 of a tensor-parallel rank's attention heads (8) and "
              "query groups (4): both must be divisible by parallel.context=8. Fix: use parallel.cp_comm_type=p2p or "
              "all_gather, or a context size dividing both")
HIERARCHICAL = ("[parallel.cp_comm_type, parallel.context] parallel.cp_comm_type=a2a+p2p needs hierarchical "
                "context-parallel groups (Megatron's hierarchical_context_parallel_sizes), which this trainer does not "
                "build. Fix: use parallel.cp_comm_type=p2p, a2a or all_gather")
SP_SPLIT = ("[model.seq_length, parallel.context, parallel.tensor, parallel.sequence_parallel] a CP rank's 66 tokens "
            "(model.seq_length / parallel.context) do not split over parallel.tensor=4 sequence-parallel ranks. Fix: "
            "use a sequence length that is a multiple of 8")
INTERLEAVED = ("[data.reset_attention_mask, parallel.context, parallel.virtual_pipeline] packed documents under "
               "context parallelism have a padded length per microbatch, which pipeline stages exchange before each "
               "tensor; with interleaving on 2 stages gloo pairs those same-peer messages first-in-first-out and can "
               "swap them. Fix: use parallel.pipeline >= 3, or no interleaving")
DOCS = ["data.reset_attention_mask=true"]


@pytest.mark.parametrize("overrides,world,gpu,expected", [
    (["parallel.context=8", "parallel.cp_comm_type=a2a"], 8, False, [A2A_GROUPS]),
    (["parallel.context=8", "parallel.cp_comm_type=a2a"], 8, True, [A2A_GROUPS]),  # TE: the same split
    (["parallel.context=4", "parallel.cp_comm_type=a2a"], 4, False, []),
    (["parallel.context=2", "parallel.cp_comm_type=a2a+p2p"], 2, True, [HIERARCHICAL]),
    (["parallel.context=2", "parallel.tensor=4", "parallel.sequence_parallel=true", "model.seq_length=132"], 8,
     False, [SP_SPLIT]),
    # Packed documents are padded per document: no sequence-length divisibility under CP.
    (["parallel.context=2", "model.seq_length=70", *DOCS], 2, False, []),
    (["parallel.context=2", "model.seq_length=70"], 2, False,
     ["[model.seq_length, parallel.context] model.seq_length=70 is not divisible by 2×parallel.context = 4. Fix: use "
      "a sequence length that is a multiple of 4"]),
    (["parallel.context=2", "parallel.pipeline=2", "parallel.virtual_pipeline=2", *DOCS], 4, False, [INTERLEAVED]),
    (["parallel.context=2", "parallel.pipeline=2", "parallel.virtual_pipeline=2", *DOCS], 4, True, []),
    (["parallel.context=2", "parallel.pipeline=2", *DOCS], 4, False, []),
])  # fmt: skip
def test_context_rules(overrides, world, gpu, expected):
    assert errors(overrides, world, gpu) == expected


def test_cpu_attention_and_dropout_are_notes():
    notes = report(["parallel.context=2", "model.attention_dropout=0.1"], 2).notes
    assert ("context parallelism without Transformer Engine: model_providers/core/cp_attention.py (cp_comm_type=p2p) "
            "computes [2, 8, 64, 64] score blocks around the ring (none kept)") in " ".join(notes)
    gathered = report(["parallel.context=2", "parallel.cp_comm_type=all_gather", *DOCS], 2).notes
    assert "(cp_comm_type=all_gather) keeps [1, 8, 128, 256] attention scores per layer" in " ".join(gathered)
    assert any("each CP rank draws its own dropout masks" in n for n in notes)
    assert not any("cp_attention.py" in n for n in report(["parallel.context=2"], 2, gpu=True).notes)


def test_cp_comm_type_is_checked_when_parsed():
    with pytest.raises(ConfigError, match=r"parallel.cp_comm_type='ring' is not one of p2p, all_gather, a2a, a2a\+p2p"):
        load_config("tiny_llama", ["parallel.cp_comm_type=ring"])
    assert load_config("tiny_llama").parallel.cp_comm_type == "p2p"  # Megatron's default
