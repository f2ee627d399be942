"""launch/*.sh without a cluster: shellcheck-clean, a clear error when not run under Slurm, OVERRIDES split like a
shell, and a whole attempt (`launch_pretrain`) run against stand-ins for srun/scontrol and the trainer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "launch").glob("*.sh"))


def test_launch_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {"common.sh", "pretrain_70b.sh", "pretrain_8b.sh", "pretrain_tiny.sh", "pretrain_moe.sh",
            "pretrain_deepseek.sh"} <= names


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_clean():
    scripts = [*SCRIPTS, REPO / "tests" / "launch" / "local_slurm.sh", REPO / "tests" / "gpu" / "run.sh",
               REPO / "scripts" / "install.sh", REPO / ".ci" / "run"]
    done = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("script", ["pretrain_tiny.sh", "pretrain_8b.sh", "pretrain_70b.sh", "pretrain_moe.sh",
                                    "pretrain_deepseek.sh"])
def test_outside_slurm_fails_with_a_clear_message(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(REPO / "launch" / script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "not inside a Slurm job: submit with `sbatch" in done.stderr, done.stderr


def _finish(tmp_path: Path, status: dict | None, signal_name: str = "") -> subprocess.CompletedProcess:
    """`launch_finish` of launch/common.sh after an attempt whose exit_status.json is `status`, with a fake
    `scontrol` that accepts the requeue."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    if status is not None:
        (run_dir / "exit_status.json").write_text(json.dumps(status) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho \"scontrol $*\"\n")
    (bin_dir / "scontrol").chmod(0o755)
    script = (f"source {REPO}/launch/common.sh; RUN_DIR={run_dir}; LAUNCH_SRUN_RC=137; LAUNCH_SIGNAL={signal_name}; "
              "MAX_FAILED_RESTARTS=2; MAX_RESTARTS=100; launch_finish")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "SLURM_JOB_ID": "42",
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)


def test_finish_reads_a_running_status_as_killed(tmp_path):
    """The trainer writes {"reason": "running"} at start: still there after the attempt means the ranks were
    killed. With a forwarded signal that is a requeue without counting a failure, like a missing file."""
    running = {"reason": "running", "step": None, "signal": None, "message": None, "pid": 1, "host": "n1"}
    done = _finish(tmp_path / "a", running)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the trainer did not finish cleanly: killed before writing its final status" in done.stdout
    assert "failure 1 of at most 2 in a row (srun exit 137)" in done.stdout and "scontrol requeue 42" in done.stdout
    assert (tmp_path / "a" / "run" / ".launch_failures").read_text().strip() == "1"

    done = _finish(tmp_path / "b", running, signal_name="USR1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(ranks ended after SIGUSR1 without saving (srun exit 137))" in done.stdout, done.stdout
    assert not (tmp_path / "b" / "run" / ".launch_failures").exists()


def script_overrides(script: str, tmp_path: Path, **env: str) -> tuple[str, list[str]]:
    """(CONFIG, overrides) that `launch/SCRIPT` passes to the trainer: the real script and common.sh, with
    `launch_pretrain` replaced by a stub that prints its arguments."""
    stub = tmp_path / "checkout" / "launch"
    stub.mkdir(parents=True)
    (stub / "common.sh").write_text(f'source {REPO / "launch" / "common.sh"}\n'
                                    'launch_pretrain() { printf "%s\\n" "CONFIG=$CONFIG" "$@"; }\n')
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(REPO / "launch" / script)], cwd=tmp_path, capture_output=True, text=True,
                          env={**clean, "PROJECT_DIR": str(tmp_path / "checkout"), **env}, timeout=30)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    return lines[0].removeprefix("CONFIG="), lines[1:]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_moe_script_layout_is_accepted_by_the_validator_and_the_planner(tmp_path, precision):
    """Qwen3-30B-A3B on 2 nodes x 8 GPUs: the layout launch/pretrain_moe.sh passes validates at world 16."""
    from pretrain.config import load_config
    from pretrain.validate import validate

    config, overrides = script_overrides("pretrain_moe.sh", tmp_path, PRECISION=precision)
    assert config == "pretrain/configs/qwen3_30b_a3b.yaml" and "parallel.expert=8" in overrides
    cfg = load_config(REPO / config, [*overrides, "data.blend=[/data/web_text_document]"])
    assert cfg.model.preset == "qwen3_30b_a3b" and cfg.model.num_moe_experts == 128
    report = validate(cfg, 16, te_on_gpu=True, cuda_available=True, files=False)  # layout only: data is on the cluster
    assert report.ok, report.text()


