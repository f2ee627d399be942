"""A warm `python -m pretrain validate`: Megatron-Core's own config checks answered from their verdict cache
(`pretrain.rules.megatron_verdicts`) without importing torch or megatron-core, and never for another input.

Fresh processes: the cache is read only by a process that has not imported megatron-core (the CLI's case).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.config import load_config
from pretrain.layout import derive_layout
from pretrain.rules import megatron_verdicts

ROOT = Path(__file__).resolve().parents[2]
CACHED = "verdict from the cache"
MOE_TOP1 = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_router_topk=1"]


def _validate(cache: Path, *extra: str, pythonpath: str = str(ROOT), importtime: bool = False):
    """`python -m pretrain validate tiny_llama` on mock data, from the first checkout on `pythonpath`."""
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *flags, "-m", "pretrain", "validate", "tiny_llama", "data.mock=true",
                           f"data.cache_dir={cache}", *extra], cwd=pythonpath.split(":")[0], capture_output=True,
                          text=True, timeout=300,
                          env={"PYTHONPATH": pythonpath, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def _imported(importtime_stderr: str) -> set[str]:
    """Top-level packages in `python -X importtime`'s log."""
    return {line.split("|")[-1].strip().split(".")[0] for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.mcore
def test_warm_validate_uses_the_verdict_and_only_for_the_same_input(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cold = _validate(cache)
    assert cold.returncode == 0 and CACHED not in cold.stdout, cold.stdout + cold.stderr
    entries = sorted((cache / megatron_verdicts.VERDICT_DIR).glob("*.json"))
    assert len(entries) == 2, entries  # TransformerConfig + OptimizerConfig; GPTDatasetConfig
    assert all(json.loads(e.read_text())["verdict"] == "accepted" for e in entries)

    warm = _validate(cache, importtime=True)
    assert warm.returncode == 0, warm.stdout + warm.stderr
    assert ("note: Megatron-Core's own checks (TransformerConfig, OptimizerConfig, GPTDatasetConfig) passed for this "
            f"exact config, layout, installation and code before: {CACHED} {cache / 'megatron_checks'} (not re-run, "
            "megatron-core not imported)") in warm.stdout, warm.stdout
    imported = _imported(warm.stderr)
    assert "pretrain" in imported and not {"torch", "megatron"} & imported, sorted(imported)

    # Another config: Megatron-Core's TransformerConfig refuses it (a stale verdict would have said OK).
    moe = _validate(cache, *MOE_TOP1)
    assert moe.returncode == 2 and CACHED not in moe.stdout + moe.stderr, moe.stdout + moe.stderr
    assert "Megatron-Core's TransformerConfig refuses this model and layout (Megatron-Core: \"Please use " \
        "--moe-router-pre-softmax" in moe.stderr, moe.stderr

    # The same code imported from elsewhere: the same verdict; one source file changed: the checks run again.
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "model_providers", copy / "model_providers", ignore=shutil.ignore_patterns("__pycache__"))
    same = _validate(cache, pythonpath=f"{copy}:{ROOT}")
    assert same.returncode == 0 and CACHED in same.stdout, same.stdout + same.stderr
    with open(copy / "model_providers" / "core" / "builder.py", "a") as f:
        f.write("\n# changed\n")
    changed = _validate(cache, pythonpath=f"{copy}:{ROOT}")
    assert changed.returncode == 0 and CACHED not in changed.stdout, changed.stdout + changed.stderr
    assert len(list((cache / megatron_verdicts.VERDICT_DIR).glob("*.json"))) == 4


def test_verdict_key_covers_the_input(tmp_path):
    """Every input of the checks is in the key; an entry recording other facts is not used."""
    cfg = load_config("tiny_llama", ["data.mock=true"])
    lay = derive_layout(cfg, 1, on_gpu=False, te=False)
    key, facts = megatron_verdicts.verdict_key(["config"], cfg, lay, 1, False, False)
    others = [
        megatron_verdicts.verdict_key(["data"], cfg, lay, 1, False, False),
        megatron_verdicts.verdict_key(["config"], load_config("tiny_llama", ["data.mock=true", "train.seed=2"]),
                                      lay, 1, False, False),
        megatron_verdicts.verdict_key(["config"], cfg, derive_layout(cfg, 2, on_gpu=False, te=False), 2, False,
                                      False),
        megatron_verdicts.verdict_key(["config"], cfg, lay, 1, True, False),
        megatron_verdicts.verdict_key(["config"], cfg, lay, 1, False, True),
    ]
    assert len({key, *(k for k, _ in others)}) == 1 + len(others)
    assert megatron_verdicts.verdict_key(["config"], cfg, lay, 1, False, False) == (key, facts)  # deterministic

    assert megatron_verdicts.store(tmp_path / "absent", [(key, facts)], create=False) == 0  # validate: no new dirs
    assert megatron_verdicts.store(tmp_path, [(key, facts)], create=True) == 1
    assert megatron_verdicts.lookup(tmp_path, key, facts) == megatron_verdicts.entry_path(tmp_path, key)
    path = megatron_verdicts.entry_path(tmp_path, key)
    record = json.loads(path.read_text())
    record["facts"]["installed"] = "Python 3.11.7, megatron-core 9.9.9"  # an entry for another installation
    path.write_text(json.dumps(record))
    assert megatron_verdicts.lookup(tmp_path, key, facts) is None
    path.write_text("{not json")
    assert megatron_verdicts.lookup(tmp_path, key, facts) is None
