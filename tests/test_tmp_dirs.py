"""The suite's temp dirs: what passing tests wrote is removed as the run goes (a whole `make test` once kept 15 GB
and filled a CI machine's disk), what failing ones wrote stays for a look, session fixtures' dirs last the session."""

from __future__ import annotations

import textwrap

INNER_CONFTEST = """
import pytest
from tests.conftest import SESSION_DIR_PREFIX, module_dirs_removed, pytest_runtest_makereport  # noqa: F401

@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    d = tmp_path_factory.mktemp(SESSION_DIR_PREFIX + "shared")
    (d / "blob").write_bytes(b"x" * 1000)
    return d

@pytest.fixture(scope="module")
def per_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("per_file")
    (d / "blob").write_bytes(b"x" * 1000)
    return d
"""

WRITES = """
def test_writes(tmp_path, per_file, shared):
    (tmp_path / "blob").write_bytes(b"x" * 1000)
"""

FAILS = """
def test_fails(tmp_path, per_file):
    (tmp_path / "kept").write_bytes(b"x")
    assert False
"""

LOOKS = """
def test_looks(tmp_path_factory, shared):
    base = tmp_path_factory.getbasetemp()
    left = sorted(p.name for p in base.iterdir() if not p.is_symlink())
    assert (shared / "blob").exists()
    print("LEFT", left)
"""


def test_passing_tests_dirs_go_failing_ones_stay(pytester):
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makeini(textwrap.dedent("""
        [pytest]
        tmp_path_retention_policy = failed
    """))
    pytester.makepyfile(test_a_writes=WRITES, test_b_fails=FAILS, test_c_looks=LOOKS)
    result = pytester.runpytest("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    left = next(line for line in result.outlines if "LEFT" in line).split("LEFT ", 1)[1]
    # test_a's tmp_path and its module dir are gone; test_b's (failed) stay; the session dir stays
    assert left == "['per_file1', 'session-shared0', 'test_fails0']", left