@pytest.mark.parametrize("precision,mtp", [("bf16", "null"), ("fp8", "1")])
def test_deepseek_script_layout_is_accepted_by_the_validator(tmp_path, precision, mtp):
    """Moonlight-16B-A3B on 2 nodes x 8 GPUs: the layout launch/pretrain_deepseek.sh passes validates at world 16
    (BF16 and FP8, without and with one MTP layer)."""
    from pretrain.config import load_config
    from pretrain.validate import validate

    config, overrides = script_overrides("pretrain_deepseek.sh", tmp_path, PRECISION=precision, MTP=mtp)
    assert config == "pretrain/configs/moonlight_16b_a3b.yaml" and "parallel.expert=8" in overrides
    cfg = load_config(REPO / config, [*overrides, "data.blend=[/data/web_text_document]",
                                      "data.tokenizer_model=/models/moonlight"])
    m = cfg.model
    assert (m.preset, m.num_moe_experts, m.multi_latent_attention, m.mtp_num_layers) == (
        "moonlight_16b_a3b", 64, True, None if mtp == "null" else 1)
    report = validate(cfg, 16, te_on_gpu=True, cuda_available=True, files=False)  # layout only: data is on the cluster
    assert report.ok, report.text()


# OVERRIDES as a user writes it: a value with spaces in double quotes, a YAML list with a space in single quotes,
# and text a shell would expand or run, which must arrive as it is.
OVERRIDES = """run.name="my run" 'data.blend=["/d/a b"]' train.steps=3 logging.wandb.name=$HOME`id`"""
SPLIT = ["run.name=my run", 'data.blend=["/d/a b"]', "train.steps=3", "logging.wandb.name=$HOME`id`"]


def test_overrides_are_split_like_a_shell(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "LAUNCH_PRINT_OVERRIDES": "1"}
    done = subprocess.run(["bash", str(REPO / "launch" / "pretrain_tiny.sh")], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, "OVERRIDES": OVERRIDES}, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["pretrain/configs/tiny_llama.yaml", *SPLIT]
    done = subprocess.run(["bash", str(REPO / "launch" / "pretrain_tiny.sh")], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, "OVERRIDES": 'run.name="my run'}, timeout=30)
    assert done.returncode == 1 and done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert line.endswith('error: OVERRIDES cannot be split into words (unmatched double quote): run.name="my run'), line


