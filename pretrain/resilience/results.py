"""Every step's result validated by Megatron-Core's `RerunStateMachine` (`rerun.mode`).

A NaN or Inf loss, or a loss >= `rerun.spike_factor` x the maximum of the first `rerun.spike_window` validated
steps, is rejected on the rank that sees it; every rank then re-runs the same step on the same data from the
same state (Megatron restores the RNG states, and the optimizer has not stepped yet). The re-run's result equal
to the first: *persistent* (the data or the model; Megatron's exit code 16, "re-run elsewhere"); different:
*transient* (a hardware fault; Megatron's 17). A persistent fault stops the run (`ResultRejected`); a transient
one goes on with the re-run's gradients (`rerun.on_transient=continue`) or stops too. With
`optimizer` gradients in the DDP buffers, Megatron-Core also validates each bucket's gradient norm inside the
same loop (`check_for_nan_in_grad`). Megatron validates from the second step a process runs on.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from pretrain.config import RerunConfig
from pretrain.resilience.faults import Faults

RESULT_EXIT = 3  # the exit status of a run stopped on purpose (as train.nan_policy=stop)
_CHECKS = ("loss is NaN", "loss is Inf", "loss spike", "gradient norm is NaN", "gradient norm is Inf")


def _check_index(message: str) -> int:
    """1-based index in _CHECKS of a validation message (Megatron-Core's DDP gradient checks included)."""
    if message in _CHECKS:
        return _CHECKS.index(message) + 1
    return 4 if "NaN" in message else 5


class ResultRejected(RuntimeError):
    """A rejected result stopped the run: `record` goes to exit_status.json and metrics.jsonl."""

    exit_code = RESULT_EXIT
    every_rank = True  # the verdict is all-gathered: every rank stops with the same line, printed by rank 0

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


@dataclass
class Verdict:
    """What the re-run established about a step: the ranks that rejected it, why, and both results."""

    step: int
    verdict: str  # "transient" | "persistent"
    ranks: list[int]
    check: str
    first: float
    rerun: float
    action: str = ""

    def record(self, action: str) -> dict:
        def num(x: float) -> float | str:  # JSON has no NaN: "nan", "inf"
            return x if math.isfinite(x) else str(x)

        return {"rerun_step": self.step, "rerun_verdict": self.verdict, "rerun_ranks": self.ranks,
                "rerun_check": self.check, "rerun_first_loss": num(self.first), "rerun_loss": num(self.rerun),
                "rerun_action": action}

    def line(self, action: str) -> str:
        ranks = ", ".join(map(str, self.ranks))
        again = ("the re-run of the same data reproduced it" if self.verdict == "persistent" else
                 f"the re-run of the same data did not: loss {self.rerun}")
        return (f"step {self.step}: {self.check} on rank {ranks} ({self.first} first; {again}): {self.verdict} "
                f"fault; {action}")


class _StepState:
    """What a run of the step changes besides the gradients and the RNG states Megatron restores itself: Megatron's
    model-parallel RNG tracker, and the MoE routers' aux-loss-free expert bias with its token counts (updated in
    `finalize_model_grads`, inside the step). Megatron's `state_save_func` / `state_restore_func`."""

    def __init__(self, model: list):
        self.buffers = [b for chunk in model for m in chunk.modules() for b in
                        (getattr(m, "expert_bias", None), getattr(m, "local_tokens_per_expert", None))
                        if isinstance(b, torch.Tensor)]

    def save(self) -> dict:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return {"tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
                "buffers": [b.detach().clone() for b in self.buffers]}

    def restore(self, state: dict) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["tracker"])
        with torch.no_grad():
            for b, saved in zip(self.buffers, state["buffers"]):
                b.copy_(saved)

    def snapshot(self) -> dict:
        """All of it with the RNG states: the state after a run of the step."""
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None, "other": self.save()}

    def back_to(self, s: dict) -> None:
        random.setstate(s["python"])
        np.random.set_state(s["numpy"])
        torch.set_rng_state(s["torch"])
        if s["cuda"] is not None:
            torch.cuda.set_rng_state(s["cuda"])
        self.restore(s["other"])


