"""A small MoE subset for the second megatron-core release (`make test-mcore`): expert parallelism through the
all-to-all dispatcher and its CPU shims, the distributed optimizer over expert-parallel state, and resharding.

Two launches (tests/pretrain/test_moe.py runs every layout): world 1 trains the tiny_moe reference; world 2 trains
DP2 × EP2 with the distributed optimizer (checkpoint at step 2), resumes that checkpoint at EP1, and trains
TP2 + SP × EP2 (the router losses' scaling under sequence parallelism differs between releases:
`pretrain.compat.mcore.moe_router_loss_scale`). Both layouts' losses, auxiliary losses and step-1 tokens per
expert match the reference (≤ 1e-5 relative); the EP1 resume continues with the EP2 run's losses (≤ 2e-6).
"""

from __future__ import annotations

import pytest

from tests.pretrain.ckpt_helpers import by_step, rel_diff, run_worker_cases
from tests.pretrain.test_moe import DIST, EP2, SOURCE, STEPS, TOLERANCE, TP2_EP2, _case

# Deselected (not skipped) in every run but `-m mcore` (tests/conftest.py): in `make test` and `make test-all`
# tests/pretrain/test_moe.py runs these layouts (and more) on the default release.
pytestmark = [pytest.mark.slow, pytest.mark.mcore, pytest.mark.second_release]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_quick")
    plans = {1: [_case(root, "ref", [], None)],
             2: [_case(root, "dp2_distopt_ep2", DIST + EP2 + SOURCE, None),
                 _case(root, "distopt_ep2_to_ep1", DIST, "dp2_distopt_ep2"),
                 _case(root, "tp2_sp_ep2", TP2_EP2, None)]}
    for world, cases in plans.items():
        run_worker_cases(root, world, cases, timeout=600)
    return root


@pytest.mark.parametrize("name", ["dp2_distopt_ep2", "tp2_sp_ep2"])
def test_expert_parallel_matches_single_rank(runs, name):
    ref, got = by_step(runs / "ref"), by_step(runs / name)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    rel = [rel_diff(got[s][k], ref[s][k]) for s in ref for k in ("loss", "moe_load_balancing_loss", "moe_z_loss")]
    print(f"{name}: losses {[got[s]['loss'] for s in got]}; max relative diff {max(rel):.2e}")
    assert max(rel) <= TOLERANCE, rel
    assert got[1]["moe_tokens_per_expert"] == ref[1]["moe_tokens_per_expert"]
    assert got[STEPS]["loss"] != got[1]["loss"]


def test_expert_parallel_checkpoint_resumes_at_ep1(runs):
    ref, got = by_step(runs / "dp2_distopt_ep2"), by_step(runs / "distopt_ep2_to_ep1")
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in (3, 4):
        rel = rel_diff(got[s]["loss"], ref[s]["loss"])
        print(f"EP2 → EP1 step {s}: loss {got[s]['loss']!r} vs {ref[s]['loss']!r}, relative diff {rel:.2e}")
        assert got[s]["consumed_samples"] == ref[s]["consumed_samples"] and rel <= 2e-6
