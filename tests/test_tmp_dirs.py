"""The suite's temp dirs: what passing tests wrote is removed as the run goes (a whole `make test` once kept 15 GB
and filled a CI machine's disk), what failing ones wrote stays for a look, session fixtures' dirs last the session."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

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


CHILD_CONFTEST = """
from tests.conftest import SESSION_DIR_PREFIX, children_tmpdir, pytest_runtest_makereport  # noqa: F401
"""

KILLED_CHILD = """
import os, signal, subprocess, sys

def test_child_killed_after_mkdtemp(tmp_path_factory):
    code = "import os, signal, tempfile; print(tempfile.mkdtemp(suffix='wandb-media'), flush=True); " \\
           "os.kill(os.getpid(), signal.SIGKILL)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL
    made = out.stdout.strip()
    assert os.path.isdir(made)
    print("MADE", made, "BASE", tmp_path_factory.getbasetemp())
"""


def test_what_killed_children_leave_in_their_tmpdir_goes_with_the_session(pytester, monkeypatch):
    """A process a test starts makes its temp dirs under the session's dir (TMPDIR), which a passing session
    removes: a child killed by a signal (which never cleans up, as wandb's import-time dirs) leaves nothing in /tmp."""
    monkeypatch.setenv("TMPDIR", "/tmp")
    pytester.makeconftest(CHILD_CONFTEST)
    pytester.makepyfile(test_child=KILLED_CHILD)
    result = pytester.runpytest("-s", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    line = next(line for line in result.outlines if "MADE " in line)
    made, _, base = line.split("MADE ", 1)[1].split()
    assert made.startswith(base + "/session-tmpdir/"), line
    assert not Path(made).exists() and not (Path(base) / "session-tmpdir").exists()
    assert os.environ["TMPDIR"] == "/tmp"
