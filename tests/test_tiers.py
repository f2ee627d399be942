"""The tier mechanism (tests/conftest.py, tests/tiers.py): what each kind of run collects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tiers import second_release_pass

REPO = Path(__file__).resolve().parents[1]


def _collected(*args: str) -> str:
    """The last line of `pytest --collect-only -q ARGS tests/pretrain/test_moe_quick.py`."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *args,
                           "tests/pretrain/test_moe_quick.py"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 5), done.stdout[-3000:] + done.stderr[-3000:]  # 5: nothing collected
    return done.stdout.strip().splitlines()[-1]


def test_second_release_subset_is_deselected_outside_the_mcore_pass():
    """test_moe_quick.py (the second release's MoE subset) is deselected, not skipped, in `make test`, `make test-all`
    and `make test-quick`; `make test-mcore`'s `-m mcore` collects it."""
    assert _collected().startswith("no tests collected (3 deselected)")
    assert _collected("-m", "mcore").startswith("3 tests collected")
    marks = {"slow", "mcore", "second_release"}
    assert second_release_pass("mcore", marks) and second_release_pass("mcore and not gpu", marks)
    assert not any(second_release_pass(e, marks) for e in ("", "not slow", "slow", "mcore or slow", "not mcore"))
