"""Preprocessing spread over many tasks (a Slurm array, ``launch/preprocess.sh``): the plan, one task's run, and
the final step that merges the parts or writes their blend.

* ``plan_shards``/``make_plan``: the input files (``preprocess``'s own order: sorted, de-duplicated) cut into
  contiguous runs balanced by bytes. The plan (``PREFIX.shards.json``) is written once, at submission; every task
  reads its share from it, so a re-run of a task redoes exactly that share.
* ``run_task``: task K preprocesses its files into ``PREFIX_partKKKKK_{key}_document``, always with resume: a
  task killed mid-way (preempted, requeued) continues from its last complete batch; a complete part is kept.
* ``finalize`` (``data_tools.finalize``): refuses while any part is missing or incomplete (naming the tasks and
  their files), verifies every part (``verify``), then merges them in task order — byte-identical to one
  ``preprocess`` of all the files, since the tasks' shares are contiguous runs of that order — or writes the
  blend line ``data.blend=[tokens0,part0,tokens1,part1,...]`` to ``PREFIX_{key}_document.blend``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_tools.inputs import InputError, expand_inputs

PLAN_FORMAT = "megapretrain-preprocess-plan"
PLAN_SUFFIX = ".shards.json"
STATE_SUFFIX = ".preprocess-state.json"  # preprocess's resume state (data_tools.preprocess.STATE_SUFFIX)
OPTION_KEYS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "json_keys", "append_eod",
               "workers", "strict", "keep_empty", "encoder", "batch_bytes")
MAX_BLEND_LINE = 120_000  # bytes: one command-line argument may hold at most 128 KiB on Linux


class ShardError(RuntimeError):
    """A plan, task or final step that cannot proceed; the message names the tasks and files concerned."""


@dataclass
class Plan:
    """What ``shard-plan`` decided: the files, each task's contiguous share of them, the preprocess options."""

    output_prefix: str
    inputs: list[dict[str, Any]]  # {"path": absolute, "bytes": size}, in preprocess's order
    tasks: list[tuple[int, int]]  # [first, end) into inputs, per task
    options: dict[str, Any]  # keyword arguments of data_tools.preprocess.preprocess

    @property
    def keys(self) -> list[str]:
        return list(self.options.get("json_keys") or ["text"])

    def files(self, task: int) -> list[str]:
        first, end = self.tasks[task]
        return [x["path"] for x in self.inputs[first:end]]

    def task_bytes(self, task: int) -> int:
        first, end = self.tasks[task]
        return sum(x["bytes"] for x in self.inputs[first:end])

    def describe(self, task: int) -> str:
        files = self.files(task)
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return f"task {task} of {len(self.tasks)} ({len(files)} file(s), {self.task_bytes(task):,} bytes: {shown})"

    def part(self, task: int, key: str) -> str:
        """The dataset prefix task ``task`` writes for JSON key ``key``."""
        return f"{part_prefix(self.output_prefix, task)}_{key}_document"

    def to_json(self) -> str:
        return json.dumps({"format": PLAN_FORMAT, "version": 1, **asdict(self)}, indent=1) + "\n"


def part_prefix(output_prefix: str, task: int) -> str:
    """``PREFIX_partNNNNN``: the output prefix of task ``task``."""
    return f"{output_prefix}_part{task:05d}"


def task_targets(plan: Plan, task: int) -> list:
    """The outputs task ``task`` writes, to lock (``pretrain.output_lock``): its part prefix (the resume state)
    and each key's dataset, as ``preprocess`` locks them; a second run of the same task is refused naming the
    first, and the lock of a killed attempt of the same Slurm job is taken over by its requeued run."""
    from pretrain.output_lock import Target

    if not 0 <= task < len(plan.tasks):
        raise ShardError(f"task {task} is not in the plan (tasks 0..{len(plan.tasks) - 1})")
    return [Target(part_prefix(plan.output_prefix, task), f"shard-run task {task}"),
            *(Target(plan.part(task, k), "dataset") for k in plan.keys)]


def final_targets(plan: Plan) -> list:
    """The outputs of the final step: each key's merged dataset (or blend file beside it)."""
    from pretrain.output_lock import Target

    return [Target(f"{plan.output_prefix}_{k}_document", "finalize output") for k in plan.keys]


