"""Document boundaries in packed samples (data.eod_mask_loss, data.reset_position_ids, data.reset_attention_mask).

Three documents are preprocessed (embedded Mistral tokenizer, EOD appended) so that together they fill exactly one
sample of `seq_length + 1` tokens. With all three flags on, the trainer's step-1 loss (before any update) on that
packed sample must equal the token-weighted mean of the step-1 losses of three runs that each train on one document
alone (sequence length = that document's length, plain causal attention). Weights do not depend on the sequence
length (RoPE, initialisation by parameter name), so the runs see the same model. The packed sample travels as THD
packed sequences (`cu_seqlens` from the EOD positions); under context parallelism:
tests/pretrain/test_context_parallel.py.
"""

from __future__ import annotations

import json

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import log_text
from tests.pretrain.doc_helpers import FLAGS, case, documents, first_loss, weighted_mean

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("documents")
    packed, seq, singles = documents(tmp)
    cases = [case(tmp / f"run_{name}", path, n) for name, (path, n) in singles.items()]
    cases.append(case(tmp / "packed_flags", packed, seq, FLAGS))
    cases.append(case(tmp / "packed_plain", packed, seq))
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    rc = run_case(1, "tests.pretrain.layout_worker", [str(spec)], tmp / "world1.log", timeout=600)
    assert rc == 0, log_text(tmp / "world1.log")[-3000:]
    # The same packed sample with the mask split by tensor parallelism (+SP) and passed to both pipeline stages.
    two = [case(tmp / "packed_tp2", packed, seq, FLAGS + ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
           case(tmp / "packed_pp2", packed, seq, FLAGS + ["parallel.pipeline=2"])]
    spec2 = tmp / "cases2.json"
    spec2.write_text(json.dumps(two))
    rc = run_case(2, "tests.pretrain.layout_worker", [str(spec2)], tmp / "world2.log", timeout=600)
    assert rc == 0, log_text(tmp / "world2.log")[-3000:]
    return tmp, {name: (tmp / f"run_{name}", n) for name, (_, n) in singles.items()}


def test_packed_loss_is_token_weighted_mean_of_documents(packed_runs):
    tmp, singles = packed_runs
    per_doc = {name: (first_loss(d), n) for name, (d, n) in singles.items()}
    expected = weighted_mean(per_doc)
    packed = first_loss(tmp / "packed_flags")
    plain = first_loss(tmp / "packed_plain")
    print(f"per-document (loss, predictions): {per_doc}; weighted mean {expected:.7f}; packed with boundaries "
          f"{packed:.7f} (rel diff {abs(packed - expected) / expected:.1e}); packed without {plain:.7f}")
    assert abs(packed - expected) / expected < 1e-6
    # Without the flags documents attend across boundaries and the EOD→next-document predictions count (an
    # untrained model's loss is near ln(vocabulary) whatever it attends to, hence the small but clear gap).
    assert abs(plain - expected) / expected > 1e-4


@pytest.mark.parametrize("layout", ["packed_tp2", "packed_pp2"])
def test_packed_boundaries_hold_across_layouts(packed_runs, layout):
    tmp, _ = packed_runs
    one, got = first_loss(tmp / "packed_flags"), first_loss(tmp / layout)
    print(f"{layout}: {got:.7f} vs one rank {one:.7f}")
    assert abs(got - one) / one < 1e-6
