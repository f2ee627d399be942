"""Which Python × megatron-core × Transformer Engine × torch combinations are supported, and which CI tests.

Facts per megatron-core release series (its `pyproject.toml` at the `core_v*` tags of NVIDIA/Megatron-LM,
and the Transformer Engine commit its own CI builds, looked up in NVIDIA/TransformerEngine):

| megatron-core | Python | torch | Transformer Engine |
|---|---|---|---|
| 0.16.1 | ≥ 3.10 | ≥ 2.6 | ≥ 2.9, < 2.12 (declared by its `dev` extra) |
| 0.17.x | ≥ 3.12 | ≥ 2.6 | 2.14 (0.17.0 builds TE 2.14.0, 0.17.1 TE 2.14.1; no bound declared) |
| 0.18.x | ≥ 3.12 | ≥ 2.6 | 2.16 (0.18.0: TE 2.16.0; 0.18.2: the `release_v2.16.post` branch) |
| 0.19.x | ≥ 3.12 | ≥ 2.6 | 2.17 (TE 2.17.1) |

`assess()` sorts an installation into: "tested" (a combination CI runs), "untested" (inside the ranges
above: a warning) or "refused" (outside them: validation fails unless `run.allow_untested_versions=true`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import metadata, util

from packaging.version import Version

from pretrain.compat.mcore import SUPPORTED_BELOW, SUPPORTED_MIN

TORCH_MIN = Version("2.6")  # every supported release requires torch >= 2.6.0


@dataclass(frozen=True)
class Series:
    """One megatron-core release series and what it pairs with."""

    series: str  # "0.19": releases 0.19.x
    python_min: str
    te_min: str  # oldest TE the series pairs with
    te_below: str  # first TE minor beyond the pairing
    te_bound_declared: bool  # True: the release itself declares te_below (newer TE is refused, not warned)


SERIES = (
    Series("0.16", "3.10", "2.9", "2.12", True),
    Series("0.17", "3.12", "2.14", "2.15", False),
    Series("0.18", "3.12", "2.16", "2.17", False),
    Series("0.19", "3.12", "2.17", "2.18", False),
)

# What CI runs (.ci/run): (Python minor, megatron-core, Transformer Engine or None, torch minor). CPU only.
TESTED = (
    ("3.11", "0.16.1", None, "2.13"),
    ("3.11", "0.19.2", None, "2.13"),
)
PYTHON_BELOW_DECLARED_TESTED = "3.11"  # 0.17+ declare 3.12; CI runs 0.19.2 on 3.11 (installed from the sdist)


@dataclass(frozen=True)
class Installed:
    python: str
    megatron_core: str | None
    transformer_engine: str | None  # None: not installed
    torch: str | None

    def summary(self) -> str:
        return (f"Python {self.python}, megatron-core {self.megatron_core or 'missing'}, "
                f"Transformer Engine {self.transformer_engine or 'none'}, torch {self.torch or 'missing'}")


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed() -> Installed:
    """The versions installed in this interpreter (from package metadata; nothing is imported)."""
    te = _dist_version("transformer-engine", "transformer_engine", "transformer-engine-torch")
    if te is None and util.find_spec("transformer_engine") is not None:
        te = "unknown"
    return Installed(f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}",
                     _dist_version("megatron-core"), te, _dist_version("torch"))


def _minor(version: str) -> str:
    release = Version(version).release
    return ".".join(str(x) for x in release[:2])


def _series(mcore: Version) -> Series | None:
    return next((s for s in SERIES if _minor(str(mcore)) == s.series), None)


def assess(v: Installed) -> tuple[str, list[str]]:
    """("tested" | "untested" | "refused", reasons) for an installation."""
    refused: list[str] = []
    untested: list[str] = []
    if v.megatron_core is None:
        return "refused", ["megatron-core is not installed (make install)"]
    mcore = Version(v.megatron_core)
    series = _series(mcore)
    if not SUPPORTED_MIN <= mcore < SUPPORTED_BELOW or series is None:
        refused.append(f"megatron-core {v.megatron_core} is outside the supported range "
                       f">={SUPPORTED_MIN},<{SUPPORTED_BELOW}")
    if v.torch is None or Version(Version(v.torch).base_version) < TORCH_MIN:
        refused.append(f"torch {v.torch or 'missing'}: megatron-core needs torch >= {TORCH_MIN}")
    if series is not None:
        py = Version(_minor(v.python))
        if py < Version(series.python_min):
            if _minor(v.python) == PYTHON_BELOW_DECLARED_TESTED:
                untested.append(f"megatron-core {v.megatron_core} declares Python >= {series.python_min}; on "
                                f"Python {_minor(v.python)} it runs as a test configuration only")
            else:
                refused.append(f"megatron-core {v.megatron_core} needs Python >= {series.python_min}, found "
                               f"{v.python}")
        if v.transformer_engine == "unknown":
            untested.append("Transformer Engine is importable but its version is unknown (no package metadata)")
        elif v.transformer_engine is not None:
            te = Version(Version(v.transformer_engine).base_version)
            pairing = (f"megatron-core {series.series}.x pairs with Transformer Engine "
                       f">={series.te_min},<{series.te_below}")
            if te < Version(series.te_min) or (series.te_bound_declared and te >= Version(series.te_below)):
                refused.append(f"Transformer Engine {v.transformer_engine}: {pairing}")
            elif te >= Version(series.te_below):
                untested.append(f"Transformer Engine {v.transformer_engine} is newer than the pairing ({pairing})")
    if refused:
        return "refused", refused
    key = (_minor(v.python), v.megatron_core, v.transformer_engine, _minor(v.torch) if v.torch else None)
    if key in TESTED:
        return "tested", untested
    tested = "; ".join(f"Python {p} + megatron-core {m} + torch {t}, no TE" for p, m, _, t in TESTED)
    return "untested", [f"this combination is not run by CI (tested: {tested})", *untested]


def check(report, v: Installed | None = None, *, allow_untested: bool = False) -> None:
    """Add the version line, warnings and (unless allowed) the refusal to a validation report."""
    v = v or installed()
    level, reasons = assess(v)
    label = {"tested": "tested in CI", "untested": "untested", "refused": "outside the supported matrix"}[level]
    report.notes.append(f"versions: {v.summary()} ({label})")
    if level == "refused" and not allow_untested:
        report.error("run.allow_untested_versions", "unsupported versions: " + "; ".join(reasons),
                     "install a supported combination (docs/compatibility.md), or set "
                     "run.allow_untested_versions=true to run anyway")
        return
    prefix = "" if level == "tested" else "warning: "
    report.notes += [prefix + reason for reason in reasons]
    if level == "refused":
        report.notes.append("warning: running outside the supported matrix (run.allow_untested_versions=true)")
