"""Runs several training cases in one process group (one torchrun launch): `ckpt_worker.py PLAN.json`.

PLAN.json: {"results": path, "cases": [case, ...]}. A case:
    name         label in the results file
    config       config file or shipped name (default tiny_llama)
    overrides    dotted config overrides
    copy_from    [run_dir, step or [steps]]: start from that run's checkpoint(s) (copied, the tracker naming the
                 last, metrics.jsonl up to it)
    crash_in_save  step: kill this process with SIGKILL while the checkpoint of that step is being written
    stall_in_save  step: the writer processes of that step's checkpoint hang (for a test to kill the trainer)
    writer_dies_in_save  step: the asynchronous writer of that step's checkpoint is killed (SIGKILL) mid-write
    stop_writer_in_save  [step, rank, pid file]: on that rank, each process writing that step's checkpoint appends
                 its pid to the file and stops itself (SIGSTOP) after its first item
    die_at       [point, step]: stop train() dead (a BaseException nothing handles, like a kill: no later write
                 happens) in the commit of that step's save, right after `journal` (commit_in_progress.txt),
                 `run_config` (run_config.yaml) or `tracker` is written, or at `prune` (run_config.yaml of the
                 first pruned checkpoint removed, its files not yet)
    evil_rng     true: save a per-rank RNG object that runs code when unpickled (for the refusal tests)
    load_object  [checkpoint_dir, key]: load only that ShardedObject with Megatron's planner (no pre-check)
    mutate       [[op, path relative to run.dir, arg], ...] applied after copy_from: truncate (fraction kept),
                 delete, evil_pickle (arg: marker file), write (arg: text), write_bytes (arg: hex),
                 nan (path: a checkpoint dir, arg: tensor key; NaN into every 7th value); evil_common / truncate_common
                 (path: an iteration dir) act on whatever holds the common state: `common.pt` (megatron-core
                 ≤ 0.18) or the `common_state` object inside the torch_dist files (0.19+)
    without_fixes  [fix name, ...]: run the case with these Megatron fixes undone (pretrain.compat.megatron_fixes)
    without_shims  [shim name, ...]: ... and these Megatron-FSDP CPU shims undone (pretrain.compat.fsdp_cpu)
    without_cpu_shims  [shim name, ...]: ... and these CPU shims switched off (pretrain.compat.cpu_shims.switched_off)
    load_dcp_object [checkpoint_dir, key]: also load that byte item with DCP's own DefaultLoadPlanner
                 (fsdp_dtensor checkpoints; after load_object when both are given)
    marker       a path: the result records whether it exists after the case ("marker_exists")
Results (rank 0): {name: {"ok": bool, "error": str | None, "summary": dict | None}}.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist


class Evil:
    """Unpickling this runs code (creates a marker file); safe loaders must refuse it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _copy_checkpoint(src_run: str, steps: int | list[int], dst_run: str) -> None:
    from pretrain.checkpoint.format import TRACKER, iteration_dir

    steps = steps if isinstance(steps, list) else [steps]
    step = max(steps)
    src, dst = Path(src_run) / "checkpoints", Path(dst_run) / "checkpoints"
    shutil.rmtree(dst_run, ignore_errors=True)
    dst.mkdir(parents=True)
    for s in steps:
        shutil.copytree(iteration_dir(src, s), iteration_dir(dst, s))
    (dst / TRACKER).write_text(f"{step}\n")
    lines = [ln for ln in (Path(src_run) / "metrics.jsonl").read_text().splitlines()
             if json.loads(ln).get("step", 0) <= step]
    (Path(dst_run) / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines))


