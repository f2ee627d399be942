"""launch/pretrain_tiny.sh on a real Slurm cluster started on this machine (no mocks).

The session fixture installs Debian's slurmctld/slurmd/slurm-client/munge when missing (apt-get), starts
a cluster of two emulated nodes (two slurmd on this host) with tests/launch/local_slurm.sh, and stops
its daemons by PID afterwards (also restoring /etc/hosts). It skips, saying why, when not root or when
Slurm is missing and apt-get cannot install it.

Run: `.venv/bin/python -m pytest -m slurm tests/launch -v` (as root; ~2-3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SESSION_DIR_PREFIX

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LOCAL_SLURM = Path(__file__).with_name("local_slurm.sh")
TINY = REPO / "launch" / "pretrain_tiny.sh"
CONFIG = "pretrain/configs/tiny_llama.yaml"
PYTHON = sys.executable
PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
DAEMONS = ["slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo", "munged"]

# One run, launched three ways (plain torchrun, sbatch: `make test-all`; sbatch + preemption, compared with the same
# run on one pool rank: `make test`): 2 nodes x 2 ranks. Enough steps that the preemption test can signal well
# before the end; a checkpoint at the interval too.
STEPS = 12
RUN_OVERRIDES = f"data.mock=true train.steps={STEPS} checkpoint.interval=5"
# Preempted after the periodic checkpoint at step 3 (signal once 4 steps are logged).
PREEMPT_OVERRIDES = f"data.mock=true train.steps={STEPS} checkpoint.interval=3"
WORLD = 4
# Fields that measure wall-clock speed: they differ between any two runs.
TIMING_KEYS = {"tokens_per_s", "step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "mem_gib"}
RELEASE_AFTER_S = 3
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


# --------------------------------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------------------------------
def _ensure_slurm_installed() -> None:
    if os.geteuid() != 0:
        pytest.skip("the Slurm tests need root: they start slurmctld/slurmd and add node names to /etc/hosts")
    if all(shutil.which(c) for c in DAEMONS):
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"Slurm is not installed and apt-get is unavailable to install {' '.join(PACKAGES)}")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # stale or empty package lists: refresh once
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
    missing = [c for c in DAEMONS if not shutil.which(c)]
    if done.returncode != 0 or missing:
        pytest.skip(f"could not install {' '.join(PACKAGES)} with apt-get (exit {done.returncode}, "
                    f"missing {missing}): {done.stderr.strip()[-500:]}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running two-node cluster; SLURM_CONF points at it for the whole session."""
    _ensure_slurm_installed()
    cluster_dir = tmp_path_factory.mktemp(SESSION_DIR_PREFIX + "slurm")
    started = subprocess.run(["bash", str(LOCAL_SLURM), "start", str(cluster_dir)], capture_output=True,
                             text=True, timeout=120)
    previous = os.environ.get("SLURM_CONF")
    try:
        assert started.returncode == 0, f"cluster did not start:\n{started.stdout}\n{started.stderr}"
        os.environ["SLURM_CONF"] = str(cluster_dir / "slurm.conf")
        yield cluster_dir
    finally:
        stopped = subprocess.run(["bash", str(LOCAL_SLURM), "stop", str(cluster_dir)], capture_output=True,
                                 text=True, timeout=120)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        assert stopped.returncode == 0, f"cluster did not stop cleanly:\n{stopped.stdout}\n{stopped.stderr}"


