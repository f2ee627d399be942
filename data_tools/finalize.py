"""``finalize PLAN``: the last step of a sharded preprocessing run (``data_tools.shards``).

Every task's part must be complete (else one error names each task that is not, with its files, and nothing
is written) and pass ``verify``. Then ``--mode merge`` merges the parts in task order into
``PREFIX_{key}_document`` (the bytes one ``preprocess`` of all the files writes) and verifies the result;
``--mode blend`` writes ``data.blend=[tokens,part,...]`` (weights: each part's token count) to
``PREFIX_{key}_document.blend``, only once every part listed in it is verified.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from data_tools.shards import MAX_BLEND_LINE, Plan, ShardError, part_prefix, part_problem
from pretrain.data.plan import MAX_BLEND_DATASETS

BLEND_SUFFIX = ".blend"


def incomplete_tasks(plan: Plan) -> list[str]:
    """One line per task whose part is not complete: the task, its files and why."""
    return [f"{plan.describe(t)}: {why}" for t in range(len(plan.tasks)) if (why := part_problem(plan, t))]


def blend_line(plan: Plan, key: str, tokens: list[int]) -> str:
    """``data.blend=[w0,part0,w1,part1,...]``: every part weighted by its token count."""
    items = [f"{n},{plan.part(t, key)}" for t, n in enumerate(tokens)]
    return f"data.blend=[{','.join(items)}]"


def _verify_parts(plan: Plan, key: str, log: Callable[[str], None]) -> list[int]:
    from data_tools.verify import verify
    from pretrain.dataset_format.indexed import read_index

    tokens = []
    for t in range(len(plan.tasks)):
        prefix = plan.part(t, key)
        try:
            verify(prefix)
        except (ValueError, OSError) as e:
            raise ShardError(f"{plan.describe(t)}: its part {prefix} fails verification: {e}") from e
        tokens.append(read_index(prefix).num_tokens)
    log(f"verified {len(plan.tasks)} part(s) of {key!r}: {sum(tokens):,} tokens")
    return tokens


def finalize(plan: Plan, mode: str, remove_parts: bool = False, log: Callable[[str], None] | None = None) -> str:
    """Check, verify and merge (``mode="merge"``) or blend (``mode="blend"``) the parts; return a report."""
    from data_tools.merge import merge
    from data_tools.verify import verify
    from pretrain.files import write_atomic

    log = log or (lambda m: print(m, file=sys.stderr))
    if mode not in ("merge", "blend"):
        raise ShardError(f"--mode must be merge or blend, got {mode!r}")
    if remove_parts and mode != "merge":
        raise ShardError("--remove-parts needs --mode merge (a blend reads the parts)")
    if mode == "blend" and len(plan.tasks) > MAX_BLEND_DATASETS:
        raise ShardError(f"--mode blend of {len(plan.tasks):,} parts: Megatron-Core's blend indexes its datasets as "
                         f"int16, at most {MAX_BLEND_DATASETS:,}; use --mode merge")
    bad = incomplete_tasks(plan)
    if bad:
        raise ShardError(f"{len(bad)} of {len(plan.tasks)} task(s) have no complete part, so nothing was "
                         f"{'merged' if mode == 'merge' else 'blended'}: " + "; ".join(bad)
                         + ". Re-run those tasks (the same plan), then finalize again")
    lines = []
    for key in plan.keys:
        tokens = _verify_parts(plan, key, log)
        out = f"{plan.output_prefix}_{key}_document"
        if mode == "merge":
            log(merge([plan.part(t, key) for t in range(len(plan.tasks))], out, log=log))
            lines.append(verify(out))
        else:
            line = blend_line(plan, key, tokens)
            if len(line.encode()) > MAX_BLEND_LINE:
                log(f"warning: the blend line of {len(plan.tasks)} parts is {len(line.encode()):,} bytes, too long "
                    "for one command-line argument (128 KiB); put it in the config YAML or merge the parts")
            write_atomic(f"{out}{BLEND_SUFFIX}", line + "\n")
            lines.append(f"wrote {out}{BLEND_SUFFIX}: {len(plan.tasks)} verified part(s), {sum(tokens):,} tokens")
    if remove_parts:
        for t in range(len(plan.tasks)):
            part = Path(part_prefix(plan.output_prefix, t))
            for p in part.parent.glob(f"{part.name}_*"):
                p.unlink()
        lines.append(f"removed the {len(plan.tasks)} part(s)")
    return "\n".join(lines)
