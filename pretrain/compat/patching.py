"""Attribute patches that can be undone: the one owner of applying, undoing and temporarily switching off the
Megatron fixes (`megatron_fixes.py`) and the Megatron-FSDP CPU shims (`fsdp_cpu.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

_INHERITED = object()  # the attribute came from a base class (or was absent): undoing the patch deletes it again


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