# --------------------------------------------------------------------------------------------------
# Jobs
# --------------------------------------------------------------------------------------------------
def job_env(**settings: str) -> dict[str, str]:
    """The submitting shell's environment: ours without Slurm job variables, plus the launch settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(PYTHON=PYTHON, **settings)
    return env


def sbatch(log_dir: Path, *args: str, wait: bool = False, timeout: float = 480, **settings: str):
    """Submit launch/pretrain_tiny.sh from the checkout; returns (job id, log path, CompletedProcess)."""
    cmd = ["sbatch", "--parsable", f"--output={log_dir}/%x-%j.log", *args, str(TINY)]
    if wait:
        cmd.insert(1, "--wait")
    done = subprocess.run(cmd, cwd=REPO, env=job_env(**settings), capture_output=True, text=True,
                          timeout=timeout)
    match = re.match(r"(\d+)", done.stdout.strip())
    assert match, f"sbatch printed no job id (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    job_id = match.group(1)
    return job_id, log_dir / f"pretrain-tiny-{job_id}.log", done


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for_job(job_id: str, log: Path, timeout: float = 420) -> dict[str, str]:
    """Poll until the job ends. A requeued job is held ~2 min (Reason=BeginTime): release it after
    RELEASE_AFTER_S. Released within the second of the requeue, slurmd refuses to start it ("Job
    credential revoked": the revocation of the previous run's credential has a 1 s resolution) and the
    job ends FAILED."""
    deadline = time.monotonic() + timeout
    held_since = None
    while time.monotonic() < deadline:
        info = job_info(job_id)
        state = info.get("JobState", "")
        if state in TERMINAL:
            return info
        if state == "PENDING" and info.get("Reason") == "BeginTime":
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since >= RELEASE_AFTER_S:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
                held_since = None
        time.sleep(0.5)
    subprocess.run(["scancel", "--full", job_id])
    pytest.fail(f"job {job_id} did not finish in {timeout:.0f} s; log:\n{read(log)}")


def read(path: Path) -> str:
    return path.read_text() if path.exists() else f"<{path} missing>"


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without wall-clock fields."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def exit_status(run_dir: Path) -> dict:
    return json.loads((run_dir / "exit_status.json").read_text())


# --------------------------------------------------------------------------------------------------
# Reference: the same run under plain torchrun (4 processes, one machine, no Slurm)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torchrun_metrics(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "-m", "pretrain", "train", CONFIG, *RUN_OVERRIDES.split(), f"run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"torchrun reference failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))
    return rows


# The same run on one pool rank (`pretrain train`'s entry point, no launch): what the preempted 2 x 2 job must
# reproduce. Steps, learning rates and consumed samples exactly; loss and grad norm to the layouts' tolerance (the
# data-parallel reduction sums in another order). A repeated or skipped batch, or a lost optimizer state, moves the
# loss by orders of magnitude more.
DETERMINISTIC = ("step", "lr", "consumed_samples")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def one_rank_metrics() -> list[dict]:
    from tests.pool.reference import reference_run

    rows = metrics(reference_run("tiny_llama", PREEMPT_OVERRIDES.split()))
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))
    return rows


def assert_matches_one_rank(got: list[dict], want: list[dict]) -> None:
    assert [[r.get(k) for k in DETERMINISTIC] for r in got] == [[r.get(k) for k in DETERMINISTIC] for r in want]
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm"):
            if key in g or key in w:
                assert abs(g[key] - w[key]) <= TOLERANCE * abs(w[key]), (key, g, w)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------
@pytest.mark.full  # `make test`: the preemption test runs the same job over 2 nodes to completion
def test_sbatch_two_nodes_matches_torchrun(slurm_cluster, torchrun_metrics, tmp_path):
    """`sbatch --wait` with 2 nodes x 2 tasks trains, checkpoints, and logs the torchrun run's metrics."""
    run_dir = tmp_path / "run"
    job_id, log, done = sbatch(tmp_path, "--nodes=2", "--ntasks-per-node=2", wait=True,
                               CONFIG=CONFIG, OVERRIDES=RUN_OVERRIDES, RUN_DIR=str(run_dir))
    text = read(log)
    assert done.returncode == 0, f"sbatch --wait exit {done.returncode}: {done.stderr}\n{text}"
    info = job_info(job_id)
    assert info["JobState"] == "COMPLETED", text
    assert "world size 4" in text and "[n[1-2]]" in text, text  # really two nodes
    assert exit_status(run_dir)["reason"] == "completed"
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    assert metrics(run_dir) == torchrun_metrics


def preempt_and_resume(tmp_path: Path, overrides: str, signal_after_steps: int, one_rank_metrics) -> None:
    """Submit a 2 x 2 run, send USR1 to the batch shell once `signal_after_steps` steps are logged (what
    `#SBATCH --signal=B:USR1@T` sends before the time limit), then check: the ranks saved and exited, the
    job requeued itself (Restarts=1), resumed from that checkpoint and ended with the uninterrupted run's
    metrics (`one_rank_metrics`; the same run on one rank)."""
    run_dir = tmp_path / "run"
    job_id, log, _ = sbatch(tmp_path, "--nodes=2", "--ntasks-per-node=2",
                            CONFIG=CONFIG, OVERRIDES=overrides, RUN_DIR=str(run_dir))
    try:
        metrics_file = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= signal_after_steps):
            assert time.monotonic() < deadline, f"no training steps within 300 s; log:\n{read(log)}"
            assert job_info(job_id).get("JobState") in {"PENDING", "RUNNING"}, read(log)
            time.sleep(0.1)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)

        # The first attempt's verdict, as soon as it is logged.
        deadline = time.monotonic() + 240
        while not (first := re.search(r"\] (exit status: .*|no \S+exit_status.json.*)", read(log))):
            assert time.monotonic() < deadline, f"first attempt did not end within 240 s:\n{read(log)}"
            time.sleep(0.2)
        assert "received SIGUSR1" in read(log), read(log)
        assert '"reason": "signal"' in first.group(1), f"the ranks did not save on the signal:\n{read(log)}"
        saved_step = json.loads(first.group(1).removeprefix("exit status: "))["step"]
        assert signal_after_steps <= saved_step < STEPS, f"signal too late to test resume:\n{read(log)}"

        info = wait_for_job(job_id, log)
    finally:
        subprocess.run(["scancel", "--full", job_id], capture_output=True)  # no-op once it has ended
    text = read(log)
    assert info["JobState"] == "COMPLETED", text
    assert "world size 4" in text and "[n[1-2]]" in text, text  # really two nodes
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    assert info["Restarts"] == "1", text
    assert "restart 1:" in text, text  # SLURM_RESTART_COUNT=1 in the second attempt
    assert re.search(rf"resumed from \S*iter_0*{saved_step} at step {saved_step}", text), text
    assert exit_status(run_dir)["reason"] == "completed"
    assert_matches_one_rank(metrics(run_dir), one_rank_metrics)


