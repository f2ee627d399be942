"""`tests.cli.run_cli`: a fake CLI's exit statuses, output and traceback as a process would show them, and the
process state it changes put back."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cli import run_cli

FAKE = textwrap.dedent('''
    import os, signal, sys, warnings

    def main(argv):
        what = argv[0]
        print("out"); print("err", file=sys.stderr)
        if what == "return":
            return int(argv[1])
        if what == "exit":
            sys.exit(None if argv[1] == "none" else int(argv[1]) if argv[1].isdigit() else argv[1])
        if what == "raise":
            raise ValueError("boom")
        if what == "state":
            os.environ["FAKE_CLI_SET"] = "1"
            os.environ.pop("FAKE_CLI_UNSET", None)
            os.chdir("/")
            signal.signal(signal.SIGTERM, lambda *_: None)
            print(os.environ.get("FAKE_CLI_GIVEN"), sys.argv[0])
        if what == "warn":
            warnings.warn("shown", UserWarning)
            warnings.warn("hidden", DeprecationWarning)
''')


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fake_cli_mod.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fake_cli_mod", None)
    return "fake_cli_mod"


@pytest.mark.parametrize("argv,rc,err", [(["return", "4"], 4, ""), (["exit", "none"], 0, ""), (["exit", "3"], 3, ""),
                                         (["exit", "bad input"], 1, "bad input\n")])
def test_exit_statuses_as_python_makes_them(fake: str, argv: list[str], rc: int, err: str) -> None:
    r = run_cli(fake, argv)
    assert (r.rc, r.stdout, r.stderr, r.traceback) == (rc, "out\n", "err\n" + err, None), r


def test_an_escaped_exception_is_status_1_with_its_traceback_on_stderr(fake: str) -> None:
    r = run_cli(fake, ["raise"])
    assert r.rc == 1 and r.traceback and r.traceback.rstrip().endswith("ValueError: boom"), r
    assert r.stderr == "err\n" + r.traceback and "Traceback" in r.stderr


def test_environment_cwd_argv_and_signals_are_put_back(fake: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CLI_UNSET", "kept")
    monkeypatch.delenv("FAKE_CLI_SET", raising=False)
    cwd, argv, handler = os.getcwd(), list(sys.argv), signal.getsignal(signal.SIGTERM)
    r = run_cli(fake, ["state"], env={"FAKE_CLI_GIVEN": "given"})
    assert r.rc == 0 and r.stdout == f"out\ngiven python -m {fake}\n", r
    assert "FAKE_CLI_SET" not in os.environ and os.environ["FAKE_CLI_UNSET"] == "kept"
    assert "FAKE_CLI_GIVEN" not in os.environ and os.getcwd() == cwd and sys.argv == argv
    assert signal.getsignal(signal.SIGTERM) is handler


def test_warnings_print_as_in_a_fresh_process(fake: str) -> None:
    r = run_cli(fake, ["warn"])
    assert "UserWarning: shown" in r.stderr and "hidden" not in r.stderr, r
