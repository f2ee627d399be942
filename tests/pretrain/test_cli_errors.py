"""Expected failures of `python -m pretrain train` end in one line naming the cause, exit status 1, no
traceback, and `exit_status.json` saying `failed` with that line: unusable checkpoints, a run directory
that is a file or read-only, a full disk under the checkpoints or the data cache.

The command lines run inside one process (tests/pretrain/cli_failures_worker.py calls the CLI's entry point); one
of them also runs as a real `python -m pretrain` process. Full and read-only file systems are real tmpfs
mounts (root with CAP_SYS_ADMIN; skipped otherwise), like tests/data_tools/test_output_errors.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import SMALL, command, log_text

pytestmark = pytest.mark.slow

TRACKER = "checkpoints/latest_checkpointed_iteration.txt"
ITER = "checkpoints/iter_0000002"
TRAIN = ["train", "tiny_llama", *SMALL, "train.steps=2", "checkpoint.interval=2"]

# name, setup (paths relative to the case's run dir, which starts as a copy of a good run at step 2), expected line
BAD_CHECKPOINTS = [
    ("tracker_missing_iteration", [["write", TRACKER, "5\n"]],
     r"\S+/latest_checkpointed_iteration.txt: names iteration 5 but \S+/iter_0000005 does not exist"),
    ("tracker_garbage", [["write", TRACKER, "twelve\n"]],
     r"\S+/latest_checkpointed_iteration.txt: expected an iteration number, found 'twelve'"),
    ("tracker_not_utf8", [["write_bytes", TRACKER, "fffe00c3"]],
     r"\S+/latest_checkpointed_iteration.txt: not a text file \(expected an iteration number\); restore it or "
     r"delete it to resume from the newest complete checkpoint"),
    ("truncated_distcp", [["truncate", f"{ITER}/__0_0.distcp", 0.5]],
     r"\S+/iter_0000002/__0_0.distcp: truncated, \d+ bytes but the checkpoint index needs \d+"),
    ("truncated_common", [["truncate", f"{ITER}/common.pt", 0.5]],
     r"\S+/iter_0000002/common.pt: unreadable, truncated or not a torch file \(.+\)"),
    ("truncated_index", [["truncate", f"{ITER}/.metadata", 0.5]],
     r"\S+/iter_0000002/.metadata: unreadable or truncated checkpoint index \(.+\)"),
    ("pickle_as_common", [["evil_pickle", f"{ITER}/common.pt", "MARKER"]],
     r"\S+/iter_0000002/common.pt: refused by the weights-only loader, untrusted pickles are never loaded \(.+\)"),
    ("pickle_as_index", [["evil_pickle", f"{ITER}/.metadata", "MARKER"]],
     r"\S+/iter_0000002/.metadata: refused, not a torch_dist checkpoint index \(global 'builtins.exec' .+\)"),
    ("nan_weights", [["nan", ITER, "embedding.word_embeddings.weight"]],
     r"\S+/iter_0000002: corrupt checkpoint, tensor 'model.embedding.word_embeddings.weight' holds \d+ NaN/Inf "
     r"values \(of 524288 on this rank\)"),
]


def _mount_tmpfs(path: Path, options: str) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in this sandbox: {done.stderr.strip()}")


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    marker = str(root / "pwned")
    mounts = {"ro": "size=1m,ro", "ckpt_full": "size=4m", "ckpt_full_async": "size=4m", "cache_full": "size=1m"}
    mounted = []
    try:
        for name, options in mounts.items():
            _mount_tmpfs(root / name, options)
            mounted.append(root / name)
        (root / "afile").write_text("not a directory")
        cases = [{"name": "good", "argv": [*TRAIN, f"run.dir={root}/good"]}]
        for name, ops, _ in BAD_CHECKPOINTS:
            setup = [["copy", f"{root}/{name}", f"{root}/good"]]
            setup += [[op, f"{root}/{name}/{rel}", *(marker if a == "MARKER" else a for a in args)]
                      for op, rel, *args in ops]
            cases.append({"name": name, "setup": setup, "argv": [*TRAIN, f"run.dir={root}/{name}"]})
        cases += [
            {"name": "run_dir_is_file", "argv": [*TRAIN, f"run.dir={root}/afile"]},
            {"name": "run_dir_read_only", "argv": [*TRAIN, f"run.dir={root}/ro/run"]},
            {"name": "disk_full_checkpoint", "argv": [*TRAIN, f"run.dir={root}/full1",
                                                      f"checkpoint.dir={root}/ckpt_full"]},
            {"name": "disk_full_async_checkpoint", "argv": [*TRAIN, f"run.dir={root}/full2",
                                                            "checkpoint.async_save=true",
                                                            f"checkpoint.dir={root}/ckpt_full_async"]},
            {"name": "disk_full_data_cache", "argv": [*TRAIN, f"run.dir={root}/full3",
                                                      f"data.cache_dir={root}/cache_full"]},
            {"name": "checkpoints_read_only", "argv": [*TRAIN, f"run.dir={root}/roc",
                                                       f"checkpoint.dir={root}/ro/ckpt"]},
            {"name": "pretrained_uncommitted", "setup": [["copy", f"{root}/partial", f"{root}/good"],
                                                         ["delete", f"{root}/partial/{ITER}/run_config.yaml"]],
             "argv": ["validate", "tiny_llama", *SMALL, f"checkpoint.pretrained={root}/partial/{ITER}"]},
        ]
        plan = root / "plan.json"
        plan.write_text(json.dumps({"results": str(root / "results.json"), "cases": cases}))
        log = root / "worker.log"
        rc = run_case(1, "tests.pretrain.cli_failures_worker", [str(plan)], log, timeout=600)
        assert rc == 0, log_text(log)[-4000:]
        results = json.loads((root / "results.json").read_text())
        assert results["good"]["rc"] == 0 and not results["good"]["escaped"], results["good"]
        yield root, results, marker
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _one_error_line(result: dict) -> str:
    assert result["escaped"] is None, result["escaped"]
    assert "Traceback" not in result["stderr"], result["stderr"]
    errors = [ln for ln in result["stderr"].splitlines() if ln.startswith("[pretrain] error: ")]
    assert len(errors) == 1, result["stderr"]
    assert result["rc"] == 1, result
    return errors[0].removeprefix("[pretrain] error: ")


@pytest.mark.parametrize("name,expected", [(n, e) for n, _, e in BAD_CHECKPOINTS])
def test_bad_checkpoint_one_line(cli_results, name, expected):
    root, results, marker = cli_results
    line = _one_error_line(results[name])
    assert re.fullmatch(expected, line), line
    assert str(root / name) in line
    status = json.loads((root / name / "exit_status.json").read_text())
    assert status["reason"] == "failed" and status["message"] == line, status
    assert not Path(marker).exists(), "an untrusted pickle was executed"


def test_run_dir_unusable_one_line(cli_results):
    root, results, _ = cli_results
    assert _one_error_line(results["run_dir_is_file"]) == f"run.dir {root}/afile: exists and is not a directory"
    assert _one_error_line(results["run_dir_read_only"]) == (
        f"run.dir {root}/ro/run: cannot write {root}/ro/run (Read-only file system)")


@pytest.mark.parametrize("name,directory", [("disk_full_checkpoint", "ckpt_full"),
                                            ("disk_full_async_checkpoint", "ckpt_full_async")])
def test_disk_full_checkpoint_one_line(cli_results, name, directory):
    root, results, _ = cli_results
    line = _one_error_line(results[name])
    assert re.fullmatch(rf"{root}/{directory}/iter_0000002: saving the checkpoint failed: No space left on device "
                        r"\([\d,]+ bytes free on its file system\); nothing was committed", line), line
    assert list((root / directory).iterdir()) == []  # the partial save is removed, no tracker
    run_dir = root / ("full1" if directory == "ckpt_full" else "full2")
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status["reason"] == "failed" and status["step"] == 2, status  # the last step reached


def test_read_only_checkpoints_found_before_step_1(cli_results):
    root, results, _ = cli_results
    line = _one_error_line(results["checkpoints_read_only"])
    assert line == (f"{root}/ro/ckpt: checkpoints cannot be written there (Read-only file system); found before "
                    "step 1: make it writable or set checkpoint.dir to a writable directory")
    assert not (root / "roc/metrics.jsonl").exists()  # no step was trained
    assert json.loads((root / "roc/exit_status.json").read_text())["reason"] == "failed"


def test_validate_refuses_uncommitted_pretrained(cli_results):
    root, results, _ = cli_results
    res = results["pretrained_uncommitted"]
    assert res["rc"] == 2 and res["escaped"] is None, res
    assert (f"[checkpoint.pretrained] checkpoint.pretrained: {root}/partial/{ITER}: an incomplete checkpoint (no "
            "run_config.yaml: its save never committed)") in res["stderr"], res["stderr"]


def test_disk_full_data_cache_one_line(cli_results):
    root, results, _ = cli_results
    line = _one_error_line(results["disk_full_data_cache"])
    assert re.fullmatch(rf"{root}/cache_full: writing the data cache failed: No space left on device "
                        r"\([\d,]+ bytes free on its file system\)", line), line


def test_real_process_prints_one_line(tmp_path):
    """The same through a real `python -m pretrain train` process: exit status and stderr as a user sees them."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / TRACKER).write_text("7\n")
    done = subprocess.run(command([*SMALL, f"run.dir={run_dir}"]), cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"[pretrain] error: {run_dir}/{TRACKER}: names iteration 7 but {run_dir}/checkpoints/iter_0000007 does not "
        "exist"), done.stderr
