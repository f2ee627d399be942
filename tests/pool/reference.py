"""One-rank reference runs, run once per session: `reference_run(config, overrides)` trains `config` with
`overrides` on one pool rank (`python -m pretrain train`'s entry point) and returns its run directory; a later call
with the same config, overrides (run.dir / checkpoint.dir aside) and megatron-core release returns the same
directory without training again. Treat the directory as read-only: other tests read it too."""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

_PATH_KEYS = ("run.dir=", "checkpoint.dir=")
_CACHE: dict[str, Path] = {}
_ROOT: list[Path] = []


def _mcore_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def reference_key(config: str, overrides: list[str]) -> str:
    """Hash of (config, sorted overrides without run and checkpoint paths, megatron-core release). The steps are
    an override (`train.steps=N`) or the config's own."""
    kept = sorted(o for o in overrides if not o.startswith(_PATH_KEYS))
    blob = json.dumps([config, kept, _mcore_version()])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference_run(config: str, overrides: list[str], timeout: float = 600) -> Path:
    """The run directory of a one-rank `pretrain train CONFIG OVERRIDES` run (trained at the first call)."""
    from tests.pool import run_case
    from tests.pretrain.ckpt_helpers import log_text

    key = reference_key(config, overrides)
    if key in _CACHE:
        return _CACHE[key]
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="references-")))
        atexit.register(shutil.rmtree, _ROOT[0], ignore_errors=True)
    run_dir = _ROOT[0] / key
    argv = ["train", config, *(o for o in overrides if not o.startswith(_PATH_KEYS)), f"run.dir={run_dir}"]
    log = _ROOT[0] / f"{key}.log"
    rc = run_case(1, "pretrain.__main__", argv, log, timeout, name=f"reference {config}")
    assert rc == 0, log_text(log)[-3000:]
    _CACHE[key] = run_dir
    return run_dir
