"""One rank of a persistent rank pool: runs worker-module cases one after another in this process.

    torchrun --nproc-per-node=W -m tests.pool.server POOL_DIR    (W > 1)
    python -m tests.pool.server POOL_DIR                         (W = 1: the first case creates the group)

The client (`tests.pool`) writes `POOL_DIR/case-N.json` = {"module", "argv", "env", "log", "name"}. Every rank
polls for its next N (no collective while idle, so no process-group timeout fires), appends its stdout and
stderr to `log`, sets `env`, and calls `module.main(argv)` as the module's command line would. The exit status
(return value or SystemExit; 1 and a traceback in the log for any other exception) goes to
`POOL_DIR/case-N.rank-R.json` = {"rc", "seconds", "retire"} (retire: why the rank wants to be replaced, e.g.
leaked threads, or null). Between cases the process-wide state a case leaves behind is
reset (`reset_state`); the default process group is kept (re-creating it in one process is not safe).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import importlib
import json
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")

POLL_S = 0.05
# A rank that still holds more native threads (leaked gloo groups: each idles with threads that wake up) or memory
# than this after its reset retires: the client ends the pool after the case and the next case starts a fresh one.
MAX_THREADS = 200
MAX_RSS_MB = 4096
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` atomically (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@contextlib.contextmanager
def redirected(log: str) -> Iterator[None]:
    """File descriptors 1 and 2 (and so everything this process and its children print) appended to `log`."""
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


@contextlib.contextmanager
def case_scope(module: str, argv: list[str], env: dict[str, str]) -> Iterator[None]:
    """The case's environment, argv, working directory, signal handlers and torch settings; restored after.
    Destroying the default process group is a no-op inside (`pretrain.run.runtime.shutdown` calls it)."""
    import torch
    import torch.distributed as dist

    saved_env, saved_argv, saved_cwd = dict(os.environ), list(sys.argv), os.getcwd()
    saved_signals = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    saved_torch = torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled()
    real_destroy = dist.destroy_process_group

    def destroy_process_group(group=None) -> None:
        if group is None or (dist.is_initialized() and group is dist.group.WORLD):
            return  # the pool's default group lives on
        real_destroy(group)

    os.environ.update({k: str(v) for k, v in env.items()})
    # A case returns to the pool instead of ending its process: no torchrun agent stops the other ranks when one
    # returns, so no rank waits for rank 0 to say a failure (pretrain.run.once).
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    sys.argv = [module, *argv]
    dist.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.destroy_process_group = real_destroy
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        for sig, handler in saved_signals.items():
            if handler is not None:
                signal.signal(sig, handler)
        torch.set_num_threads(saved_torch[0])
        torch.set_default_dtype(saved_torch[1])
        torch.set_grad_enabled(saved_torch[2])


def run_module(module: str, argv: list[str]) -> int:
    """`module.main(argv)` as an exit status: its return value or SystemExit's code; 1 (traceback printed) for
    any other exception."""
    try:
        rc = importlib.import_module(module).main(list(argv))
    except SystemExit as exc:
        rc = exc.code
        if rc is not None and not isinstance(rc, int):
            print(rc, file=sys.stderr)
            rc = 1
    except BaseException:  # noqa: BLE001 - reported as the case's exit status, with its traceback in the log
        traceback.print_exc()
        return 1
    return int(rc or 0)


def destroy_subgroups() -> None:
    """Destroy every process group but the default one. Megatron's `destroy_model_parallel` only forgets its
    groups; a process ends them at exit, a pool must (each gloo group keeps its own threads: hundreds of cases
    would reach the machine's thread limit)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)


def reset_state() -> None:
    """What a case may leave behind in this process, back to a fresh rank's state (the default group kept)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator

    from pretrain import compat
    from pretrain.compat import cpu_shims, fsdp_cpu, megatron_fixes
    from pretrain.observe import moe_metrics
    from pretrain.run import output_lock

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    destroy_subgroups()
    parallel_state.destroy_global_memory_buffer()
    with contextlib.suppress(ImportError):  # created at first use by Megatron's schedules and DDP
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine

        destroy_rerun_state_machine()
    unset_num_microbatches_calculator()
    # The auxiliary losses' backward scales are class attributes: a case that ran a MoE backward outside Megatron's
    # schedules (a scalar scale made on first use) broke the next case's copy of its [1]-shaped scale into it.
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    with contextlib.suppress(ImportError):  # the same class state for DeepSeek sparse attention's indexer loss (0.17+)
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        DSAIndexerLossAutoScaler.main_loss_backward_scale = None
    tensor_parallel.random.get_cuda_rng_tracker().reset()
    moe_metrics._forget_earlier_runs()
    # A case's `without_fixes` / `without_shims` / `without_cpu_shims` blocks re-apply on exit; a case stopped
    # inside one must not leave a fix or shim switched off for the next.
    megatron_fixes._DISABLED.clear()
    fsdp_cpu._DISABLED.clear()
    cpu_shims._PATCHES.disabled.clear()
    compat.apply()
    output_lock.release_all()
    gc.collect()


def worn_out() -> str | None:
    """Why this process should not take another case (too many threads or too much memory), or None."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        rss_mb = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        if rss_mb > MAX_RSS_MB:
            return f"{rss_mb:.0f} MiB resident"
    return f"{threads} threads" if threads > MAX_THREADS else None


def run_case(pool: Path, n: int, rank: int) -> tuple[int, str | None]:
    """Run case `n` on this rank, write its rank file; (the exit status, why this rank retires or None)."""
    case = json.loads((pool / f"case-{n}.json").read_text())
    started = time.monotonic()
    with redirected(case["log"]):
        with case_scope(case["module"], case["argv"], case.get("env") or {}):
            rc = run_module(case["module"], case["argv"])
        try:
            reset_state()
        except BaseException:  # noqa: BLE001 - a pool that cannot reset is restarted by the client
            traceback.print_exc()
            rc = rc or 1
    retire = worn_out()
    write_json(pool / f"case-{n}.rank-{rank}.json",
               {"rc": rc, "seconds": round(time.monotonic() - started, 3), "retire": retire})
    return rc, retire


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from pretrain import compat

    pool = Path((sys.argv[1:] if argv is None else argv)[0])
    # A native crash (SIGSEGV, SIGABRT, ...) prints every thread's Python stack to fd 2: the running case's log.
    faulthandler.enable(all_threads=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    compat.apply()  # as every trainer does at start-up; the CPU shims must precede Megatron's first use
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    write_json(pool / f"ready.rank-{rank}.json", {"pid": os.getpid()})
    n = 0
    while True:
        if (pool / "stop").exists():
            return 0
        if not (pool / f"case-{n}.json").exists():
            time.sleep(POLL_S)
            continue
        rc, retire = run_case(pool, n, rank)
        if rc != 0 or retire:  # the client ends the pool; another rank may wait in a collective forever
            while not (pool / "stop").exists():
                time.sleep(POLL_S)
            return 0
        if world > 1:
            dist.barrier()  # the next case starts on all ranks together
        n += 1


if __name__ == "__main__":  # a spawned child (checkpoint writer's Manager) re-imports this module: no loop then
    sys.exit(main())
