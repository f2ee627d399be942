"""`train.skip_steps`: steps whose global batch is consumed but not trained (after a spike, to jump the batches
that caused it). A skipped step reads no data, runs no forward/backward and no optimizer step, but counts: the
step number, consumed samples and the LR schedule advance as if it had trained, so the data order after it is
that of a run that trained it (Megatron-LM's `--iterations-to-skip`, as config)."""

from __future__ import annotations


def parse_skip_steps(items: list) -> tuple[set[int], str | None]:
    """The set of 1-based steps `[5, "10-12"]` names, or (empty, the first entry that is not a step or range)."""
    steps: set[int] = set()
    for item in items:
        if isinstance(item, bool):
            return set(), repr(item)
        if isinstance(item, int):
            if item < 1:
                return set(), repr(item)
            steps.add(item)
            continue
        text = str(item).strip()
        first, sep, last = text.partition("-")
        if not (sep and first.strip().isdigit() and last.strip().isdigit()):
            return set(), repr(item)
        lo, hi = int(first), int(last)
        if lo < 1 or hi < lo:
            return set(), repr(item)
        steps.update(range(lo, hi + 1))
    return steps, None


def ranges(steps: set[int]) -> str:
    """`{3, 4, 5, 9}` -> "3-5, 9" (for the one line the run prints)."""
    out, run = [], []
    for s in sorted(steps):
        if run and s != run[-1] + 1:
            out.append(run)
            run = []
        run.append(s)
    if run:
        out.append(run)
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)