def _common_object(ckpt: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of the `common_state` object inside a 0.19+ torch_dist checkpoint."""
    from pretrain.checkpoint.format import COMMON_OBJECT, read_index

    for key, info in read_index(ckpt).storage_data.items():
        if key.fqn == COMMON_OBJECT:
            return ckpt / info.relative_path, info.offset, info.length
    raise FileNotFoundError(f"{ckpt}: no common.pt and no {COMMON_OBJECT} object")


def _mutate(run_dir: str, ops: list) -> None:
    import pickle

    for op, rel, *arg in ops:
        f = Path(run_dir) / rel
        if op in ("evil_common", "truncate_common") and not (f / "common.pt").exists():
            data_file, offset, length = _common_object(f)
            data = bytearray(data_file.read_bytes())
            if op == "evil_common":  # same length: the index stays valid, only the object is replaced
                evil = pickle.dumps(Evil(arg[0]))
                assert len(evil) <= length
                data[offset:offset + length] = evil + b"\0" * (length - len(evil))
            else:  # cut the file inside the object
                del data[offset + length // 2:]
            data_file.write_bytes(bytes(data))
            continue
        if op == "evil_common":
            op, f = "evil_pickle", f / "common.pt"
        elif op == "truncate_common":
            op, f, arg = "truncate", f / "common.pt", [0.5]
        if op == "truncate":
            data = f.read_bytes()
            f.write_bytes(data[: int(len(data) * arg[0])])
        elif op == "delete":
            shutil.rmtree(f) if f.is_dir() else f.unlink()
        elif op == "evil_pickle":
            f.write_bytes(pickle.dumps(Evil(arg[0])))
        elif op == "write":
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(arg[0])
        elif op == "write_bytes":
            f.write_bytes(bytes.fromhex(arg[0]))
        elif op == "nan":
            _nan_into(f, arg[0])
        else:
            raise ValueError(f"unknown mutation {op!r}")


def _nan_into(checkpoint: Path, key: str) -> None:
    """Overwrite every 7th value of tensor `key` in a torch_dist checkpoint with NaN, in place (same bytes)."""
    import io

    import torch

    from pretrain.checkpoint.format import read_index

    for item, info in read_index(checkpoint).storage_data.items():
        if item.fqn == key:
            f = checkpoint / info.relative_path
            data = bytearray(f.read_bytes())
            tensor = torch.load(io.BytesIO(bytes(data[info.offset:info.offset + info.length])), weights_only=True)
            tensor.view(-1)[::7] = float("nan")
            blob = io.BytesIO()
            torch.save(tensor, blob)
            assert len(blob.getvalue()) == info.length, "re-serialised tensor changed size"
            data[info.offset:info.offset + info.length] = blob.getvalue()
            f.write_bytes(bytes(data))
            return
    raise KeyError(f"{key} not in {checkpoint}")


def _arm_writers(step: int, flag: str, action) -> list:
    """Wrap Megatron's per-item checkpoint writer: in the save of `step` (the writer processes it forks inherit
    the environment flag `flag`), `action()` runs after the first item is written. Returns what to undo."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from pretrain.checkpoint import save as checkpoint_save

    original_write_item = filesystem_async._write_item
    original_save = checkpoint_save.save_checkpoint

    @functools.wraps(original_write_item)  # Megatron inspects its signature
    def write_item(*args, **kwargs):
        result = original_write_item(*args, **kwargs)
        if os.environ.get(flag) == "1":
            action()
        return result

    def save_checkpoint(*args, **kwargs):
        if kwargs.get("step") == step:
            os.environ[flag] = "1"  # inherited by the forked writers
            os.environ["CKPT_TRAINER_PID"] = str(os.getpid())
        return original_save(*args, **kwargs)

    filesystem_async._write_item = write_item
    checkpoint_save.save_checkpoint = save_checkpoint
    return [(filesystem_async, "_write_item", original_write_item), (checkpoint_save, "save_checkpoint", original_save)]


def _install_crash(step: int) -> list:
    """SIGKILL the trainer from inside a checkpoint writer process, after its first item of `step`."""
    trainer = os.getpid()

    def crash():
        os.kill(trainer, signal.SIGKILL)
        os._exit(1)

    return _arm_writers(step, "CKPT_CRASH_ARMED", crash)


def _install_stall(step: int) -> list:
    """Make the checkpoint writer of `step` hang (as on a slow file system) after its first item."""
    return _arm_writers(step, "CKPT_STALL_ARMED", lambda: time.sleep(600))


def _install_writer_death(step: int) -> list:
    """SIGKILL the asynchronous writer process (not the trainer) after its first item of `step`."""

    def die():
        trainer = os.environ["CKPT_TRAINER_PID"]
        if str(os.getpid()) != trainer:  # the writer is the trainer's child; a worker it forked kills it too
            os.kill(os.getpid() if str(os.getppid()) == trainer else os.getppid(), signal.SIGKILL)
            os._exit(1)

    return _arm_writers(step, "CKPT_WRITER_DIES", die)


def _install_writer_stop(step: int, rank: int, pid_file: str) -> list:
    """SIGSTOP each process that writes `step`'s checkpoint on `rank` (its pid appended to `pid_file` first)."""

    def stop():
        if os.environ.get("RANK", "0") == str(rank) and str(os.getpid()) != os.environ["CKPT_TRAINER_PID"]:
            with open(pid_file, "a") as f:
                f.write(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGSTOP)

    return _arm_writers(step, "CKPT_WRITER_STOPS", stop)


class SimulatedKill(BaseException):
    """Raised where a kill would stop the trainer: nothing catches it, so nothing more is written."""