def plan_shards(sizes: list[int], tasks: int) -> list[tuple[int, int]]:
    """Contiguous ``[first, end)`` runs of ``sizes`` for at most ``tasks`` tasks, balanced by bytes.

    File i goes to the task whose byte range ``[j·T/N, (j+1)·T/N)`` holds the middle of the file (T the total,
    N the tasks): every task's share is within one file of T/N. Tasks that would get no file are dropped, so the
    plan may have fewer tasks than asked (never an empty one). Deterministic in ``sizes``.
    """
    if tasks < 1:
        raise ShardError(f"--tasks must be at least 1, got {tasks}")
    total = sum(sizes)
    owner, run = [], 0
    for size in sizes:
        middle2 = 2 * run + size  # twice the file's middle, in integers
        owner.append(min(tasks - 1, middle2 * tasks // (2 * total)) if total else len(owner) * tasks // len(sizes))
        run += size
    out: list[tuple[int, int]] = []
    for i, j in enumerate(owner):
        if out and owner[i - 1] == j:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def make_plan(preprocess_args: Any, tasks: int) -> Plan:
    """The plan for ``preprocess_args`` (the parsed options of ``python -m data_tools preprocess``)."""
    a = preprocess_args
    files = expand_inputs(a.input)
    if not files:
        raise InputError("no input files given")
    out_dir = Path(a.output_prefix).absolute().parent
    if not out_dir.is_dir() or not os.access(out_dir, os.W_OK | os.X_OK):
        raise ShardError(f"output directory is missing or not writable: {out_dir}")
    inputs = [{"path": str(p.absolute()), "bytes": p.stat().st_size} for p in files]
    options = {
        "tokenizer_type": a.tokenizer_type,
        **{k: (os.path.abspath(v) if v else None) for k, v in
           (("tokenizer_model", a.tokenizer_model), ("vocab_file", a.vocab_file), ("merge_file", a.merge_file))},
        "json_keys": list(a.json_keys), "append_eod": a.append_eod, "workers": a.workers, "strict": a.strict,
        "keep_empty": a.keep_empty, "encoder": a.encoder, "batch_bytes": int(a.batch_mb * (1 << 20)),
    }
    shards = plan_shards([x["bytes"] for x in inputs], tasks)
    return Plan(str(Path(a.output_prefix).absolute()), inputs, shards, options)


def write_plan(plan: Plan, path: str | os.PathLike) -> None:
    from pretrain.files import write_atomic

    write_atomic(path, plan.to_json())


def read_plan(path: str | os.PathLike) -> Plan:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        if raw.get("format") != PLAN_FORMAT:
            raise ValueError(f"format is {raw.get('format')!r}, expected {PLAN_FORMAT!r}")
        plan = Plan(str(raw["output_prefix"]), list(raw["inputs"]), [tuple(t) for t in raw["tasks"]],
                    dict(raw["options"]))
        unknown = set(plan.options) - set(OPTION_KEYS)
        if unknown:
            raise ValueError(f"unknown options {sorted(unknown)}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ShardError(f"{path}: not a readable preprocessing plan ({e})") from None
    return plan


def part_problem(plan: Plan, task: int) -> str | None:
    """Why task ``task``'s part is not a complete dataset of its files (None: it is)."""
    from pretrain.dataset_format.indexed import bin_path, idx_path
    from pretrain.dataset_format.metadata import MetadataError, meta_path, read_meta

    if Path(f"{part_prefix(plan.output_prefix, task)}{STATE_SUFFIX}").exists():
        return "interrupted (its resume state is there: run the task again to finish it)"
    for key in plan.keys:
        prefix = plan.part(task, key)
        missing = [p.name for p in (bin_path(prefix), idx_path(prefix), meta_path(prefix)) if not p.is_file()]
        if missing:
            return f"not written ({', '.join(missing)} missing)"
        try:
            meta = read_meta(prefix)
        except MetadataError as e:
            return str(e)
        made_from = [(x.get("path"), x.get("bytes")) for x in (meta or {}).get("inputs", [])]
        first, end = plan.tasks[task]
        if made_from != [(str(Path(x["path"]).resolve()), x["bytes"]) for x in plan.inputs[first:end]]:
            return f"{meta_path(prefix).name} was made from other files (or sizes) than the task's share"
    return None


def run_task(plan: Plan, task: int, log: Callable[[str], None]) -> str:
    """Preprocess task ``task``'s share into its part (resuming an interrupted run); return a one-line report."""
    from data_tools.preprocess import preprocess
    from pretrain.dataset_format.indexed import IndexedFormatError

    if not 0 <= task < len(plan.tasks):
        raise ShardError(f"task {task} is not in the plan (tasks 0..{len(plan.tasks) - 1})")
    what = plan.describe(task)
    first, end = plan.tasks[task]
    for x in plan.inputs[first:end]:
        try:
            size = os.stat(x["path"]).st_size
        except OSError as e:
            raise ShardError(f"{what}: input {x['path']}: {e.strerror}") from None
        if size != x["bytes"]:
            raise ShardError(f"{what}: {x['path']} has {size:,} bytes, the plan {x['bytes']:,}: the input changed "
                             "since the plan was made; make a new plan")
    if part_problem(plan, task) is None:
        return f"{what}: already complete ({part_prefix(plan.output_prefix, task)}_*); nothing to do"
    log(f"{what} -> {part_prefix(plan.output_prefix, task)}")
    kwargs = {**plan.options, "progress": False, "log": sys.stderr}
    try:
        try:
            summary = preprocess(plan.files(task), part_prefix(plan.output_prefix, task), resume=True, **kwargs)
        except IndexedFormatError as e:  # temporaries shorter than the resume state (a node crashed)
            log(f"note: {e}; starting the task's share over")
            summary = preprocess(plan.files(task), part_prefix(plan.output_prefix, task), resume=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure is reported with the task and its files
        raise ShardError(f"{what} failed: {e}") from e
    return f"{what}: done{' (resumed)' if summary.resumed else ''}\n{summary.format()}"
