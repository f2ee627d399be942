"""Fixtures shared by the pretrain tests: the Megatron-FSDP runs (`fsdp_cases.py`), launched once per session."""

from __future__ import annotations

import shutil
import time

import pytest

from tests.conftest import SESSION_DIR_PREFIX


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory) -> dict:
    """The launches of `tests/pretrain/fsdp_cases.py` (world 4: `make test-all` only).

    Returns {"root", "results", "killed_rc", "hf", "seconds"}."""
    from tests import tiers
    from tests.pretrain import fsdp_cases as fc

    root = tmp_path_factory.mktemp(SESSION_DIR_PREFIX + "fsdp")
    seconds = {}
    t0 = time.monotonic()
    killed_rc, _ = fc.launch(root, 2, fc.world2_killed(root), timeout=300, tag="_killed")
    seconds["world2_killed"] = time.monotonic() - t0
    # What the killed run wrote before the SIGKILL (the resume rewrites the lines after its checkpoint).
    shutil.copy(root / "killed" / "metrics.jsonl", root / "killed_metrics.jsonl")
    results = {}
    hf = fc.import_hf(root)
    t0 = time.monotonic()
    results.update(fc.launch(root, 2, fc.world2(root, hf[1], hf[2]), timeout=900)[1])
    seconds["world2"] = time.monotonic() - t0
    t0 = time.monotonic()
    results.update(fc.launch(root, 1, fc.world1(root), timeout=600)[1])
    seconds["world1"] = time.monotonic() - t0
    if tiers.everything():  # world 4 (TP2 × FSDP DP2, DP2 -> DP4, the fsdp_tp_without_te fix): `make test-all`
        t0 = time.monotonic()
        results.update(fc.launch(root, 4, fc.world4(root), timeout=600)[1])
        seconds["world4"] = time.monotonic() - t0
    print(f"fsdp_runs launch seconds: {seconds}")
    return {"root": root, "results": results, "killed_rc": killed_rc, "hf": hf, "seconds": seconds}
