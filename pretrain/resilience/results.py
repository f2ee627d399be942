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


def first_step_cause(m, precision: str) -> str:
    """What a non-finite loss or gradient norm in the first step a run trains points at: the config (that step's
    result comes before any optimizer update, so the learning rate is not its cause), naming the model's float
    settings (`m`: the model section) that differ from its preset and the defaults (and fp16, train.precision
    `precision`, which overflows where bf16 does not)."""
    import dataclasses
    import typing

    from model_providers import get_preset
    from pretrain.config import ModelConfig

    base = dataclasses.asdict(ModelConfig())
    preset = m.preset
    if preset:
        base.update(get_preset(preset))
    hints = typing.get_type_hints(ModelConfig)
    suspects = [f"model.{f.name}={getattr(m, f.name)}" for f in dataclasses.fields(ModelConfig)
                if float in (typing.get_args(hints[f.name]) or (hints[f.name],))
                and getattr(m, f.name) != base[f.name]]
    if precision == "fp16":
        suspects.append("train.precision=fp16")
    against = f"model.preset={preset} and the defaults" if preset else "the defaults"
    named = f" (set away from {against}: {', '.join(suspects)})" if suspects else ""
    return (f"this is the first step this run trains, before any optimizer update: optimizer.lr is not the cause; "
            f"the config is the likely one: check the model's numerics{named} and the data")


@dataclass
class Verdict:
    """What the re-run established about a step: the ranks that rejected it, why, the value that failed the check
    and its re-run, and the step's loss in both runs (of the first rank that rejected it)."""

    step: int
    verdict: str  # "transient" | "persistent"
    ranks: list[int]
    check: str
    first: float  # the value the check rejected: the loss, or a gradient bucket's local norm
    rerun: float  # the same value in the re-run
    first_loss: float
    rerun_loss: float
    action: str = ""

    @property
    def on_grad_norm(self) -> bool:
        return self.check.startswith("gradient norm")

    def record(self, action: str) -> dict:
        def num(x: float) -> float | str:  # JSON has no NaN: "nan", "inf"
            return x if math.isfinite(x) else str(x)

        record = {"rerun_step": self.step, "rerun_verdict": self.verdict, "rerun_ranks": self.ranks,
                  "rerun_check": self.check}
        if self.on_grad_norm:  # Megatron-Core's check of one DDP bucket's norm, before the data-parallel reduction
            record.update(rerun_first_grad_norm=num(self.first), rerun_grad_norm=num(self.rerun))
        record.update(rerun_first_loss=num(self.first_loss), rerun_loss=num(self.rerun_loss), rerun_action=action)
        return record

    def line(self, action: str) -> str:
        ranks = ", ".join(map(str, self.ranks))
        what = "gradient norm " if self.on_grad_norm else ""
        again = ("the re-run of the same data reproduced it" if self.verdict == "persistent" else
                 f"the re-run of the same data did not: {what or 'loss '}{self.rerun}")
        loss = f", loss {self.first_loss}" if self.on_grad_norm else ""
        return (f"step {self.step}: {self.check} on rank {ranks} ({what}{self.first} first{loss}; {again}): "
                f"{self.verdict} fault; {action}")


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
        self.rerun_values: dict[str, torch.Tensor] = {}  # check message -> its value in the re-run
        self.rsm.validate_result = self._recording(self.rsm.validate_result)

    def _recording(self, validate: Callable) -> Callable:
        """Megatron's `validate_result` (ours and DDP's gradient checks), keeping each value of a re-run: the
        re-run's value of the check that failed goes into the verdict."""
        from megatron.core.rerun_state_machine import RerunState

        def validate_result(result, rejection_func, message="unexpected result", *args, **kwargs):
            if self.rsm.state == RerunState.RERUNNING_IN_PLACE and isinstance(result, torch.Tensor):
                self.rerun_values[message] = result.detach()
            return validate(result, rejection_func, message, *args, **kwargs)

        return validate_result

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

        rsm, loss, first_loss, after = self.rsm, float("nan"), None, None
        window = self.state()  # the spike window as of step - 1: what the checkpoint of a stop holds
        self.rerun_values.clear()
        while rsm.should_run_forward_backward(None):
            loss = self.faults.loss(step, forward_backward())
            first_loss = loss if first_loss is None else first_loss
            if self.validating:
                self._validate(torch.tensor(loss, dtype=torch.float64))
            if rsm.state != RerunState.INITIAL_RUN:  # a re-run: the state to go on from, if it goes on
                after = self.step_state.snapshot()
        _, stop, code = rsm.should_checkpoint_and_exit()
        if not stop:
            return loss, None
        verdict = self._verdict(step, "persistent" if code == EXIT_CODE_RESUME_TO_DISAMBIGUATE else "transient",
                                math.nan if first_loss is None else first_loss, loss)
        rsm.failed_validation_call, rsm.initial_result = None, None
        self.agree_window()  # the rank that rejected the step did not count it in the spike window; the others did
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

    def _verdict(self, step: int, verdict: str, first_loss: float, loss: float) -> Verdict:
        """Every rank learns which ranks rejected the step, with which check, the value that failed it and its
        re-run, and the step's loss in both runs (one all-gather)."""
        rsm = self.rsm
        call = rsm.failed_validation_call
        check = _check_index(call.caller.message) if call is not None else 0
        first = float(rsm.initial_result.item()) if call is not None else math.nan
        again = self.rerun_values.get(call.caller.message) if call is not None else None
        again = float(again.item()) if again is not None else math.nan
        mine = torch.tensor([check, first, again, first_loss, loss], dtype=torch.float64, device=self.device)
        rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        rows = [r.tolist() for r in rows]
        ranks = [i for i, r in enumerate(rows) if r[0] > 0]
        row = rows[ranks[0]] if ranks else [0, math.nan, math.nan, first_loss, loss]
        name = _CHECKS[int(row[0]) - 1] if row[0] > 0 else "no check failed on any rank"
        return Verdict(step, verdict, ranks, name, *row[1:])

    def state(self) -> dict:
        """What a checkpoint keeps: the spike check's window and maximum (read at any layout)."""
        return {"large_value_counts": dict(self.rsm.large_value_counts), "max_values": dict(self.rsm.max_values),
                "current_iteration": int(self.rsm.current_iteration)}

    def agree_window(self) -> None:
        """Every rank's spike window becomes what the ranks counted together (the most values counted, the largest
        maximum, per context; collective): a checkpoint's common state is then the same on every rank, and a
        resume restores what every rank counted."""
        mine = (dict(self.rsm.large_value_counts), dict(self.rsm.max_values))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        counts: dict = {}
        maxima: dict = {}
        for rank_counts, rank_maxima in every:
            for context, n in rank_counts.items():
                counts[context] = max(counts.get(context, 0), n)
            for context, value in rank_maxima.items():
                maxima[context] = max(maxima.get(context, 0.0), value)
        self.rsm.large_value_counts, self.rsm.max_values = counts, maxima

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
