"""Each problem is said once: one rule owns each concept (no two problem lines for one mistake), and a failure
every rank of a launch meets with the same words (a config refused by validation, a config that does not parse) is
printed by rank 0 only, as `validate` prints it (before: once per rank, 4 times at CP2 × PP2 × VP2)."""

from __future__ import annotations

import subprocess

import pytest

from tests.cli import run_cli
from tests.pretrain.ckpt_helpers import REPO, TORCHRUN, _env, free_port

# (config, overrides, world, a word every line about the concept has): one problem line each
ONE_OWNER = {
    "biased experts at expert TP 2": ("tiny_gpt_oss", ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                                       "parallel.expert=2", "parallel.expert_tensor=2"], 4,
                                      "model.add_bias_linear"),
    "MoE keys on a dense model": ("tiny_llama", ["model.moe_layer_freq=[0,1,1,1]", "model.moe_router_num_groups=2",
                                                 "model.moe_router_enable_expert_bias=true"], 1, "has no experts"),
}


@pytest.mark.parametrize("name", list(ONE_OWNER))
def test_one_line_per_concept(name):
    config, overrides, world, word = ONE_OWNER[name]
    result = run_cli("pretrain", ["validate", config, "--world-size", str(world), "data.mock=true", *overrides])
    assert result.rc == 2, result
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()[:1].isdigit() and word in ln]
    print(f"{name}: {lines}")
    assert len(lines) == 1, result


@pytest.mark.slow
def test_a_launch_prints_a_refused_config_once():
    """`torchrun --nproc-per-node 2 -m pretrain train` of a config validation refuses, and of one that does not
    parse: exit status 2 on both ranks, the problem block and the config error line once."""
    def launch(*overrides: str) -> tuple[str, str]:
        cmd = [TORCHRUN, "--nproc-per-node=2", f"--master-port={free_port()}", "-m", "pretrain", "train",
               "tiny_llama", "data.mock=true", "parallel.pipeline=2", *overrides]
        done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
        return done.stdout, done.stderr

    out, err = launch("parallel.pipeline_layout=Ettt|L")
    assert (out + err).count("config check failed: 1 problem(s) (world size 2)") == 1, out + err
    assert (out + err).count("places 3 decoder layer(s) `t`, but model.num_layers=4") == 1, out + err
    assert "exitcode: 2" in err and "pretrain/train.py" not in err, err  # torchrun's own traceback only
    out, err = launch("parallel.tensr=2")
    assert (out + err).count("config error: unknown config key 'parallel.tensr'") == 1, out + err


def test_a_silent_rank_leaves_after_rank_0_has_said_it():
    """The config error of a launch, as rank 1 of 2 meets it: it says nothing and waits (torchrun stops the launch
    when any rank exits, and a rank 1 gone at once had stopped rank 0 before it printed the error: the launch then
    failed without a word), until SIGTERM — what torchrun sends once rank 0 has said it and exited — ends it at once.
    As rank 0: the line, exit 2, no wait."""
    import os
    import signal
    import sys
    import time

    cmd = [sys.executable, "-m", "pretrain", "train", "tiny_llama", "parallel.tensr=2"]
    env = {**_env(), "WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_RUN_ID": "test"}  # as torchrun's agent sets
    silent = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = subprocess.run(cmd, cwd=REPO, env={**env, "RANK": "0"}, capture_output=True, text=True, timeout=120)
    assert said.returncode == 2 and said.stderr.count("config error: unknown config key 'parallel.tensr'") == 1
    time.sleep(3)  # rank 1 has done rank 0's work by now (it started first)
    assert silent.poll() is None  # still waiting after rank 0 has printed and exited
    os.kill(silent.pid, signal.SIGTERM)
    started = time.monotonic()
    out, err = silent.communicate(timeout=30)
    assert silent.returncode == -signal.SIGTERM and time.monotonic() - started < 5
    assert "config error" not in out + err, out + err
    elsewhere = {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"}  # srun's tasks, a pool: no one to wait for
    done = subprocess.run(cmd, cwd=REPO, env=elsewhere, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "config error" not in done.stderr, done.stderr