def _fake_cluster(tmp_path: Path) -> tuple[dict, Path]:
    """Stand-ins on PATH for scontrol and srun (which runs its command once, here), and a PYTHON that records
    each `-m pretrain ...` command line (NUL-separated, one file per subcommand) and, for `train`, writes
    run.dir/exit_status.json `completed`; with FAKE_REAL_VALIDATE=1 `validate` runs the real one."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    scripts = {
        "scontrol": '#!/bin/bash\n[[ $1 == show && $2 == hostnames ]] && echo localhost\nexit 0\n',
        "srun": f'#!/bin/bash\ntouch {calls}/srun\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n',
        "python": ('#!/bin/bash\n'
                   f'[[ $3 == validate && $FAKE_REAL_VALIDATE == 1 ]] && exec {sys.executable} "$@"\n'
                   f'printf "%s\\0" "$@" > {calls}/$3\n'
                   'if [[ $3 == train ]]; then for a in "$@"; do [[ $a == run.dir=* ]] && rd=${a#run.dir=}; done\n'
                   '  echo \'{"reason": "completed", "step": 3}\' > "$rd/exit_status.json"; fi\n'),
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"), "PROJECT_DIR": str(REPO),
           "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
           "RUN_DIR": str(tmp_path / "run")}
    return env, calls


def _argv(path: Path) -> list[str]:
    return path.read_text().split("\0")[:-1]


def test_overrides_with_spaces_reach_the_validator_and_the_trainer(tmp_path):
    """One whole attempt of launch/pretrain_tiny.sh: each override arrives as one argument, in both commands."""
    env, calls = _fake_cluster(tmp_path)
    done = subprocess.run(["bash", str(REPO / "launch" / "pretrain_tiny.sh")], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, "OVERRIDES": OVERRIDES}, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "training completed at step 3" in done.stdout, done.stdout
    config, run_dir = str(REPO / "pretrain/configs/tiny_llama.yaml"), tmp_path / "run"
    assert _argv(calls / "validate") == ["-m", "pretrain", "validate", config, *SPLIT, f"run.dir={run_dir}",
                                         "--world-size", "1", "--check-lock"]
    assert _argv(calls / "train") == ["-m", "pretrain", "train", config, *SPLIT, f"run.dir={run_dir}"]


def test_a_duplicate_submission_is_stopped_before_touching_the_run_dir(tmp_path):
    """Another live trainer holds RUN_DIR (here: this test process holds its lock): the attempt ends at the
    validator with the holder's line, exit 1, no srun, no requeue, and RUN_DIR's files stay as they were."""
    from pretrain.run.output_lock import Target, hold

    env, calls = _fake_cluster(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    status = '{"reason": "running", "step": null, "signal": null, "message": null}\n'
    (run_dir / "exit_status.json").write_text(status)
    with hold([Target(run_dir, "run.dir", inside=True)]):
        done = subprocess.run(["bash", str(REPO / "launch" / "pretrain_tiny.sh")], cwd=tmp_path, capture_output=True,
                              text=True, env={**env, "FAKE_REAL_VALIDATE": "1", "OVERRIDES": "data.mock=true"},
                              timeout=180)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if "error" in ln]
    assert line.startswith(f"[pretrain] error: run.dir {run_dir} is in use by another writer: host "), line
    assert f", pid {os.getpid()}, " in line, line
    assert "not starting training, not requeueing" in done.stdout, done.stdout
    assert not (calls / "srun").exists() and not (calls / "train").exists()
    assert (run_dir / "exit_status.json").read_text() == status and sorted(p.name for p in run_dir.iterdir()) == [
        "exit_status.json"]


@pytest.mark.parametrize("args,message", [
    (["--", "--input", "x"], "--tasks must be a positive integer"),
    (["--tasks", "4", "--finalize", "concat", "--", "--input", "x"], "--finalize must be merge or blend"),
    (["--tasks", "4"], "no preprocess arguments after --"),
])
def test_preprocess_script_refuses_a_bad_command_line(args, message, tmp_path):
    """launch/preprocess.sh (run on a login node) stops before planning or submitting anything."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(REPO / "launch" / "preprocess.sh"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and message in done.stderr, done.stderr
    assert "usage: launch/preprocess.sh --tasks N" in done.stderr and not list(tmp_path.iterdir())


def test_finish_requeues_after_a_hang(tmp_path):
    """exit_status.json `hang` (the trainer's watchdog, exit 75): requeued like a preemption, no failure counted."""
    hang = {"reason": "hang", "step": 2, "signal": None, "message": "hang in step 3: rank(s) 1 stopped answering",
            "hang_step": 3, "hang_ranks": [1]}
    done = _finish(tmp_path, hang)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "requeueing job 42 (a rank hung after step 2 (stacks in" in done.stdout, done.stdout
    assert "scontrol requeue 42" in done.stdout and not (tmp_path / "run" / ".launch_failures").exists()


def test_a_stage_boundary_starts_the_next_stage_in_the_same_allocation(tmp_path):
    """exit_status.json `stage` (exit 76: the next stage changes the layout): the trainer is started again in the
    same job, no requeue; with a signal pending it is requeued instead, no failure counted."""
    env, calls = _fake_cluster(tmp_path)
    python = Path(env["PYTHON"])
    python.write_text(python.read_text().replace(
        '  echo \'{"reason": "completed", "step": 3}\' > "$rd/exit_status.json"; fi\n',
        f'  n=$(ls {calls} | grep -c start); touch {calls}/start$n\n'
        '  if ((n == 0)); then echo \'{"reason": "stage", "step": 2}\' > "$rd/exit_status.json"; exit 76; fi\n'
        '  echo \'{"reason": "completed", "step": 3}\' > "$rd/exit_status.json"; fi\n'))
    done = subprocess.run(["bash", str(REPO / "launch" / "pretrain_tiny.sh")], cwd=tmp_path, capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a stage ended at step 2 and the next one changes the layout: starting it in this allocation" in done.stdout
    assert "training completed at step 3" in done.stdout and "requeue" not in done.stdout, done.stdout
    assert sorted(p.name for p in calls.glob("start*")) == ["start0", "start1"]

    stage = {"reason": "stage", "step": 2, "signal": None, "message": "stage 'a' ended at step 2; ..."}
    done = _finish(tmp_path / "signal", stage, signal_name="USR1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "requeueing job 42 (a stage ended at step 2; the next stage starts in the next attempt)" in done.stdout
    assert not (tmp_path / "signal" / "run" / ".launch_failures").exists()
