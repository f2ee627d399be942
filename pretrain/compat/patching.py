"""Named run-time patches: the one record type (`Patch`) and the one owner of applying, undoing and temporarily
switching off the Megatron fixes (`megatron_fixes.py`), the CPU shims (`cpu_shims.py`) and the Megatron-FSDP CPU
shims (`fsdp_cpu.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

_INHERITED = object()  # the attribute came from a base class (or was absent): undoing the patch deletes it again


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Patch:
    """One named run-time change of Megatron-Core or torch.

    `patch()` makes the change and returns its `(owner, attribute, value)` substitutions, which `Patches` sets and
    can undo (an empty list: a one-off action for the process, e.g. deferring an import, with nothing to undo)."""

    name: str
    since: str  # first megatron-core release that needs it (0.16.1: the oldest supported)
    fixed_in: str | None  # first release without the need; None: through the newest checked (0.19.2)
    patch: Callable[[], list]
    condition: Callable[[], bool] = _always  # on this machine, e.g. only without Transformer Engine

    def needed(self, version=None) -> bool:
        """True when `version` (default: the installed megatron-core) needs it (outside `condition`)."""
        from packaging.version import Version

        if version is None:
            from pretrain.compat.mcore import MCORE

            version = MCORE
        return Version(self.since) <= version and (self.fixed_in is None or version < Version(self.fixed_in))


class Patches:
    """Named groups of `(owner, attribute, value)` patches, each applied at most once and undone exactly."""

    def __init__(self, kind: str, names: Callable[[], Iterable[str]]) -> None:
        self.kind = kind  # for the error on an unknown name, e.g. "Megatron fix(es)"
        self._names = names
        self.applied: dict[str, list[tuple[object, str, object]]] = {}
        self.disabled: set[str] = set()

    def apply(self, name: str, patches: Iterable[tuple[object, str, object]]) -> None:
        originals = []
        for owner, attr, value in patches:
            originals.append((owner, attr, owner.__dict__.get(attr, _INHERITED)))
            setattr(owner, attr, value)
        self.applied[name] = originals

    def apply_needed(self, records: Iterable[Patch]) -> list[str]:
        """Apply every record the installed release needs on this machine, once (not those switched off); returns
        the names in effect, in the records' order."""
        records = list(records)
        for rec in records:
            if rec.name in self.applied or rec.name in self.disabled or not rec.needed() or not rec.condition():
                continue
            self.apply(rec.name, rec.patch())
        return [rec.name for rec in records if rec.name in self.applied]

    def undo(self, name: str) -> None:
        for owner, attr, original in reversed(self.applied.pop(name)):
            if original is _INHERITED:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)

    @contextlib.contextmanager
    def switched_off(self, names: tuple[str, ...], reapply: Callable[[], object]) -> Iterator[None]:
        """Within the block the named groups are undone and not re-applied; `reapply` runs after it."""
        unknown = set(names) - set(self._names())
        if unknown:
            raise ValueError(f"unknown {self.kind}: {', '.join(sorted(unknown))}")
        undone = [n for n in names if n in self.applied]
        for name in undone:
            self.undo(name)
        self.disabled.update(names)
        try:
            yield
        finally:
            self.disabled.difference_update(names)
            if undone:
                reapply()
