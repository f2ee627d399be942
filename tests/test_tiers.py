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


def _table_rows() -> list[tuple[str, str]]:
    """(tests cell, tier cell) of every row of tests/README.md's "What proves what" table."""
    text = (REPO / "tests" / "README.md").read_text()
    rows = []
    for row in text[text.index("### What proves what"):].splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("| ") and len(cells) >= 3 and cells[-1] in ("1", "all"):
            rows.append((cells[-2], cells[-1]))
    return rows


def test_readme_table_names_tests_that_exist_in_their_tier():
    """Every test file the capability table names exists; every `file.py::test` exists, and a test named for the
    `all` tier is marked `full` (deselected in `make test`) or has cases only that tier runs; one named for tier 1
    is not marked `full`."""
    import re

    files = {p.name: p for p in (REPO / "tests").rglob("*.py")}
    rows = _table_rows()
    assert len(rows) > 40, "the table was not found"
    for cell, tier in rows:
        current = None
        for ref in re.findall(r"`([^`]+)`", cell):
            path, _, name = ref.partition("::")
            if "*" in path:
                continue
            if path.endswith(".py"):
                current = REPO / path if path.startswith("tests/") else files.get(path)
                assert current is not None and current.exists(), f"tests/README.md names {path}: no such file"
            elif not (path == "" and name):
                continue  # a case id, a constant or a glob
            if not name:
                continue
            source = current.read_text()
            found = re.search(rf"((?:^@.*\n)*)^def {name}\(", source, re.MULTILINE)
            assert found, f"tests/README.md names {current.name}::{name}: no such test"
            full = "mark.full" in found.group(1) or "tiers.full" in found.group(1)
            # "all" for a test some of whose cases only `make test-all` runs: marked full, or cases picked by tier
            second = full or any(k in source for k in ("mark.full", "tiers.params", "tiers.pick", "everything()"))
            assert (second if tier == "all" else not full), f"{current.name}::{name}: tier {tier}, marked full: {full}"
