"""`train.skip_steps`: steps whose global batch is consumed but not trained (after a spike, to jump the batches
that caused it). A skipped step reads no data, runs no forward/backward and no optimizer step, but counts: the
step number, consumed samples and the LR schedule advance as if it had trained, so the data order after it is
that of a run that trained it (Megatron-LM's `--iterations-to-skip`, as config).

Ranges are kept as ranges (never unrolled): `"1-99999999999"` costs what `5` costs."""

from __future__ import annotations

from dataclasses import dataclass

STEP_MAX = 2**63 - 1  # steps are int64 (config_parse's bound on integers)


@dataclass(frozen=True)
class SkipSteps:
    """The steps `train.skip_steps` names: sorted, merged, inclusive 1-based ranges."""

    ranges: tuple[tuple[int, int], ...] = ()

    def __contains__(self, step: int) -> bool:
        return any(lo <= step <= hi for lo, hi in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def within(self, first: int, last: int) -> SkipSteps:
        """The steps from `first` to `last` (inclusive)."""
        return SkipSteps(tuple((max(lo, first), min(hi, last)) for lo, hi in self.ranges
                               if hi >= first and lo <= last))

    def __str__(self) -> str:
        """`3-5, 9` (for the one line the run prints)."""
        return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in self.ranges)


def _range(item) -> tuple[int, int] | None:
    """(first, last) of one entry: a step (1 or more) or a range "a-b" (1 <= a <= b); None for anything else."""
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        return (item, item) if 1 <= item <= STEP_MAX else None
    first, sep, last = str(item).strip().partition("-")
    first, last = first.strip(), last.strip()
    if not (sep and first.isdigit() and last.isdigit() and len(first) <= 19 and len(last) <= 19):
        return None
    lo, hi = int(first), int(last)
    return (lo, hi) if 1 <= lo <= hi <= STEP_MAX else None


def parse_skip_steps(items: list) -> tuple[SkipSteps, list[str]]:
    """The steps `[5, "10-12"]` names, and every entry that is not a step or a range (as written, `repr`)."""
    found, bad = [], []
    for item in items:
        span = _range(item)
        if span is None:
            bad.append(repr(item))
        else:
            found.append(span)
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(found):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return SkipSteps(tuple(merged)), bad


def beyond(items: list, steps: int) -> list[str]:
    """The entries that name a step after `steps` (train.steps), as written."""
    return [repr(item) for item in items if (span := _range(item)) is not None and span[1] > steps]


def listed(entries: list[str], most: int = 8) -> str:
    """`entries` for a message: the first `most`, then how many more."""
    shown = ", ".join(entries[:most])
    return shown if len(entries) <= most else f"{shown} and {len(entries) - most:,} more"