class ResultChecks:
    """The rerun state machine of this process, set up from `rerun.*` (a fresh one per `train()`)."""

    def __init__(self, rr: RerunConfig, nan_policy: str, faults: Faults, model: list, device: torch.device):
        from megatron.core import rerun_state_machine as m

        self.rr, self.nan_policy, self.faults, self.device = rr, nan_policy, faults, device
        self.step_state = _StepState(model)
        mode = {"disabled": m.RerunMode.DISABLED, "validate_results": m.RerunMode.VALIDATE_RESULTS,
                "report_stats": m.RerunMode.REPORT_DETERMINISM_STATS}[rr.mode]
        # Megatron's warnings speak of Megatron-LM's flow ("exiting now"); its errors name the rank and results.
        logging.getLogger(m.__name__).setLevel(logging.ERROR)
        m.destroy_rerun_state_machine()
        m.initialize_rerun_state_machine(mode=mode, state_save_func=self.step_state.save,
                                         state_restore_func=self.step_state.restore)
        self.rsm = m.get_rerun_state_machine()
        self.validating = rr.mode != "disabled"

    def _validate(self, value: torch.Tensor) -> None:
        rsm = self.rsm
        rsm.validate_result(value, torch.isnan, _CHECKS[0], fatal=True)
        rsm.validate_result(value, torch.isinf, _CHECKS[1], fatal=True)
        if self.rr.spike_factor is not None:
            large = partial(rsm.is_unexpectedly_large, threshold=self.rr.spike_factor, context="loss",
                            num_samples=self.rr.spike_window)
            rsm.validate_result(value, large, _CHECKS[2], fatal=True)

    def run_step(self, step: int, forward_backward: Callable[[], float]) -> tuple[float, Verdict | None]:
        """Run step `step` (1-based) through the state machine: (its loss, the verdict of a re-run or None).

        Raises `ResultRejected` when the step must not be applied (persistent, or transient with
        `rerun.on_transient=stop`): the model and optimizer are then still those of step `step - 1`."""
        from megatron.core.rerun_state_machine import EXIT_CODE_RESUME_TO_DISAMBIGUATE, RerunState

        rsm, loss, after = self.rsm, float("nan"), None
        window = self.state()  # the spike window as of step - 1: what the checkpoint of a stop holds
        while rsm.should_run_forward_backward(None):
            loss = self.faults.loss(step, forward_backward())
            if self.validating:
                self._validate(torch.tensor(loss, dtype=torch.float64))
            if rsm.state != RerunState.INITIAL_RUN:  # a re-run: the state to go on from, if it goes on
                after = self.step_state.snapshot()
        _, stop, code = rsm.should_checkpoint_and_exit()
        if not stop:
            return loss, None
        verdict = self._verdict(step, "persistent" if code == EXIT_CODE_RESUME_TO_DISAMBIGUATE else "transient",
                                loss)
        rsm.failed_validation_call, rsm.initial_result = None, None
        nan = verdict.check != _CHECKS[2]
        if verdict.verdict == "transient" and self.rr.on_transient == "continue":
            verdict.action = "continuing with the re-run's result (rerun.on_transient=continue)"
        elif verdict.verdict == "persistent" and nan and self.nan_policy == "skip":
            verdict.action = "its batch is skipped (train.nan_policy=skip)"
        else:
            why = ("rerun.on_transient=stop" if verdict.verdict == "transient" else
                   "train.nan_policy=stop" if nan else "a spike the re-run reproduces")
            action = f"stopped with the checkpoint of step {step - 1} ({why})"
            self.load_window(window)
            if verdict.verdict == "persistent":
                action += f"; to go past it, restart with train.skip_steps=[{step}]"
            raise ResultRejected(verdict.line(action), verdict.record(action))
        rsm.state = RerunState.NOT_RUNNING_YET  # the re-run's result goes on; RNG, expert bias as after it
        self.step_state.back_to(after)
        return loss, verdict

    def _verdict(self, step: int, verdict: str, loss: float) -> Verdict:
        """Every rank learns which ranks rejected the step, with which check and results (one all-gather)."""
        rsm = self.rsm
        call = rsm.failed_validation_call
        check = _check_index(call.caller.message) if call is not None else 0
        first = float(rsm.initial_result.item()) if call is not None else math.nan
        mine = torch.tensor([check, first, loss], dtype=torch.float64, device=self.device)
        rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        rows = [r.tolist() for r in rows]
        ranks = [i for i, r in enumerate(rows) if r[0] > 0]
        row = rows[ranks[0]] if ranks else [1, math.nan, loss]
        return Verdict(step, verdict, ranks, _CHECKS[int(row[0]) - 1], row[1], row[2])

    def state(self) -> dict:
        """What a checkpoint keeps: the spike check's window and maximum (read at any layout)."""
        return {"large_value_counts": dict(self.rsm.large_value_counts), "max_values": dict(self.rsm.max_values),
                "current_iteration": int(self.rsm.current_iteration)}

    def load(self, state: dict) -> None:
        """On resume: the checkpoint's spike window; the first step is validated too (a checkpoint exists)."""
        self.rsm.first_iteration_complete = True
        self.load_window(state)

    def load_window(self, state: dict) -> None:
        if state:
            self.rsm.large_value_counts = dict(state.get("large_value_counts", {}))
            self.rsm.max_values = dict(state.get("max_values", {}))
            self.rsm.current_iteration = int(state.get("current_iteration", -1))


_ACTIVE: list[ResultChecks] = []


def checkpoint_state() -> dict | None:
    """The active run's rerun state for a checkpoint's common state (None outside a run)."""
    return _ACTIVE[-1].state() if _ACTIVE else None
