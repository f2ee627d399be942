"""Errata of the published table (`benchmarks/published_recipes.yaml` `errata:`), applied by `published_table.plan_row`.

An erratum names a row (container, model, system, precision and its layout cells as tabulated, `table`) whose layout
cannot run or cannot fit the GPU at all, while the recipe of its container's release names the layout for that model,
system, precision and batch (`recipe`, with `source`: where). It is applied only where the tabulated layout is refused
or planned over the GPU's whole memory, and the row says so; otherwise the row is planned as tabulated and says the
erratum was not needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MATCH = ("container", "model", "system", "precision")
LAYOUT_CELLS = ("gbs", "mbs", "fsdp", "tp", "pp", "cp", "vp", "ep")


def cell(value: Any) -> str:
    """A value as the table writes it ('-' for none)."""
    return "-" if value is None else str(value)


def check(path: Path, errata: Any) -> None:
    """ValueError naming the file and the entry when `errata` is not a list of well-formed entries."""
    if not isinstance(errata, list):
        raise ValueError(f"{path}: `errata:` must be a list of entries")
    for e in errata:
        ok = isinstance(e, dict) and all(isinstance(e.get(k), str) for k in (*MATCH, "source"))
        tables = [e.get("table"), e.get("recipe")] if ok else []
        if not ok or not all(isinstance(t, dict) and t for t in tables) or \
                set().union(*tables) - set(LAYOUT_CELLS):
            raise ValueError(f"{path}: erratum {e!r} needs {', '.join(MATCH)}, source, and `table` and `recipe` "
                             f"mappings of the layout cells ({', '.join(LAYOUT_CELLS)})")


def matches(erratum: dict[str, Any], cells: dict[str, str]) -> bool:
    """The row (its cells) is the one the erratum names."""
    return all(cells[k] == erratum[k] for k in MATCH) and all(
        cell(v) == cells[k].strip() for k, v in erratum["table"].items())


def corrected(erratum: dict[str, Any], cells: dict[str, str]) -> dict[str, str]:
    """The row's cells with the recipe's layout."""
    return {**cells, **{k: cell(v) for k, v in erratum["recipe"].items()}}


def cannot(refused: str | None, memory_gib: float | None, capacity_gib: float | None) -> str | None:
    """Why the tabulated layout cannot have run (refused by validation, or over the GPU's whole memory), or None."""
    if refused and not refused.startswith("model not supported yet"):
        return f"cannot run ({refused.split('. Fix:')[0]})"
    if memory_gib is not None and capacity_gib is not None and memory_gib > capacity_gib:
        return f"cannot fit ({memory_gib:.0f} GiB of {capacity_gib:.0f})"
    return None


def layout_text(cells: dict[str, Any]) -> str:
    """Layout cells in words: 'TP1 PP4 VP5 MBS1'."""
    return " ".join(f"{k.upper()}{cell(v)}" for k, v in cells.items())
