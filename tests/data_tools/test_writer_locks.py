"""One writer per output for `data_tools` (`pretrain/run/output_lock.py`, the trainer's lock), through the commands:
two `preprocess` runs onto one prefix and two `convert to-hf` into one directory (the second refused naming the
first, the first's output intact), and the staleness rules, each a lock record left behind by a writer that the
command must judge: on another host (fresh heartbeat: refused; an hour old: taken over), an earlier attempt of
this Slurm job, a dead pid, a reused pid, an unreadable record.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_tools.__main__ import main
from pretrain.run.output_lock import Holder
from tests.data_tools.conftest import corpus_texts, write_jsonl

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
GONE = "node-that-died"


def _preprocess_argv(corpus: Path, prefix: Path) -> list[str]:
    return ["preprocess", "--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-type", "sentencepiece",
            "--no-progress"]


def _error_line(err: str, prefix: str = "error: ") -> str:
    assert "Traceback" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith(prefix)]
    return line.removeprefix(prefix)


def _start_and_stop_when_locked(argv: list[str], lock: Path) -> subprocess.Popen:
    """`python -m data_tools ARGV` in its own session, stopped (SIGSTOP) as soon as it holds `lock`."""
    proc = subprocess.Popen([sys.executable, "-m", "data_tools", *argv], cwd=REPO, env=ENV, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not lock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGSTOP)
    return proc


def _resume(proc: subprocess.Popen) -> tuple[int, str, str]:
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.mark.slow
def test_concurrent_preprocess_onto_one_prefix(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", corpus_texts(8, 2000))
    prefix = tmp_path / "out" / "web"
    prefix.parent.mkdir()
    first = _start_and_stop_when_locked(_preprocess_argv(corpus, prefix), Path(f"{prefix}.lock"))
    try:
        assert main(_preprocess_argv(corpus, prefix)) == 1
        line = _error_line(capsys.readouterr().err)
        assert line.startswith(f"preprocess --output-prefix {prefix} is in use by another writer: host "
                               f"{socket.gethostname()}, pid {first.pid}, no Slurm job, started "), line
    finally:
        rc, out, err = _resume(first)
    assert rc == 0, err
    # The first run's dataset is whole and exactly what a run alone writes.
    assert main(_preprocess_argv(corpus, tmp_path / "alone")) == 0
    for ext in (".bin", ".idx"):
        alone = Path(f"{tmp_path}/alone_text_document{ext}").read_bytes()
        assert Path(f"{prefix}_text_document{ext}").read_bytes() == alone
    assert sorted(p.name for p in prefix.parent.iterdir()) == [
        "web_text_document.bin", "web_text_document.idx", "web_text_document.meta.json"]  # no lock, no temporaries


@pytest.mark.slow
def test_concurrent_to_hf_into_one_output(tmp_path, capsys):
    from data_tools.convert import main as convert_main
    from pretrain.config import DataConfig
    from pretrain.hf.hf_import import import_from_hf
    from pretrain.hf.tokenizer import hf_tokenizer
    from tests.data_tools.test_convert import random_llama

    tok = tmp_path / "tok"
    hf_tokenizer(DataConfig()).save_pretrained(str(tok))
    ckpt = tmp_path / "ckpt"
    import_from_hf(random_llama(tmp_path / "hf", tok), ckpt, progress=False)
    out = tmp_path / "exported"
    argv = ["to-hf", "--checkpoint", str(ckpt), "--output", str(out), "--no-progress"]
    first = _start_and_stop_when_locked(["convert", *argv], Path(f"{out}.lock"))
    try:
        assert convert_main(argv) == 1
        line = _error_line(capsys.readouterr().err, "[convert] error: ")
        assert line.startswith(f"convert to-hf --output {out} is in use by another writer: host "
                               f"{socket.gethostname()}, pid {first.pid}, "), line
    finally:
        rc, _, err = _resume(first)
    assert rc == 0, err
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "exported", "hf", "tok"]  # no lock, no staging


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lockdata")
    corpus = write_jsonl(root / "corpus.jsonl", corpus_texts(4, 500))
    assert main(_preprocess_argv(corpus, root / "d")) == 0
    return str(root / "d_text_document")


def _left_behind(path: Path, age_s: float = 0.0, **fields) -> None:
    """A lock record `path` left by a writer described by `fields`, last heartbeat `age_s` seconds ago."""
    me = Holder.this_process()
    record = {**me.__dict__, "host": GONE, "pid": 4_000_000, "pid_start": None, "boot_id": None, "pid_ns": None,
              "slurm_job_id": None, "slurm_restart_count": 0, "started": "2025-01-01T00:00:00+0000",
              "token": "f" * 32, **fields}
    path.write_bytes(Holder(**record).record())
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))


def _merge(dataset: str, out: Path, capsys) -> tuple[int, str]:
    rc = main(["merge", "--inputs", dataset, "--output-prefix", str(out)])
    return rc, capsys.readouterr().err


def test_stale_or_live_locks_left_behind(tmp_path, dataset, capsys, monkeypatch):
    out = tmp_path / "merged"
    lock = Path(f"{out}.lock")
    host = socket.gethostname()
    _left_behind(lock, age_s=5)  # another host, heartbeat 5 s ago: alive
    rc, err = _merge(dataset, out, capsys)
    assert rc == 1 and _error_line(err).startswith(
        f"merge --output-prefix {out} is in use by another writer: host {GONE}, pid 4000000, no Slurm job, started "
        "2025-01-01T00:00:00+0000 (lock "), err
    assert not Path(f"{out}.bin").exists()

    me = Holder.this_process()
    here = {"host": host, "boot_id": me.boot_id, "pid_ns": me.pid_ns}  # this host, this PID namespace
    cases = [  # (record, age, the note's reason)
        ({}, 3600, "no heartbeat for 3600 s (8 missed beats of 15 s: its host is down or the process is gone)"),
        ({"slurm_job_id": "77", "slurm_restart_count": 0}, 1,
         "it is restart 0 of this Slurm job 77, now at restart 1 (a requeue)"),
        ({**here, "pid": 4_000_000}, 1, "process 4000000 is not running"),
        ({**here, "pid": os.getppid(), "pid_start": "1"}, 1,  # a live pid, started at another time
         f"process {os.getppid()} is not running (the pid now belongs to another process)"),
        ({"host": host, "boot_id": "another-boot"}, 1, f"host {host} has rebooted since"),
    ]
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    for fields, age, reason in cases:
        _left_behind(lock, age_s=age, **fields)
        rc, err = _merge(dataset, out, capsys)
        assert rc == 0, err
        (note,) = [ln for ln in err.splitlines() if ln.startswith("note: took over the stale lock")]
        assert note.startswith(f"note: took over the stale lock {lock} of host "), note
        assert note.endswith(f": {reason}"), note
        assert not lock.exists() and Path(f"{out}.idx").exists()

    lock.write_bytes(b"")  # a record still being written (O_CREAT|O_EXCL file systems): wait for it
    rc, err = _merge(dataset, out, capsys)
    assert rc == 1 and "in use by another writer: a process whose record is still being written" in err, err
    os.utime(lock, (time.time() - 120, time.time() - 120))  # ... a minute later it is stale
    rc, err = _merge(dataset, out, capsys)
    assert rc == 0 and "its record is unreadable and 120 s old" in err, err