def _install_die_at(point: str, step: int) -> list:
    """`die_at`: wrap the writes of the commit (pretrain.checkpoint.format.write_atomic) and the pruning."""
    from pretrain.checkpoint import format as checkpoint_format
    from pretrain.checkpoint import save as checkpoint_save

    names = {"journal": "commit_in_progress.txt", "run_config": "run_config.yaml",
             "tracker": "latest_checkpointed_iteration.txt"}
    original_write, original_rmtree = checkpoint_format.write_atomic, checkpoint_save.shutil.rmtree
    armed = {"on": False}
    original_save = checkpoint_save.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        armed["on"] = kwargs.get("step") == step
        return original_save(*args, **kwargs)

    def write_atomic(path, data, **kwargs):
        original_write(path, data, **kwargs)
        if armed["on"] and point in names and Path(path).name == names[point]:
            raise SimulatedKill(f"killed after writing {path}")

    def rmtree(path, *args, **kwargs):
        if armed["on"] and point == "prune" and Path(path).name.startswith("iter_"):
            raise SimulatedKill(f"killed while pruning {path}")
        return original_rmtree(path, *args, **kwargs)

    checkpoint_format.write_atomic = write_atomic
    checkpoint_save.save_checkpoint = save_checkpoint
    checkpoint_save.shutil.rmtree = rmtree
    return [(checkpoint_format, "write_atomic", original_write), (checkpoint_save, "save_checkpoint", original_save),
            (checkpoint_save.shutil, "rmtree", original_rmtree)]


def _load_object(checkpoint: str, key: str, world: int, rank: int) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from pretrain import compat

    compat.apply()
    state = {key: ShardedObject(key, None, (world,), (rank,), replica_id=0)}
    dist_checkpointing.load(state, checkpoint)


def _load_dcp_object(checkpoint: str, key: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    from pretrain import compat

    compat.apply()
    dcp.load({key: None}, storage_reader=FileSystemReader(checkpoint), planner=DefaultLoadPlanner())


def run_case(case: dict, results: dict) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from pretrain.checkpoint import state as checkpoint_state
    from pretrain.compat import cpu_shims, fsdp_cpu, megatron_fixes
    from pretrain.config import load_config
    from pretrain.train import train

    name = case["name"]
    rank = dist.get_rank() if dist.is_initialized() else 0
    cfg = load_config(case.get("config", "tiny_llama"), case.get("overrides", []))
    if case.get("copy_from") and rank == 0:
        _copy_checkpoint(case["copy_from"][0], case["copy_from"][1], cfg.run.dir)
    if case.get("mutate") and rank == 0:
        _mutate(cfg.run.dir, case["mutate"])
    if dist.is_initialized():
        dist.barrier()
    original_rng = checkpoint_state._rng_state
    if case.get("evil_rng"):
        checkpoint_state._rng_state = lambda: {"python": Evil(case["evil_rng"])}
    undo = []
    if case.get("crash_in_save"):
        undo += _install_crash(int(case["crash_in_save"]))
    if case.get("stall_in_save"):
        undo += _install_stall(int(case["stall_in_save"]))
    if case.get("writer_dies_in_save"):
        undo += _install_writer_death(int(case["writer_dies_in_save"]))
    if case.get("stop_writer_in_save"):
        undo += _install_writer_stop(*case["stop_writer_in_save"])
    undo += _install_die_at(*case["die_at"]) if case.get("die_at") else []
    started = time.perf_counter()
    try:
        with megatron_fixes.disabled(*case.get("without_fixes", [])), \
                fsdp_cpu.disabled(*case.get("without_shims", [])), \
                cpu_shims.switched_off(*case.get("without_cpu_shims", [])):
            if case.get("load_object") or case.get("load_dcp_object"):
                if case.get("load_object"):
                    _load_object(case["load_object"][0], case["load_object"][1], dist.get_world_size(), rank)
                if case.get("load_dcp_object"):
                    _load_dcp_object(*case["load_dcp_object"])
                summary = None
            else:
                summary = train(cfg)
        results[name] = {"ok": True, "error": None, "summary": summary}
    except (Exception, CheckpointException, SimulatedKill) as exc:  # recorded for the test to assert on
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "summary": None,
                         "traceback": traceback.format_exc()}
    finally:
        checkpoint_state._rng_state = original_rng
        for owner, attribute, original in reversed(undo):
            setattr(owner, attribute, original)
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
        if case.get("marker"):
            results[name]["marker_exists"] = Path(case["marker"]).exists()


def main(argv: list[str] | None = None) -> int:
    plan_path = (sys.argv[1:] if argv is None else argv)[0]
    from pretrain.run.runtime import init_distributed, shutdown

    plan = json.loads(Path(plan_path).read_text())
    init_distributed()
    results: dict = {}
    try:
        for case in plan["cases"]:
            run_case(case, results)
            if dist.get_rank() == 0:
                Path(plan["results"]).write_text(json.dumps(results, indent=1))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":  # the async checkpoint writer re-imports __main__
    sys.exit(main())