def test_preempted_job_saves_requeues_and_resumes(slurm_cluster, one_rank_metrics, tmp_path):
    """The usual case on a real cluster: periodic checkpoints, then the time-limit signal mid-run.
    (Slurm signals every process of the step, so this also checks that the checkpoint writer's helper
    processes, started at the periodic save, survive the signal and the signal-triggered save works.)"""
    preempt_and_resume(tmp_path, PREEMPT_OVERRIDES, 4, one_rank_metrics)


def test_bad_layout_fails_fast_with_validator_message(slurm_cluster, tmp_path):
    """A layout the world size cannot hold: the job fails before srun, the validator's words in its log."""
    overrides = "data.mock=true train.steps=2 parallel.tensor=3"
    expected = subprocess.run([PYTHON, "-m", "pretrain", "validate", CONFIG, *overrides.split(),
                               "--world-size", "2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert expected.returncode == 2, f"validator accepted the bad layout:\n{expected.stdout}{expected.stderr}"
    problems = [line.strip() for line in (expected.stdout + expected.stderr).splitlines() if line.strip()]

    run_dir = tmp_path / "run"
    job_id, log, _ = sbatch(tmp_path, "--nodes=1", "--ntasks-per-node=2",
                            CONFIG=CONFIG, OVERRIDES=overrides, RUN_DIR=str(run_dir))
    info = wait_for_job(job_id, log, timeout=240)
    text = read(log)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", text
    h, m, sec = (int(x) for x in info["RunTime"].split("-")[-1].split(":"))
    assert h * 3600 + m * 60 + sec < 120, f"the job ran {info['RunTime']} before failing:\n{text}"
    assert info["Restarts"] == "0", text
    assert "layout rejected by the validator" in text, text
    for line in problems:
        assert line in text, f"validator line {line!r} missing from the job log:\n{text}"
    assert "train: srun" not in text and not (run_dir / "metrics.jsonl").exists(), text


def test_hard_failure_requeues_a_bounded_number_of_times(slurm_cluster, tmp_path):
    """A run that fails (NaN loss with train.nan_policy=stop) is retried MAX_FAILED_RESTARTS times, then
    the job fails for good instead of requeueing forever."""
    run_dir = tmp_path / "run"
    overrides = "data.mock=true train.steps=5 optimizer.lr=1e30 train.nan_policy=stop"
    # One rank: the subject is the job's requeue logic, not the ranks (each attempt starts a fresh process).
    job_id, log, _ = sbatch(tmp_path, "--nodes=1", "--ntasks-per-node=1", CONFIG=CONFIG,
                            OVERRIDES=overrides, RUN_DIR=str(run_dir), MAX_FAILED_RESTARTS="1")
    info = wait_for_job(job_id, log)
    text = read(log)
    assert info["JobState"] == "FAILED", text
    assert info["Restarts"] == "1", text
    assert text.count("requeueing job") == 1 and "giving up" in text, text
    assert exit_status(run_dir)["reason"] == "failed", text


MOE_CONFIG = "pretrain/configs/tiny_moe.yaml"
MOE_OVERRIDES = "data.mock=true train.steps=4 checkpoint.interval=null logging.tensorboard=false"


@pytest.mark.full  # `make test`: EP2 vs one rank (test_moe.py), two nodes (the preemption test)
def test_moe_expert_parallel_across_two_nodes(slurm_cluster, tmp_path):
    """tiny_moe (8 experts, top-2) with EP4 on 2 nodes x 2 ranks: each layer's experts live 2 per rank on both
    emulated nodes, so every token all-to-all crosses them; the losses equal a one-process run's."""
    reference = tmp_path / "one_rank"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run([PYTHON, "-m", "pretrain", "train", MOE_CONFIG, *MOE_OVERRIDES.split(),
                           f"run.dir={reference}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_dir = tmp_path / "run"
    job_id, log, done = sbatch(tmp_path, "--nodes=2", "--ntasks-per-node=2", wait=True, CONFIG=MOE_CONFIG,
                               OVERRIDES=f"{MOE_OVERRIDES} parallel.expert=4", RUN_DIR=str(run_dir))
    text = read(log)
    assert done.returncode == 0 and job_info(job_id)["JobState"] == "COMPLETED", text
    assert "[n[1-2]]" in text and "experts ETP1 × EP4 × EDP1" in text, text  # two nodes, experts across both
    got, want = metrics(run_dir), metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (g, w)
    assert got[0]["moe_tokens_per_expert"] == want[0]["moe_tokens_per_expert"]


# --------------------------------------------------------------------------------------------------
# Preprocessing over an array job: launch/preprocess.sh
# --------------------------------------------------------------------------------------------------
PREPROCESS = REPO / "launch" / "preprocess.sh"


def _write_corpus(root: Path, sizes: tuple[int, ...], bad: int | None = None) -> Path:
    """JSONL files of `sizes` documents (slices of the embedded corpus, repeated when more are asked than it has);
    file `bad` gets a malformed line 2."""
    from data_tools.assets import DEFAULT_CORPUS

    with open(DEFAULT_CORPUS, encoding="utf-8") as f:
        corpus = [json.loads(line)["text"][:2500] for line in f]
    texts = [corpus[i % len(corpus)] for i in range(sum(sizes))]
    root.mkdir()
    for i, n in enumerate(sizes):
        lines = [json.dumps({"text": t}) + "\n" for t in texts[:n]]
        if i == bad:
            lines.insert(1, '{"text": "unterminated\n')
        (root / f"f{i}.jsonl").write_text("".join(lines), encoding="utf-8")
        texts = texts[n:]
    return root


def submit_preprocess(tmp: Path, corpus: Path, prefix: Path, *options: str, strict: bool = False) -> tuple[str, str]:
    """launch/preprocess.sh run where a user would run it (it plans, then submits); (array job, final job)."""
    from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER

    prefix.parent.mkdir()
    args = ["--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer-type", "sentencepiece",
            "--tokenizer-model", str(MISTRAL_TOKENIZER), "--append-eod", "--batch-mb", "0.002", "--encoder",
            "reference", *(["--strict"] if strict else [])]
    done = subprocess.run(["bash", str(PREPROCESS), *options, "--log-dir", str(tmp / "logs"), "--", *args],
                          cwd=tmp, env=job_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    array_job, final_job = done.stdout.split()[-2:]
    return array_job, final_job


def _task_pid(plan: Path, task: int) -> int | None:
    """The `shard-run PLAN --task K` process of a running task (its node is this host)."""
    want = [b"shard-run", str(plan).encode(), b"--task", str(task).encode()]
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and all(w in argv for w in want):
            return int(proc.name)
    return None


def wait_for_jobs(jobs: list[str], logs: Path, timeout: float = 300) -> dict[str, dict[str, str]]:
    """Poll until every job is terminal, releasing requeued ones from their BeginTime hold (see wait_for_job)."""
    deadline, held = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        infos = {j: job_info(j) for j in jobs}
        if all(i.get("JobState") in TERMINAL for i in infos.values()):
            return infos
        for j, i in infos.items():
            if i.get("JobState") == "PENDING" and i.get("Reason") == "BeginTime":
                held.setdefault(j, time.monotonic())
                if time.monotonic() - held[j] >= RELEASE_AFTER_S:
                    subprocess.run(["scontrol", "update", f"JobId={j}", "StartTime=now"], check=True)
                    held.pop(j)
        time.sleep(0.5)
    logs_text = "\n".join(read(p) for p in sorted(logs.glob("*.log")))
    pytest.fail(f"jobs {jobs} did not finish in {timeout:.0f} s; logs:\n{logs_text}")


def test_preprocess_array_requeue_resume_merge_and_failed_task(slurm_cluster, tmp_path):
    """Two submissions of launch/preprocess.sh on the two nodes at once.
    A: 3 tasks, merge. Task 1 is stopped mid-way (after its first batch), requeued with `scontrol requeue`,
    resumes its share, and the final job's merge is byte-identical to one `preprocess` of the same files.
    B: 2 tasks, blend, `--strict`, a malformed line in task 1's file: that task fails naming itself and its file,
    the final job never runs (afterok), and no blend line lists a part."""
    from data_tools.preprocess import preprocess
    from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER

    corpus_a = _write_corpus(tmp_path / "a", (20, 50, 300, 30, 25))  # task 1: f2 alone, ~300 batches
    corpus_b = _write_corpus(tmp_path / "b", (5, 5), bad=1)
    out_a, out_b = tmp_path / "out_a" / "web", tmp_path / "out_b" / "web"
    # B first: A's task 1 must still be running when the loop below starts watching it.
    array_b, final_b = submit_preprocess(tmp_path, corpus_b, out_b, "--tasks", "2", "--finalize", "blend",
                                         strict=True)
    array_a, final_a = submit_preprocess(tmp_path, corpus_a, out_a, "--tasks", "3", "--finalize", "merge")
    plan_a = Path(f"{out_a}.shards.json")
    state = Path(f"{out_a}_part00001.preprocess-state.json")
    deadline = time.monotonic() + 180
    while not state.exists():  # task 1's first batch is written
        assert time.monotonic() < deadline, "task 1 wrote no batch in 180 s:\n" + read(tmp_path / "logs" /
                                                                                     f"preprocess-{array_a}_1.log")
        time.sleep(0.05)
    pid = _task_pid(plan_a, 1)
    assert pid is not None, "task 1 ended before it could be stopped mid-way"
    os.kill(pid, signal.SIGSTOP)  # frozen mid-share until Slurm's kill (SIGCONT, SIGTERM) of the requeue
    subprocess.run(["scontrol", "requeue", f"{array_a}_1"], check=True)

    infos = wait_for_jobs([f"{array_a}_{t}" for t in range(3)] + [final_a, f"{array_b}_0", f"{array_b}_1", final_b],
                          tmp_path / "logs")
    logs = {p.name: read(p) for p in (tmp_path / "logs").glob("*.log")}
    task1 = logs[f"preprocess-{array_a}_1.log"]
    assert infos[final_a]["JobState"] == "COMPLETED", logs
    assert infos[f"{array_a}_1"]["Restarts"] == "1", task1
    assert "interrupted; running it again (a requeue) resumes it" in task1 and "(restart 1)" in task1, task1
    assert re.search(rf"resuming from {corpus_a}/f2.jsonl line \d+", task1) and "done (resumed)" in task1, task1
    single = tmp_path / "single"
    preprocess([str(corpus_a)], str(single), "sentencepiece", str(MISTRAL_TOKENIZER), append_eod=True,
               encoder="reference", progress=False)
    for ext in ("bin", "idx"):
        assert Path(f"{out_a}_text_document.{ext}").read_bytes() == Path(f"{single}_text_document.{ext}").read_bytes()
    assert "verified 3 part(s) of 'text'" in logs[f"preprocess-final-{final_a}.log"]

    failed = logs[f"preprocess-{array_b}_1.log"]
    assert infos[f"{array_b}_0"]["JobState"] == "COMPLETED" and infos[f"{array_b}_1"]["JobState"] == "FAILED"
    assert re.search(rf"error: task 1 of 2 \(1 file\(s\), [\d,]+ bytes: {corpus_b}/f1.jsonl\) failed: "
                     rf"{corpus_b}/f1.jsonl:2: malformed JSON", failed), failed
    assert infos[final_b]["JobState"] == "CANCELLED", infos[final_b]  # its dependency can never be met
    assert not list(out_b.parent.glob("*.blend")) and not Path(f"{out_b}_text_document.bin").exists()
