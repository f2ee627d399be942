"""What pre-flight validation reports: each problem names the keys involved and a fix.

Below the rules and the data checks that fill a `Report` (they import it from here), above nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Problem:
    keys: tuple[str, ...]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"[{', '.join(self.keys)}] {self.message}. Fix: {self.fix}"


@dataclass
class Report:
    world_size: int
    errors: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # not fatal, but the user should act (e.g. unchecked data)
    ids_unchecked: bool = False  # a dataset's largest token id is unknown: the trainer checks every batch
    data_verdicts: list = field(default_factory=list)  # full reads of dataset files, for the verdict cache (rank 0)
    megatron_verdicts: list = field(default_factory=list)  # Megatron-Core's checks passed: rules/megatron_verdicts
    start_verdicts: list = field(default_factory=list)  # what train starts from, accepted: rules/start

    def error(self, keys: tuple[str, ...] | str, message: str, fix: str, label: str | None = None) -> None:
        """One problem; `label` (a stage's, say) heads its message."""
        message = f"{label}: {message}" if label is not None else message
        self.errors.append(Problem((keys,) if isinstance(keys, str) else tuple(keys), message, fix))

    @property
    def ok(self) -> bool:
        return not self.errors

    def text(self) -> str:
        lines = []
        if self.errors:
            lines.append(f"config check failed: {len(self.errors)} problem(s) (world size {self.world_size})")
            lines += [f"  {i}. {p}" for i, p in enumerate(self.errors, 1)]
        else:
            lines.append(f"config OK (world size {self.world_size})")
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class ValidationFailed(ValueError):
    """Raised by the trainer when the config fails pre-flight validation (on every rank alike: printed by rank 0)."""

    every_rank = True

    def __init__(self, report: Report):
        super().__init__(report.text())
        self.report_obj = report

    def report(self) -> str:
        return self.report_obj.text()
