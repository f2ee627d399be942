"""The test tiers. `make test` (what CI runs) proves every capability at least once; `make test-all` adds the
exhaustive matrices (`TEST_TIER=all`). A test or a parametrized case only in the second tier carries
`@pytest.mark.full`; a fixture that launches a matrix in one go asks `everything()` which cases to include.
A test only for the second megatron-core release's pass (`make test-mcore`: `-m mcore`) carries
`@pytest.mark.second_release` as well as `mcore`: every other run deselects it (`second_release_pass`).
The capability → test → tier table is `tests/README.md`."""

from __future__ import annotations

import os

import pytest

full = pytest.mark.full
second_release = pytest.mark.second_release


def everything() -> bool:
    """True under `make test-all` (TEST_TIER=all)."""
    return os.environ.get("TEST_TIER", "") == "all"


def pick(cases: dict, full_only: set | frozenset = frozenset()) -> dict:
    """`cases` without the names in `full_only` unless every tier runs."""
    unknown = set(full_only) - set(cases)
    assert not unknown, f"tiers.pick: no such case {sorted(unknown)}"
    return dict(cases) if everything() else {k: v for k, v in cases.items() if k not in full_only}


def params(names, full_only: set | frozenset = frozenset()) -> list:
    """pytest.param per name, the `full_only` ones marked `full` (deselected in `make test`)."""
    return [pytest.param(n, marks=full) if n in full_only else n for n in names]


def second_release_pass(markexpr: str, marks: set[str]) -> bool:
    """True when `-m markexpr` selects a test carrying `marks` for its `mcore` mark (it would not select the test
    without it): `make test-mcore`'s `-m mcore`, not `-m "not slow"` or a run without `-m`."""
    from _pytest.mark.expression import Expression  # pytest's own `-m` grammar

    if not markexpr:
        return False
    expr = Expression.compile(markexpr)
    return expr.evaluate(lambda name, **_: name in marks) and not expr.evaluate(
        lambda name, **_: name in marks - {"mcore"})
