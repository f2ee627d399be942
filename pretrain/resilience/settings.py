"""The config sections of fault handling: `rerun`, `hang` and `testing` (dataclasses of the one config tree)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The environment variable that allows `testing.*` keys (fault injection): set by the test suite only.
TESTING_ENV = "PRETRAIN_TESTING"


@dataclass
class RerunConfig:
    """Result validation every step by Megatron-Core's `RerunStateMachine` (docs/training.md, "Faults")."""

    mode: Literal["disabled", "validate_results", "report_stats"] = "validate_results"
    spike_factor: float | None = 10.0  # a loss >= factor x the maximum of the first spike_window steps is a spike
    spike_window: int = 100  # steps whose loss sets that maximum (Megatron's num_samples)
    on_transient: Literal["continue", "stop"] = "continue"  # a result the re-run does not reproduce


@dataclass
class HangConfig:
    """The per-rank hang watchdog and the process groups' timeout."""

    enabled: bool = True
    factor: float = 10.0  # a step may take factor x the median step time ...
    floor_s: float = 600.0  # ... and at least this long
    long_s: float = 1800.0  # the first step, checkpoint saves and evaluation
    process_group_timeout_s: float | None = None  # the default process group's timeout; None: 10 minutes


@dataclass
class TestingConfig:
    """Faults injected on purpose (refused unless PRETRAIN_TESTING=1: the test suite). Steps are 1-based."""

    nan_step: int | None = None  # the loss is NaN at this step on rank nan_rank
    nan_rank: int = 0
    nan_times: Literal["once", "always"] = "once"  # once: transient (the re-run is clean); always: persistent
    spike_step: int | None = None  # the loss x spike_scale at this step on rank spike_rank (once)
    spike_rank: int = 0
    spike_scale: float = 1000.0
    spike_times: Literal["once", "always"] = "once"
    hang_step: int | None = None  # rank hang_rank sleeps forever in this step (before its first collective)
    hang_rank: int = 0
    hang_how: Literal["sleep", "sigstop"] = "sleep"  # sigstop: the rank stops itself (SIGSTOP)
    slow_rank: int | None = None  # this rank sleeps slow_s in every step's compute (a straggler)
    slow_s: float = 0.0
