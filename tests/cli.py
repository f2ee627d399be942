"""Run a CLI's `main(argv)` in the test process, as `python -m MODULE ARGV...` would, without the start-up.

    r = run_cli("pretrain", ["validate", "tiny_llama", "parallel.tensr=2"])
    assert r.rc == 2 and "unknown config key" in r.stderr

What a fresh process would show is kept: the exit status (a `SystemExit`'s code as Python turns it into one: None
is 0, a string is printed to stderr and is 1) and, for an exception that escapes `main`, exit status 1 with its
traceback on stderr (also in `Result.traceback`), so "no traceback" can still be asserted. What the call changes
in the process is put back afterwards: the environment (every variable, also those the CLI sets), the working
directory, `sys.argv`, the handlers of the usual signals (`data_tools` turns SIGTERM into KeyboardInterrupt), the
root logger's handlers and level, and module constants given in `patch`. Warnings raised during the call are
printed to its stderr under a fresh process's filters (Python's defaults and the packages' own), not to pytest's
capture, so "prints only its own lines" still holds; those raised once at import time are not seen again.

Not for what needs a process of its own: training (torch.distributed, Megatron's global state), signals sent to
it, locks held by another process, start-up imports and their warnings.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The handlers a CLI may install (SIGTERM -> KeyboardInterrupt, a trainer's SIGUSR1); restored after each call.
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGHUP") if hasattr(signal, name))

# The warning filters of a fresh `python -m pretrain` / `data_tools`: Python's defaults (no -W, no PYTHONWARNINGS),
# then pretrain/__init__.py's own (inserted in front, as filterwarnings does).
_FRESH_FILTERS = (("ignore", "", ResourceWarning, ""), ("ignore", "", ImportWarning, ""),
                  ("ignore", "", PendingDeprecationWarning, ""), ("ignore", "", DeprecationWarning, ""),
                  ("default", "", DeprecationWarning, "__main__"),
                  ("ignore", ".*(Apex|Transformer Engine).* not installed.*", Warning, ""),
                  ("ignore", "full scope is deprecated", Warning, ""))


@dataclass
class Result:
    """What a process running the CLI would have left: exit status, output, error output (with the traceback of
    an exception that escaped, as Python prints it) and that traceback alone (None when none escaped)."""

    rc: int
    stdout: str
    stderr: str
    traceback: str | None = None

    def __str__(self) -> str:  # shown by a failing `assert ..., result`
        return f"rc={self.rc}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


@contextlib.contextmanager
def _process_state(env: dict[str, str | None] | None, cwd: str | Path | None, argv0: str) -> Iterator[None]:
    """Set the environment (None: unset) and working directory; restore them, argv, signals and logging after."""
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_signals = {s: signal.getsignal(s) for s in _SIGNALS}
    root = logging.getLogger()
    saved_log = (list(root.handlers), root.level)
    try:
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = str(value)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [argv0]
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        for sig, handler in saved_signals.items():
            if handler is not None:
                signal.signal(sig, handler)
        root.handlers[:] = saved_log[0]
        root.setLevel(saved_log[1])


@contextlib.contextmanager
def _fresh_warnings() -> Iterator[None]:
    """A fresh process's warning filters, warnings printed to (the redirected) sys.stderr; restored after."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - warnings' API
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.resetwarnings()
        for action, message, category, module in _FRESH_FILTERS:  # each in front of the previous ones
            warnings.filterwarnings(action, message=message, category=category, module=module)
        warnings.showwarning = show
        yield


@contextlib.contextmanager
def _patched(patch: dict[str, object] | None) -> Iterator[None]:
    """Set module constants {"module:NAME": value} (e.g. a size threshold) for the call; restore them after."""
    saved = []
    try:
        for target, value in (patch or {}).items():
            module, name = target.split(":")
            mod = importlib.import_module(module)
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


def _entry(module: str):
    """`MODULE.__main__.main` for a package (`python -m pretrain`), else `MODULE.main`."""
    try:
        return importlib.import_module(f"{module}.__main__").main
    except ModuleNotFoundError as exc:
        if exc.name != f"{module}.__main__":
            raise
        return importlib.import_module(module).main


def run_cli(module: str, argv: list[str], env: dict[str, str | None] | None = None, cwd: str | Path | None = None,
            patch: dict[str, object] | None = None) -> Result:
    """`python -m MODULE *argv` in this process: its exit status, stdout and stderr (see the module docstring)."""
    main = _entry(module)
    out, err = io.StringIO(), io.StringIO()
    rc, tb = 0, None
    with _process_state(env, cwd, f"python -m {module}"), _patched(patch), _fresh_warnings():
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
                rc = 0 if code is None else int(code)
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    rc = exc.code or 0
                else:  # sys.exit("message"): printed to stderr, status 1
                    print(exc.code, file=sys.stderr)
                    rc = 1
            except BaseException:  # noqa: BLE001 - what the process would print: the traceback, status 1
                tb = traceback.format_exc()
                sys.stderr.write(tb)
                rc = 1
    return Result(rc, out.getvalue(), err.getvalue(), tb)
