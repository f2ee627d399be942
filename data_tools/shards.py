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
    """The outputs task ``task`` writes, to lock (``pretrain.run.output_lock``): its part prefix (the resume state)
    and each key's dataset, as ``preprocess`` locks them; a second run of the same task is refused naming the
    first, and the lock of a killed attempt of the same Slurm job is taken over by its requeued run."""
    from pretrain.run.output_lock import Target

    if not 0 <= task < len(plan.tasks):
        raise ShardError(f"task {task} is not in the plan (tasks 0..{len(plan.tasks) - 1})")
    return [Target(part_prefix(plan.output_prefix, task), f"shard-run task {task}"),
            *(Target(plan.part(task, k), "dataset") for k in plan.keys)]


def final_targets(plan: Plan) -> list:
    """The outputs of the final step: each key's merged dataset (or blend file beside it)."""
    from pretrain.run.output_lock import Target

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


@dataclass(frozen=True)
class PlanTokenizer:
    """The plan's tokenizer as a part's metadata records it: its identity hash (kind and files' contents)."""

    sha256: str
    text: str  # "KIND FILE + FILE (sha256 …)"


def plan_tokenizer(plan: Plan) -> PlanTokenizer:
    """The identity of the plan's tokenizer (its files hashed once per plan; the tokenizer is not loaded)."""
    cached = plan.__dict__.get("_tokenizer")
    if cached is None:
        from data_tools.made_with import tokenizer_text
        from pretrain.tokenizer.identity import spec_sha256
        from pretrain.tokenizer.spec import resolve_spec

        o = plan.options
        spec = resolve_spec(o["tokenizer_type"], o.get("tokenizer_model"), o.get("vocab_file"), o.get("merge_file"))
        files, sha = spec_sha256(spec)
        cached = plan.__dict__["_tokenizer"] = PlanTokenizer(sha, tokenizer_text(spec.kind, files, sha))
    return cached


def option_differences(plan: Plan, key: str, meta: dict[str, Any]) -> list[str]:
    """How a part's recorded options differ from the plan's, one ``"option: the part's X, the plan's Y"`` each:
    ``data_tools.made_with.differences`` (every option that changes a part's bytes, as ``preprocess --resume``
    compares them; the part's files are compared by ``part_mismatch``), and the token dtype (fixed by the
    tokenizer's vocabulary)."""
    import numpy as np

    from data_tools import made_with
    from pretrain.dataset_format.indexed import optimal_dtype

    o, tok = plan.options, plan_tokenizer(plan)
    want = {"tokenizer": tok.text, "tokenizer_sha256": tok.sha256, "append_eod": bool(o.get("append_eod")),
            "keep_empty": bool(o.get("keep_empty")), "json_keys": [key], "strict": bool(o.get("strict"))}
    diffs = made_with.differences(made_with.from_meta(meta), want, "the part's", "the plan's", inputs=False)
    made = meta.get("tokenizer") or {}
    try:
        dtype = np.dtype(optimal_dtype(int(made["vocab_size"]))).name
    except (KeyError, TypeError, ValueError):
        dtype = None
    if meta.get("dtype") != dtype:
        diffs.append(f"dtype: the part's {meta.get('dtype')!r}, its tokenizer's vocabulary gives {dtype!r}")
    return diffs


def part_mismatch(plan: Plan, task: int) -> str | None:
    """Why task ``task``'s written part is not what its plan asks for (other files, sizes or options), naming the
    part and each difference; None when it matches or is not (fully) written."""
    from pretrain.dataset_format.metadata import MetadataError, meta_path, read_meta
    from pretrain.tokenizer.types import TokenizerError

    for key in plan.keys:
        prefix = plan.part(task, key)
        try:
            meta = read_meta(prefix)
        except MetadataError:
            return None  # part_problem reports it
        if meta is None:
            return None
        made_from = [(x.get("path"), x.get("bytes")) for x in meta.get("inputs", [])]
        first, end = plan.tasks[task]
        if made_from != [(str(Path(x["path"]).resolve()), x["bytes"]) for x in plan.inputs[first:end]]:
            return f"{meta_path(prefix).name} was made from other files (or sizes) than the task's share"
        try:
            diffs = option_differences(plan, key, meta)
        except (TokenizerError, OSError) as e:
            return f"the plan's tokenizer cannot be read to check part {prefix} ({e})"
        if diffs:
            return f"part {prefix} was made with other options than the plan's ({'; '.join(diffs)})"
    return None


def part_problem(plan: Plan, task: int) -> str | None:
    """Why task ``task``'s part is not a complete dataset of its files made with the plan's options (None: it
    is)."""
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
            read_meta(prefix)
        except MetadataError as e:
            return str(e)
    return part_mismatch(plan, task)


def run_task(plan: Plan, task: int, log: Callable[[str], None]) -> str:
    """Preprocess task ``task``'s share into its part (resuming an interrupted run); return a one-line report."""
    from data_tools.made_with import NothingToResume, ResumeRefused
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
    mismatch = part_mismatch(plan, task)
    if mismatch:
        log(f"note: {what}: {mismatch}; redoing it")
    log(f"{what} -> {part_prefix(plan.output_prefix, task)}")
    kwargs = {**plan.options, "progress": False, "log": sys.stderr}
    try:
        try:
            summary = preprocess(plan.files(task), part_prefix(plan.output_prefix, task), resume=mismatch is None,
                                 **kwargs)
        except NothingToResume:
            return f"{what}: already complete ({part_prefix(plan.output_prefix, task)}_*); nothing to do"
        except (IndexedFormatError, ResumeRefused) as e:  # temporaries shorter than the resume state (a node
            log(f"note: {e}; starting the task's share over")  # crashed), a state of another plan's options
            summary = preprocess(plan.files(task), part_prefix(plan.output_prefix, task), resume=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure is reported with the task and its files
        raise ShardError(f"{what} failed: {e}") from e
    return f"{what}: done{' (resumed)' if summary.resumed else ''}\n{summary.format()}"
